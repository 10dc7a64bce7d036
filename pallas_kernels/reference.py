"""Plain-jnp references (float32 math) for the public ops and the grouped weight-gradient kernel."""
from __future__ import annotations

import jax.numpy as jnp

from .metadata import GroupMetadata


def lora_sgmv_reference(x, A, B, adapter_idx):
    """delta[t] = (x[t] @ A[g]) @ B[g], g = adapter_idx[t] (clipped); per-token gather; x.dtype."""
    idx = jnp.clip(adapter_idx, 0, A.shape[0] - 1)
    xf = x.astype(jnp.float32)
    Ag = A.astype(jnp.float32)[idx]                                          # [T, d_in, r]
    Bg = B.astype(jnp.float32)[idx]                                          # [T, r, d_out]
    xa = jnp.einsum("td,tdr->tr", xf, Ag)
    return jnp.einsum("tr,tro->to", xa, Bg).astype(x.dtype)


lora_bgmv_reference = lora_sgmv_reference


def reft_apply_reference(h, R, W, b, subtract, adapter_idx):
    """h[t] + R[g]^T (W[g] h[t] + b[g] - subtract[g] R[g] h[t]), g = adapter_idx[t]; h.dtype."""
    idx = jnp.clip(adapter_idx, 0, R.shape[0] - 1)
    hf = h.astype(jnp.float32)
    Rt = R.astype(jnp.float32)[idx]                                          # [T, r, d]
    Wt = W.astype(jnp.float32)[idx]
    s = subtract.astype(jnp.float32)[idx][:, None]
    edit = (jnp.einsum("trd,td->tr", Wt, hf) + b.astype(jnp.float32)[idx]
            - s * jnp.einsum("trd,td->tr", Rt, hf))
    return (hf + jnp.einsum("trd,tr->td", Rt, edit)).astype(h.dtype)


def grouped_outer_reference(L, R, md: GroupMetadata):
    """out[g] = sum of L[p]^T R[p] over the rows p of slot g's tiles (float32 [N, a, b])."""
    tile_of_row = jnp.arange(md.num_rows) // md.block_tokens
    group = md.tile_group[tile_of_row]
    real = tile_of_row < md.num_used[0]
    onehot = (group[:, None] == jnp.arange(md.num_groups)[None, :]) & real[:, None]
    return jnp.einsum("pn,pa,pb->nab", onehot.astype(jnp.float32), L.astype(jnp.float32),
                      R.astype(jnp.float32))
