"""reft_apply (batched LoReFT / DiReFT intervention) against the jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reft_apply, reft_apply_reference
from pallas_testing import check_against_reference, close, rand, randint


def _inputs(seed, T, d, r, N, dtype=jnp.float32, used=None):
    h = rand(seed, (T, d), dtype)
    R = rand(seed + 1, (N, r, d), dtype, scale=d ** -0.5)
    W = rand(seed + 2, (N, r, d), dtype, scale=d ** -0.5)
    b = rand(seed + 3, (N, r), dtype)
    subtract = jnp.asarray(np.arange(N) % 2 == 0, jnp.float32)       # mix LoReFT and DiReFT slots
    idx = randint(seed + 4, (T,), range(N) if used is None else used)
    w = rand(seed + 5, (T, d))
    return h, R, W, b, subtract, idx, w


def _check(h, R, W, b, subtract, idx, w, fwd_tol=1e-5, grad_tol=1e-4, rel_grad=False, **kw):
    return check_against_reference(
        lambda h, R, W, b: reft_apply(h, R, W, b, subtract, idx, **kw),
        lambda h, R, W, b: reft_apply_reference(h, R, W, b, subtract, idx),
        (h, R, W, b), w, fwd_tol, grad_tol, rel_grad)


@pytest.mark.parametrize("T,d,r,N,bt", [(37, 32, 4, 5, 8), (20, 64, 8, 3, 16), (23, 32, 6, 1, 8)])
def test_forward_and_grads_match_reference(T, d, r, N, bt):
    _check(*_inputs(10 * T + N, T, d, r, N), block_tokens=bt)


def test_forward_matches_float64_numpy():
    h, R, W, b, s, idx, _ = _inputs(1, 27, 32, 4, 4)
    y = reft_apply(h, R, W, b, s, idx, block_tokens=8)
    hn, Rn, Wn, bn, sn = (np.asarray(v, np.float64) for v in (h, R, W, b, s))
    ref = []
    for t, g in enumerate(np.asarray(idx)):
        ref.append(hn[t] + Rn[g].T @ (Wn[g] @ hn[t] + bn[g] - sn[g] * (Rn[g] @ hn[t])))
    np.testing.assert_allclose(np.asarray(y, np.float64), np.stack(ref), rtol=1e-5, atol=1e-5)


def test_zero_R_slot_is_identity():
    h, R, W, b, s, idx, _ = _inputs(2, 30, 32, 4, 4)
    R = R.at[0].set(0.0)
    idx = idx.at[::3].set(0)
    y = np.asarray(reft_apply(h, R, W, b, s, idx, block_tokens=8))
    base = np.asarray(idx) == 0
    assert np.all(y[base] == np.asarray(h)[base])
    assert np.all(np.abs(y[~base] - np.asarray(h)[~base]).sum(-1) > 0)


def test_distinct_adapter_per_token_catches_permutation_errors():
    T = N = 12
    h, R, W, b, s, _, w = _inputs(3, T, 32, 4, N)
    idx = jnp.arange(T, dtype=jnp.int32)[::-1]
    _check(h, R, W, b, s, idx, w, block_tokens=8)


def test_large_bank_few_used_adapters_interleaved():
    used = [0, 9, 31, 63]
    h, R, W, b, s, idx, w = _inputs(4, 45, 32, 4, 64, used=used)
    _, (_, gR, gW, gb) = _check(h, R, W, b, s, idx, w, block_tokens=8)
    unused = np.setdiff1d(np.arange(64), used)
    for g in (gR, gW, gb):
        assert np.all(np.asarray(g)[unused] == 0)


def test_bfloat16():
    h, R, W, b, s, idx, w = _inputs(5, 33, 32, 8, 4, dtype=jnp.bfloat16)
    y, _ = _check(h, R, W, b, s, idx, w, fwd_tol=5e-2, grad_tol=3e-2, rel_grad=True)
    assert y.dtype == jnp.bfloat16


def test_jit_grad_through_layer_scan():
    L, T, d, r, N = 3, 26, 32, 4, 4
    h = rand(6, (T, d))
    R = rand(7, (L, N, r, d), scale=d ** -0.5)
    W = rand(8, (L, N, r, d), scale=d ** -0.5)
    b = rand(9, (L, N, r))
    s = jnp.asarray([1.0, 0.0, 1.0, 0.0])
    idx = randint(10, (T,), range(N))

    def model(fn):
        def loss(h, R, W, b):
            def layer(x, p):
                return jnp.tanh(fn(x, p[0], p[1], p[2], s, idx)), None
            x, _ = jax.lax.scan(layer, h, (R, W, b))
            return jnp.sum(x ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(h, R, W, b)

    v, g = model(lambda *a: reft_apply(*a, block_tokens=8))
    vr, gr = model(reft_apply_reference)
    close(v, vr, 1e-4)
    for a, c in zip(g, gr):
        close(a, c, 1e-3)
