"""lora_sgmv (grouped prefill LoRA) against the jnp reference and a float64 numpy recompute."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lora_sgmv, lora_sgmv_reference
from pallas_kernels._group_layout import group_layout, padded_rows
from pallas_testing import check_against_reference, close, rand, randint


def _inputs(seed, T, d_in, d_out, r, N, dtype=jnp.float32, used=None):
    x = rand(seed, (T, d_in), dtype)
    A = rand(seed + 1, (N, d_in, r), dtype, scale=d_in ** -0.5)
    B = rand(seed + 2, (N, r, d_out), dtype)
    idx = randint(seed + 3, (T,), range(N) if used is None else used)
    w = rand(seed + 4, (T, d_out))
    return x, A, B, idx, w


def _kernel(**kw):
    return lambda x, A, B, idx: lora_sgmv(x, A, B, idx, **kw)


def _check(fn, x, A, B, idx, w, fwd_tol=1e-5, grad_tol=1e-4, rel_grad=False):
    return check_against_reference(lambda x, A, B: fn(x, A, B, idx),
                                   lambda x, A, B: lora_sgmv_reference(x, A, B, idx),
                                   (x, A, B), w, fwd_tol, grad_tol, rel_grad)


@pytest.mark.parametrize("T,d_in,d_out,r,N,bt,bo", [
    (37, 32, 48, 4, 5, 8, None),     # T not a multiple of the tile
    (20, 64, 32, 8, 3, 16, 16),      # default tile, d_out tiled by a second grid axis
    (23, 32, 40, 6, 1, 8, 16),       # N = 1, odd rank, d_out padded up to the out tile
])
def test_forward_and_grads_match_reference(T, d_in, d_out, r, N, bt, bo):
    _check(_kernel(block_tokens=bt, block_out=bo), *_inputs(10 * T + N, T, d_in, d_out, r, N))


def test_forward_matches_float64_numpy():
    x, A, B, idx, _ = _inputs(1, 29, 32, 40, 4, 4)
    y = lora_sgmv(x, A, B, idx, block_tokens=8)
    xn, An, Bn = (np.asarray(v, np.float64) for v in (x, A, B))
    ix = np.asarray(idx)
    ref = np.stack([xn[t] @ An[ix[t]] @ Bn[ix[t]] for t in range(xn.shape[0])])
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=1e-5, atol=1e-5)


def test_slot0_zero_weights_give_zero_delta():
    x, A, B, idx, _ = _inputs(2, 30, 32, 32, 4, 4)
    A, B = A.at[0].set(0.0), B.at[0].set(0.0)
    idx = idx.at[::3].set(0)
    y = np.asarray(lora_sgmv(x, A, B, idx, block_tokens=8))
    base = np.asarray(idx) == 0
    assert np.all(y[base] == 0.0)
    assert np.all(np.abs(y[~base]).sum(-1) > 0)
    close(y, lora_sgmv_reference(x, A, B, idx), 1e-5)


def test_distinct_adapter_per_token_catches_permutation_errors():
    # every token has its own slot, in reversed order: any sort/unsort mistake moves rows
    T = N = 12
    x, A, B, _, w = _inputs(3, T, 32, 32, 4, N)
    idx = jnp.arange(T, dtype=jnp.int32)[::-1]
    _check(_kernel(block_tokens=8), x, A, B, idx, w)


def test_large_bank_few_used_adapters_interleaved():
    used = [0, 7, 33, 63]
    x, A, B, idx, w = _inputs(4, 45, 32, 32, 4, 64, used=used)
    _, (_, gA, gB) = _check(_kernel(block_tokens=8), x, A, B, idx, w)
    unused = np.setdiff1d(np.arange(64), used)
    assert np.all(np.asarray(gA)[unused] == 0) and np.all(np.asarray(gB)[unused] == 0)


def test_bfloat16():
    x, A, B, idx, w = _inputs(5, 33, 32, 48, 8, 4, dtype=jnp.bfloat16)
    y, _ = _check(_kernel(), x, A, B, idx, w, fwd_tol=5e-2, grad_tol=3e-2, rel_grad=True)
    assert y.dtype == jnp.bfloat16


def test_jit_grad_through_layer_scan():
    L, T, d, r, N = 3, 26, 32, 4, 4
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

    v, g = model(_kernel(block_tokens=8))
    vr, gr = model(lora_sgmv_reference)
    close(v, vr, 1e-4)
    for a, b in zip(g, gr):
        close(a, b, 1e-3)


def test_layout_is_a_valid_tiling():
    idx = jnp.array([3, 0, 3, 1, 1, 3, 0, 3, 3], jnp.int32)
    bt, N = 4, 5
    lay = group_layout(idx, N, bt)
    P = padded_rows(idx.shape[0], N, bt)
    dest, tg = np.asarray(lay.dest), np.asarray(lay.tile_group)
    assert len(set(dest.tolist())) == idx.shape[0] and dest.max() < P
    assert np.all(tg[dest // bt] == np.asarray(idx))                    # each row in its slot's tile
    assert np.all(np.diff(dest[np.asarray(idx) == 3]) > 0)              # stable within a slot
    assert int(lay.num_used[0]) == 1 + 1 + 2                            # slots 0, 1, 3 (5 tokens)
    assert np.all(np.diff(tg) >= 0)
