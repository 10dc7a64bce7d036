"""lora_bgmv (per-token gathered decode LoRA), both variants in interpret mode, against a float64
numpy recompute of the forward and the analytic gradients (dx, dA, dB)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import VARIANTS, lora_bgmv, lora_bgmv_reference
from pallas_testing import check_against_np, close, group_idx, lora_np, rand


def _inputs(seed, idx, n, d_in, d_out, r, dtype=jnp.float32):
    T = idx.shape[0]
    x = rand(seed, (T, d_in), dtype)
    A = rand(seed + 1, (n, d_in, r), dtype, scale=d_in ** -0.5)
    B = rand(seed + 2, (n, r, d_out), dtype)
    w = rand(seed + 3, (T, d_out))
    return x, A, B, w


def _check(idx, x, A, B, w, **kw):
    y, (_, dA, dB) = check_against_np(lambda x, A, B: lora_bgmv(x, A, B, idx, **kw), (x, A, B),
                                      w, lora_np(x, A, B, idx, w))
    empty = np.setdiff1d(np.arange(A.shape[0]), np.asarray(idx))
    assert np.all(np.asarray(dA)[empty] == 0) and np.all(np.asarray(dB)[empty] == 0)
    return y


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("case,d_in,d_out,r", [
    ("random_with_empty", 40, 72, 6),          # dims not multiples of 16, odd rank
    ("one_token_per_slot", 32, 48, 16),
])
def test_float32_forward_and_grads(platform, case, d_in, d_out, r):
    idx, n = group_idx(d_in + r, case)
    _check(idx, *_inputs(r, idx, n, d_in, d_out, r), platform=platform)


@pytest.mark.parametrize("platform", VARIANTS)
def test_bfloat16_forward_and_grads(platform):
    idx, n = group_idx(3, "one_token_per_slot")
    y = _check(idx, *_inputs(4, idx, n, 32, 48, 8, jnp.bfloat16), platform=platform)
    assert y.dtype == jnp.bfloat16


def test_out_of_range_ids_are_clipped():
    idx = jnp.array([-3, 0, 1, 7], jnp.int32)
    x, A, B, _ = _inputs(5, idx, 2, 16, 16, 4)
    clipped = np.clip(np.asarray(idx), 0, 1)
    close(lora_bgmv(x, A, B, idx), lora_np(x, A, B, clipped, np.zeros((4, 16)))[0], 1e-4)


def test_jit_grad_through_layer_scan():
    L, d, r = 3, 32, 4
    idx, n = group_idx(6, "one_token_per_slot")
    x = rand(7, (idx.shape[0], d))
    A = rand(8, (L, n, d, r), scale=d ** -0.5)
    B = rand(9, (L, n, r, d), scale=r ** -0.5)

    def model(fn):
        def loss(x, A, B):
            def layer(h, ab):
                return h + jnp.tanh(fn(h, ab[0], ab[1], idx)), None
            h, _ = jax.lax.scan(layer, x, (A, B))
            return jnp.sum(h ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, A, B)

    v, g = model(lora_bgmv)
    vr, gr = model(lora_bgmv_reference)
    close(v, vr, 1e-5)
    for a, b in zip(g, gr):
        close(a, b, 1e-4)
