"""Multi-adapter LoRA and ReFT math on flattened tokens, one function per layout (no dispatch here).

`preft_jax.adapters.context.AdapterContext` picks one of these per step; layers never call them
directly. Shapes: x, h [T, d]; A [N, d_in, r]; B [N, r, d_out] (LoRA scale folded in);
R, W [N, r, d]; b [N, r]; subtract [N] (1.0 LoReFT, 0.0 DiReFT); slots int32 [T] in [0, N).

Numerics (all layouts): the LoRA shrink x @ A accumulates in float32 and is rounded to B.dtype for
the expand, which accumulates in float32; the result is x.dtype. ReFT edits are computed in float32
and the residual add is float32, rounded to h.dtype.

Isolation: no slot's weights can reach a row that does not use that slot. Gathers read only the
row's own slot; the masked path (small and mid-size banks) and the ragged-dot path zero non-finite
slots before the products (a dense product over every slot, or XLA's ragged_dot, which expands to a
dense group-masked dot on CPU and on NVIDIA GPUs, would otherwise carry a NaN in any slot to every
row, since NaN * 0 = NaN) and mark the rows of such a slot NaN afterwards.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


# ---- LoRA ------------------------------------------------------------------------------------
def lora_gather(x, A, B, slots):
    """Per-token gather (BGMV-style): row t multiplies A[slots[t]], B[slots[t]]. Decode layout."""
    xa = jnp.einsum("td,tdr->tr", x, A[slots], preferred_element_type=F32)
    out = jnp.einsum("tr,tro->to", xa.astype(B.dtype), B[slots], preferred_element_type=F32)
    return out.astype(x.dtype)


def lora_rows(x, A, B, row_slots, slots):
    """Chunks whose rows each hold one adapter (SGMV by sequence, as vLLM's punica prefill): x [R * C, d_in]
    row-major over R rows of C tokens, row_slots int32 [R]; each row gathers its slot's A and B once and
    multiplies its C tokens by them (the FLOPs of one LoRA, whatever the bank's size). A token keeps the
    delta when its slot is its row's; a base token gets 0 (slot 0 is the base: zeros in every bank); a
    token of any other slot breaks the layout's contract and gets NaN rather than a wrong delta."""
    R = row_slots.shape[0]
    xr, sr = x.reshape(R, -1, x.shape[-1]), slots.reshape(R, -1, 1)
    xa = jnp.einsum("rcd,rdk->rck", xr, A[row_slots], preferred_element_type=F32)
    y = jnp.einsum("rck,rko->rco", xa.astype(B.dtype), B[row_slots], preferred_element_type=F32)
    other = jnp.where(sr == 0, jnp.zeros((), F32), jnp.asarray(jnp.nan, F32))
    y = jnp.where(sr == row_slots[:, None, None], y, other)
    return y.reshape(x.shape[0], -1).astype(x.dtype)


def finite_slots(*weights):
    """bool [N]: slot n holds only finite values in every array (leading axis = slot)."""
    ok = None
    for w in weights:
        f = jnp.all(jnp.isfinite(w), axis=tuple(range(1, w.ndim)))
        ok = f if ok is None else ok & f
    return ok


def _zero_bad(w, ok):
    return jnp.where(ok.reshape((-1,) + (1,) * (w.ndim - 1)), w, jnp.zeros((), w.dtype))


def _mark_bad_rows(y, ok, slots_sorted):
    return jnp.where(ok[slots_sorted][:, None], y, jnp.asarray(jnp.nan, y.dtype))


def lora_masked(x, A, B, slots):
    """Small and mid-size banks on chunks: one shrink through every slot's A at once, each row keeps
    only its own slot's r columns (selected with `where`, never multiplied by 0/1), one expand through
    every slot's B. N times the FLOPs of one LoRA, in two plain matmuls (on CPU far cheaper than a
    per-token gather of A and B for chunks). Non-finite slots are zeroed before the products and
    their rows marked NaN afterwards, as in `lora_ragged`."""
    ok = finite_slots(A, B)
    A, B = _zero_bad(A, ok), _zero_bad(B, ok)
    cd = jnp.promote_types(x.dtype, A.dtype)
    xa = jnp.einsum("td,ndr->tnr", x.astype(cd), A.astype(cd), preferred_element_type=F32)
    own = (slots[:, None] == jnp.arange(A.shape[0], dtype=slots.dtype)[None, :])[:, :, None]
    xa = jnp.where(own, xa, jnp.zeros((), F32))
    y = jnp.einsum("tnr,nro->to", xa.astype(B.dtype), B, preferred_element_type=F32)
    return _mark_bad_rows(y, ok, slots).astype(x.dtype)


def lora_ragged(xs, A, B, group_sizes, slots_sorted):
    """Grouped by slot: xs [T, d_in] sorted by slot (stable), group_sizes int32 [N] -> [T, d_out] sorted.

    Shrink and expand are each one `jax.lax.ragged_dot` (grouped matmul; native on TPU)."""
    ok = finite_slots(A, B)
    A, B = _zero_bad(A, ok), _zero_bad(B, ok)
    cd = jnp.promote_types(xs.dtype, A.dtype)
    xa = jax.lax.ragged_dot(xs.astype(cd), A.astype(cd), group_sizes, preferred_element_type=F32)
    y = jax.lax.ragged_dot(xa.astype(B.dtype), B, group_sizes, preferred_element_type=F32)
    return _mark_bad_rows(y, ok, slots_sorted).astype(xs.dtype)


# ---- ReFT ------------------------------------------------------------------------------------
def reft_gather(h, R, W, b, subtract, slots):
    """h + R^T (W h + b - subtract * R h), per-token gathered slot weights."""
    hf = h.astype(F32)
    Rt, Wt = R[slots].astype(F32), W[slots].astype(F32)                       # [T, r, d]
    edit = (jnp.einsum("trd,td->tr", Wt, hf) + b[slots].astype(F32)
            - subtract[slots].astype(F32)[:, None] * jnp.einsum("trd,td->tr", Rt, hf))
    return (hf + jnp.einsum("trd,tr->td", Rt, edit)).astype(h.dtype)


def reft_ragged(hs, R, W, b, subtract, group_sizes, slots_sorted):
    """ReFT on tokens sorted by slot: u = h M^T + b with M = W - subtract * R (float32), out = h + u R."""
    ok = finite_slots(R, W, b) & jnp.isfinite(subtract)
    R, W, b = _zero_bad(R, ok), _zero_bad(W, ok), _zero_bad(b, ok)
    sub = jnp.where(ok, subtract, 0).astype(F32)
    M = W.astype(F32) - sub[:, None, None] * R.astype(F32)                     # [N, r, d]
    u = jax.lax.ragged_dot(hs.astype(F32), jnp.swapaxes(M, 1, 2), group_sizes, preferred_element_type=F32)
    u = u + b.astype(F32)[slots_sorted]
    delta = jax.lax.ragged_dot(u.astype(R.dtype), R, group_sizes, preferred_element_type=F32)
    out = hs.astype(F32) + delta
    return _mark_bad_rows(out, ok, slots_sorted).astype(hs.dtype)
