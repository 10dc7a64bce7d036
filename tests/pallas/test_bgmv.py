"""lora_bgmv (per-token gathered decode LoRA) against the jnp reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora_bgmv, lora_sgmv_reference
from pallas_testing import check_against_reference, close, rand, randint


def _inputs(seed, T, d_in, d_out, r, N, dtype=jnp.float32, used=None):
    x = rand(seed, (T, d_in), dtype)
    A = rand(seed + 1, (N, d_in, r), dtype, scale=d_in ** -0.5)
    B = rand(seed + 2, (N, r, d_out), dtype)
    idx = randint(seed + 3, (T,), range(N) if used is None else used)
    w = rand(seed + 4, (T, d_out))
    return x, A, B, idx, w


def _check(x, A, B, idx, w, fwd_tol=1e-5, grad_tol=1e-4, rel_grad=False):
    return check_against_reference(lambda x, A, B: lora_bgmv(x, A, B, idx),
                                   lambda x, A, B: lora_sgmv_reference(x, A, B, idx),
                                   (x, A, B), w, fwd_tol, grad_tol, rel_grad)


@pytest.mark.parametrize("T,d_in,d_out,r,N", [(21, 32, 48, 4, 5), (8, 64, 32, 8, 1)])
def test_forward_and_grads_match_reference(T, d_in, d_out, r, N):
    _check(*_inputs(10 * T + N, T, d_in, d_out, r, N))


def test_forward_matches_float64_numpy_distinct_adapters():
    # every token its own slot, reversed: a wrong gather would move rows
    x, A, B, _, _ = _inputs(1, 10, 32, 40, 4, 10)
    idx = jnp.arange(10, dtype=jnp.int32)[::-1]
    y = lora_bgmv(x, A, B, idx)
    xn, An, Bn = (np.asarray(v, np.float64) for v in (x, A, B))
    ix = np.asarray(idx)
    ref = np.stack([xn[t] @ An[ix[t]] @ Bn[ix[t]] for t in range(10)])
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-5)


def test_large_bank_few_used_slot0_zero():
    used = [0, 5, 40, 63]
    x, A, B, idx, w = _inputs(2, 24, 32, 32, 4, 64, used=used)
    A, B = A.at[0].set(0.0), B.at[0].set(0.0)
    y, (_, gA, gB) = _check(x, A, B, idx, w)
    base = np.asarray(idx) == 0
    assert base.any() and np.all(np.asarray(y)[base] == 0.0)
    unused = np.setdiff1d(np.arange(64), used)
    assert np.all(np.asarray(gA)[unused] == 0) and np.all(np.asarray(gB)[unused] == 0)


def test_bfloat16():
    x, A, B, idx, w = _inputs(3, 12, 32, 48, 8, 4, dtype=jnp.bfloat16)
    y, _ = _check(x, A, B, idx, w, fwd_tol=5e-2, grad_tol=3e-2, rel_grad=True)
    assert y.dtype == jnp.bfloat16


def test_jit_grad_through_layer_scan():
    L, T, d, r, N = 3, 6, 32, 4, 4
    x = rand(6, (T, d))
    A = rand(7, (L, N, d, r), scale=d ** -0.5)
    B = rand(8, (L, N, r, d), scale=r ** -0.5)
    idx = randint(9, (T,), range(N))

    def model(fn):
        def loss(x, A, B):
            def layer(h, ab):
                return h + jnp.tanh(fn(h, ab[0], ab[1], idx)), None
            h, _ = jax.lax.scan(layer, x, (A, B))
            return jnp.sum(h ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, A, B)

    v, g = model(lora_bgmv)
    vr, gr = model(lora_sgmv_reference)
    close(v, vr, 1e-4)
    for a, b in zip(g, gr):
        close(a, b, 1e-3)
