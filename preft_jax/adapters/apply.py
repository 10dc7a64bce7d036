"""Multi-adapter LoRA and ReFT math on flattened tokens, one function per layout (no dispatch here).

`preft_jax.adapters.context.AdapterContext` picks one of these per step; layers never call them
directly. Shapes: x, h [T, d]; A [N, d_in, r]; B [N, r, d_out] (LoRA scale folded in);
R, W [N, r, d]; b [N, r]; subtract [N] (1.0 LoReFT, 0.0 DiReFT); slots int32 [T] in [0, N).

Numerics (all layouts): the LoRA shrink x @ A accumulates in float32 and is rounded to B.dtype for
the expand, which accumulates in float32; the result is x.dtype. ReFT edits are computed in float32
and the residual add is float32, rounded to h.dtype.

Isolation: no slot's weights can reach a row that does not use that slot. Gathers read only the
row's own slot; the small-bank path *selects* per slot (never multiplies by a 0/1 weight, since
NaN * 0 = NaN); the ragged-dot path zeroes non-finite slots before the grouped product (XLA's
ragged_dot expands to a dense group-masked dot on CPU and on NVIDIA GPUs, where a NaN in any slot
would otherwise reach every row) and marks the rows of such a slot NaN afterwards.
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


def lora_select(x, A, B, slots):
    """Small banks: every slot's dense product on all rows, each row *selecting* its slot's result.

    N times the FLOPs of one LoRA, but plain matmuls (fast on CPU for N <= 4)."""
    out = jnp.zeros(x.shape[:1] + B.shape[2:], F32)
    for n in range(A.shape[0]):
        xa = jnp.einsum("td,dr->tr", x, A[n], preferred_element_type=F32)
        y = jnp.einsum("tr,ro->to", xa.astype(B.dtype), B[n], preferred_element_type=F32)
        out = jnp.where((slots == n)[:, None], y, out)
    return out.astype(x.dtype)


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
