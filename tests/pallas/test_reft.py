"""reft_apply (batched LoReFT / DiReFT intervention), both variants in interpret mode, against a
float64 numpy recompute of the forward and the analytic gradients (dh, dR, dW, db)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import VARIANTS, make_group_metadata, reft_apply, reft_apply_reference
from pallas_testing import check_against_np, close, group_idx, rand, reft_np


def _inputs(seed, idx, n, d, r, dtype=jnp.float32):
    T = idx.shape[0]
    h = rand(seed, (T, d), dtype)
    R = rand(seed + 1, (n, r, d), dtype, scale=d ** -0.5)
    W = rand(seed + 2, (n, r, d), dtype, scale=d ** -0.5)
    b = rand(seed + 3, (n, r), dtype)
    subtract = jnp.asarray(np.arange(n) % 2 == 0, jnp.float32)      # LoReFT and DiReFT slots
    w = rand(seed + 4, (T, d))
    return h, R, W, b, subtract, w


def _check(idx, h, R, W, b, s, w, **kw):
    y, grads = check_against_np(lambda h, R, W, b: reft_apply(h, R, W, b, s, idx, **kw),
                                (h, R, W, b), w, reft_np(h, R, W, b, s, idx, w))
    empty = np.setdiff1d(np.arange(R.shape[0]), np.asarray(idx))
    for g in grads[1:]:
        assert np.all(np.asarray(g)[empty] == 0)
    return y


@pytest.mark.parametrize("platform", VARIANTS)
@pytest.mark.parametrize("case,d,r,bt", [
    ("random_with_empty", 40, 6, 16),          # d not a multiple of 16, odd rank (GPU pads)
    ("one_slot_all_tokens", 64, 8, 32),
    ("one_token_per_slot", 32, 4, 16),
])
def test_float32_forward_and_grads(platform, case, d, r, bt):
    idx, n = group_idx(d + r, case)
    _check(idx, *_inputs(r, idx, n, d, r), platform=platform, block_tokens=bt)


@pytest.mark.parametrize("platform", VARIANTS)
def test_bfloat16_forward_and_grads(platform):
    idx, n = group_idx(5, "random_with_empty")
    y = _check(idx, *_inputs(6, idx, n, 48, 8, jnp.bfloat16), platform=platform)
    assert y.dtype == jnp.bfloat16


def test_zero_R_slot_is_exact_identity():
    idx, n = group_idx(7, "random_with_empty")
    h, R, W, b, s, _ = _inputs(8, idx, n, 32, 4)
    R = R.at[0].set(0.0)
    idx = idx.at[::3].set(0)
    y = np.asarray(reft_apply(h, R, W, b, s, idx))
    base = np.asarray(idx) == 0
    assert np.all(y[base] == np.asarray(h)[base])
    assert np.all(np.abs(y[~base] - np.asarray(h)[~base]).sum(-1) > 0)


def test_shared_metadata_and_layer_scan():
    L, d, r = 3, 32, 4
    idx, n = group_idx(9, "random_with_empty")
    h = rand(10, (idx.shape[0], d))
    R = rand(11, (L, n, r, d), scale=d ** -0.5)
    W = rand(12, (L, n, r, d), scale=d ** -0.5)
    b = rand(13, (L, n, r))
    s = jnp.asarray(np.arange(n) % 2, jnp.float32)
    md = make_group_metadata(idx, n)

    def model(fn):
        def loss(h, R, W, b):
            def layer(x, p):
                return jnp.tanh(fn(x, p[0], p[1], p[2], s, idx)), None
            x, _ = jax.lax.scan(layer, h, (R, W, b))
            return jnp.sum(x ** 2)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(h, R, W, b)

    v, g = model(lambda *a: reft_apply(*a, metadata=md))
    vr, gr = model(reft_apply_reference)
    close(v, vr, 1e-5)
    for a, c in zip(g, gr):
        close(a, c, 1e-4)
