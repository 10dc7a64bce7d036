"""Helpers for the Pallas kernel tests (inputs from fixed-seed jax.random pools, checks)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

_POOL = 1 << 14  # one fixed draw shape, so jax.random compiles once per session


@functools.lru_cache(maxsize=None)
def _normal_pool(seed):
    return np.asarray(jax.random.normal(jax.random.key(seed), (_POOL,), jnp.float32))


@functools.lru_cache(maxsize=None)
def _int_pool(seed):
    return np.asarray(jax.random.randint(jax.random.key(seed), (_POOL,), 0, 1 << 30))


def rand(seed, shape, dtype=jnp.float32, scale=1.0):
    """Non-zero standard-normal array of `shape` from seed `seed`."""
    n = int(np.prod(shape))
    assert n <= _POOL
    return jnp.asarray(_normal_pool(seed)[:n].reshape(shape) * scale, dtype)


def randint(seed, shape, values):
    """int32 array of `shape` drawn uniformly from the list `values`."""
    n = int(np.prod(shape))
    values = np.asarray(values)
    return jnp.asarray(values[_int_pool(seed)[:n] % len(values)].reshape(shape), jnp.int32)


def close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=tol, atol=tol)


def value_and_grads(fn, args, weights):
    """(output, grads wrt all args) of sum(fn(*args) * weights), jitted."""
    def loss(*a):
        y = fn(*a)
        return jnp.sum(y.astype(jnp.float32) * weights), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))),
                                           has_aux=True))(*args)
    return y, g


def check_against_reference(fn, ref, args, weights, fwd_tol, grad_tol, rel_grad=False):
    """Forward and gradients of fn equal those of ref; returns fn's (output, grads)."""
    y, g = value_and_grads(fn, args, weights)
    yr, gr = value_and_grads(ref, args, weights)
    assert y.dtype == yr.dtype and y.shape == yr.shape
    close(y, yr, fwd_tol)
    for gi, gri, a in zip(g, gr, args):
        assert gi.dtype == a.dtype and gi.shape == a.shape
        s = max(float(jnp.abs(gri.astype(jnp.float32)).max()), 1e-6) if rel_grad else 1.0
        close(np.asarray(gi, np.float32) / s, np.asarray(gri, np.float32) / s, grad_tol)
    return y, g
