"""lora_sgmv (grouped prefill/training LoRA), both variants in interpret mode, against a float64
numpy recompute of the forward and the analytic gradients (dx, dA, dB)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import VARIANTS, lora_sgmv, lora_sgmv_reference, make_group_metadata
from pallas_testing import check_against_np, close, group_idx, lora_np, rand


def _inputs(seed, idx, n, d_in, d_out, r, dtype=jnp.float32):
    T = idx.shape[0]
    x = rand(seed, (T, d_in), dtype)
    A = rand(seed + 1, (n, d_in, r), dtype, scale=d_in ** -0.5)
    B = rand(seed + 2, (n, r, d_out), dtype)
    w = rand(seed + 3, (T, d_out))
    return x, A, B, w


def _check(idx, x, A, B, w, **kw):
    y, (dx, dA, dB) = check_against_np(lambda x, A, B: lora_sgmv(x, A, B, idx, **kw), (x, A, B),
                                       w, lora_np(x, A, B, idx, w))
    empty = np.setdiff1d(np.arange(A.shape[0]), np.asarray(idx))
    assert np.all(np.asarray(dA)[empty] == 0) and np.all(np.asarray(dB)[empty] == 0)
    return y


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("case,d_in,d_out,r,bt", [
    ("random_with_empty", 40, 72, 6, 16),      # dims not multiples of 16, odd rank (GPU pads)
    ("one_slot_all_tokens", 64, 48, 8, 32),
    ("one_token_per_slot", 32, 80, 16, 16),    # any sort / unsort mistake moves rows
])
def test_float32_forward_and_grads(platform, case, d_in, d_out, r, bt):
    idx, n = group_idx(d_in + r, case)
    _check(idx, *_inputs(r, idx, n, d_in, d_out, r), platform=platform, block_tokens=bt)


@pytest.mark.parametrize("platform", VARIANTS)
def test_bfloat16_forward_and_grads(platform):
    idx, n = group_idx(5, "random_with_empty")
    y = _check(idx, *_inputs(6, idx, n, 48, 64, 8, jnp.bfloat16), platform=platform)
    assert y.dtype == jnp.bfloat16


@pytest.mark.parametrize("platform,block_out", [("tpu", 128), ("gpu", 32)])
def test_output_columns_split_across_programs(platform, block_out):
    idx, n = group_idx(7, "random_with_empty")
    _check(idx, *_inputs(8, idx, n, 32, 200, 4), platform=platform, block_out=block_out)


def test_shared_metadata_matches_per_call_layout_and_is_checked():
    idx, n = group_idx(9, "random_with_empty")
    x, A, B, _ = _inputs(10, idx, n, 32, 48, 4)
    md = make_group_metadata(idx, n, 32)
    for platform in VARIANTS:
        shared = lora_sgmv(x, A, B, idx, metadata=md, platform=platform)
        own = lora_sgmv(x, A, B, idx, block_tokens=32, platform=platform)
        np.testing.assert_array_equal(np.asarray(shared), np.asarray(own))
    with pytest.raises(ValueError, match="block_tokens"):
        lora_sgmv(x, A, B, idx, metadata=md, block_tokens=16)
    with pytest.raises(ValueError, match="slots"):
        lora_sgmv(x, A[:-1], B[:-1], idx, metadata=md)


def test_slot0_zero_weights_give_exact_zero_delta():
    idx, n = group_idx(11, "random_with_empty")
    x, A, B, _ = _inputs(12, idx, n, 32, 32, 4)
    A, B = A.at[0].set(0.0), B.at[0].set(0.0)
    idx = idx.at[::3].set(0)
    y = np.asarray(lora_sgmv(x, A, B, idx))
    base = np.asarray(idx) == 0
    assert np.all(y[base] == 0.0) and np.all(np.abs(y[~base]).sum(-1) > 0)


def test_empty_token_batch():
    y = lora_sgmv(jnp.zeros((0, 8)), jnp.ones((2, 8, 4)), jnp.ones((2, 4, 16)),
                  jnp.zeros((0,), jnp.int32))
    assert y.shape == (0, 16)


@pytest.mark.parametrize("platform", VARIANTS)
def test_jit_grad_through_layer_scan(platform):
    L, d, r = 3, 32, 4
    idx, n = group_idx(13, "random_with_empty")
    x = rand(14, (idx.shape[0], d))
    A = rand(15, (L, n, d, r), scale=d ** -0.5)
    B = rand(16, (L, n, r, d), scale=r ** -0.5)
    md = make_group_metadata(idx, n)

    def model(fn):
        def loss(x, A, B):
            def layer(h, ab):
                return h + jnp.tanh(fn(h, ab[0], ab[1])), None
            h, _ = jax.lax.scan(layer, x, (A, B))
            return jnp.sum(h ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, A, B)

    v, g = model(lambda h, a, b: lora_sgmv(h, a, b, idx, metadata=md, platform=platform))
    vr, gr = model(lambda h, a, b: lora_sgmv_reference(h, a, b, idx))
    close(v, vr, 1e-5)
    for a, b in zip(g, gr):
        close(a, b, 1e-4)
