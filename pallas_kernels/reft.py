"""Batched multi-adapter ReFT intervention on the residual stream, Pallas + custom_vjp.

reft_apply(h, R, W, b, subtract, adapter_idx) -> out
  h            [T, d]       hidden states (flattened tokens)
  R            [N, r, d]    low-rank projection per slot (slot with R == 0 -> identity)
  W            [N, r, d]    learned projection per slot
  b            [N, r]       learned bias per slot
  subtract     float [N]    1.0 = LoReFT, 0.0 = DiReFT
  adapter_idx  int32 [T]    slot per token in [0, N) (clipped)
  out          [T, d]       h[t] + R[g]^T (W[g] h[t] + b[g] - subtract[g] R[g] h[t]); h.dtype

The wrapper folds M = W - subtract * R (float32, [N, r, d]), so the kernel computes
out = h + (h M[g]^T + b[g]) R[g] per sorted tile, using the same sort-and-pad layout and
scalar-prefetched tile slot ids as lora_sgmv (see sgmv.py, _group_layout.py). The edit u = h M^T + b
is kept in f32 and rounded to R.dtype for the up-projection; the residual add is done in f32.

Backward (custom_vjp over h, R, M, b): dh = dy + (dy R^T) M is the same kernel with (R, M, b) ->
(M, R, 0); dR = sum u^T dy and dM = sum v^T h (v = dy R^T) use the per-group outer-product kernel,
db = segment_sum(v). Gradients to W and subtract then flow through the fold by autodiff.

TPU: block_tokens multiple of 8 (f32) / 16 (bf16); d and r are whole-array block dims. GPU: no
scalar-prefetch lowering in Triton/Mosaic-GPU (see sgmv.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._group_layout import gather_rows, group_layout, padded_rows, scatter_rows
from ._platform import resolve_interpret
from .grouped_outer import grouped_outer_sum


def reft_apply_reference(h, R, W, b, subtract, adapter_idx):
    """Plain jnp per-token gather, float32 throughout; returns h.dtype."""
    hf = h.astype(jnp.float32)
    Rt = R.astype(jnp.float32)[adapter_idx]                                   # [T, r, d]
    Wt = W.astype(jnp.float32)[adapter_idx]
    s = subtract.astype(jnp.float32)[adapter_idx][:, None]
    edit = (jnp.einsum("trd,td->tr", Wt, hf) + b.astype(jnp.float32)[adapter_idx]
            - s * jnp.einsum("trd,td->tr", Rt, hf))
    return (hf + jnp.einsum("trd,tr->td", Rt, edit)).astype(h.dtype)


def _reft_kernel(tg_ref, nu_ref, h_ref, r_ref, m_ref, b_ref, *out_refs, compute_dtype):
    @pl.when(pl.program_id(0) < nu_ref[0])
    def _tile():
        h = h_ref[...]
        u = lax.dot_general(h.astype(compute_dtype), m_ref[...].astype(compute_dtype),
                            (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        u = u + b_ref[...].astype(jnp.float32)                                 # [tm, r]
        rr = r_ref[...]
        delta = jnp.dot(u.astype(rr.dtype), rr, preferred_element_type=jnp.float32)
        out_refs[0][...] = (h.astype(jnp.float32) + delta).astype(out_refs[0].dtype)
        if len(out_refs) > 1:
            out_refs[1][...] = u


def _reft_padded(h_pad, R, M, b3, layout, *, block_tokens, interpret, with_inter):
    """h_pad [P, d] -> out_pad [P, d] (+ f32 [P, r] edit u); b3 is [N, 1, r]."""
    num_rows, d = h_pad.shape
    r = R.shape[1]
    tm = block_tokens
    out_shape = [jax.ShapeDtypeStruct((num_rows, d), h_pad.dtype)]
    out_specs = [pl.BlockSpec((tm, d), lambda i, tg, nu: (i, 0))]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, r), jnp.float32))
        out_specs.append(pl.BlockSpec((tm, r), lambda i, tg, nu: (i, 0)))
    slot = lambda i, tg, nu: (tg[i], 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_rows // tm,),
        in_specs=[pl.BlockSpec((tm, d), lambda i, tg, nu: (i, 0)),
                  pl.BlockSpec((None, r, d), slot),
                  pl.BlockSpec((None, r, d), slot),
                  pl.BlockSpec((None, 1, r), slot)],
        out_specs=out_specs,
    )
    outs = pl.pallas_call(
        functools.partial(_reft_kernel, compute_dtype=jnp.promote_types(h_pad.dtype, M.dtype)),
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="reft_apply",
    )(layout.tile_group, layout.num_used, h_pad, R, M, b3)
    return tuple(outs) if with_inter else outs[0]


def _forward(h, R, M, b3, idx, block_tokens, interpret, with_inter):
    layout = group_layout(idx, R.shape[0], block_tokens)
    num_rows = padded_rows(h.shape[0], R.shape[0], block_tokens)
    h_pad = scatter_rows(h, layout.dest, num_rows)
    res = _reft_padded(h_pad, R, M, b3, layout, block_tokens=block_tokens, interpret=interpret,
                       with_inter=with_inter)
    out_pad, u_pad = res if with_inter else (res, None)
    return gather_rows(out_pad, layout.dest), layout, h_pad, u_pad


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _reft(h, R, M, b3, idx, block_tokens, interpret):
    return _forward(h, R, M, b3, idx, block_tokens, interpret, False)[0]


def _reft_fwd(h, R, M, b3, idx, block_tokens, interpret):
    out, layout, h_pad, u_pad = _forward(h, R, M, b3, idx, block_tokens, interpret, True)
    return out, (R, M, b3, idx, layout, h_pad, u_pad)


def _reft_bwd(block_tokens, interpret, res, dy):
    R, M, b3, idx, layout, h_pad, u_pad = res
    num_rows = h_pad.shape[0]
    n = R.shape[0]
    dy_pad = scatter_rows(dy.astype(h_pad.dtype), layout.dest, num_rows)
    dh_pad, v_pad = _reft_padded(dy_pad, M, R, jnp.zeros_like(b3), layout,
                                 block_tokens=block_tokens, interpret=interpret, with_inter=True)
    dh = gather_rows(dh_pad, layout.dest)
    dR = grouped_outer_sum(u_pad, dy_pad, layout, n, block_tokens, interpret)
    dM = grouped_outer_sum(v_pad, h_pad, layout, n, block_tokens, interpret)
    db = jax.ops.segment_sum(gather_rows(v_pad, layout.dest), idx, num_segments=n)
    return dh, dR.astype(R.dtype), dM.astype(M.dtype), db[:, None, :].astype(b3.dtype), None


_reft.defvjp(_reft_fwd, _reft_bwd)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret"))
def reft_apply(h, R, W, b, subtract, adapter_idx, *, block_tokens: int = 16,
               interpret: bool | None = None):
    """Batched ReFT intervention [T, d] (see module docstring)."""
    if h.ndim != 2 or R.ndim != 3 or W.shape != R.shape or R.shape[2] != h.shape[1]:
        raise ValueError(f"expected h [T, d], R/W [N, r, d]; got {h.shape}, {R.shape}, {W.shape}")
    n, r, _ = R.shape
    if b.shape != (n, r) or subtract.shape != (n,):
        raise ValueError(f"expected b [N, r], subtract [N]; got {b.shape}, {subtract.shape}")
    if adapter_idx.shape != (h.shape[0],):
        raise ValueError(f"adapter_idx must be [T]={h.shape[0]}, got {adapter_idx.shape}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    idx = jnp.clip(adapter_idx.astype(jnp.int32), 0, n - 1)
    M = W.astype(jnp.float32) - subtract.astype(jnp.float32)[:, None, None] * R.astype(jnp.float32)
    b3 = b.astype(jnp.float32)[:, None, :]
    return _reft(h, R, M, b3, idx, int(block_tokens), resolve_interpret(interpret))
