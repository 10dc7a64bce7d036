"""Grouped multi-adapter LoRA for prefill / training (SGMV, gmm-like), Pallas + custom_vjp.

lora_sgmv(x, A, B, adapter_idx) -> delta
  x            [T, d_in]       flattened tokens
  A            [N, d_in, r]    shrink weights per slot (slot 0 = base, normally zeros)
  B            [N, r, d_out]   expand weights per slot (LoRA scale already folded in)
  adapter_idx  int32 [T]       slot of each token in [0, N) (clipped)
  delta        [T, d_out]      delta[t] = (x[t] @ A[g]) @ B[g], g = adapter_idx[t]; x.dtype

The wrapper stably sorts tokens by slot and pads every group to a multiple of `block_tokens`
(static padded length round_up(T + min(N, T) * (block_tokens - 1), block_tokens)), so each
[block_tokens, d_in] tile uses one slot. The per-tile slot ids and the used-tile count are
scalar-prefetched; the A/B BlockSpec index_maps pick slot tile_group[i]. One grid step fuses
shrink and expand: [tm, d_in] @ A[g] -> [tm, r] (f32, rounded to B.dtype) @ B[g] -> [tm, tn].
The optional second grid axis tiles d_out by `block_out` (the small shrink is recomputed per
output tile). Padding tiles are skipped and discarded; the result is un-permuted by a gather.

Backward (custom_vjp): dx runs the same kernel with A' = B^T, B' = A^T; dA and dB come from the
per-group outer-product kernel (grouped_outer.py) on the padded layout, using the forward's and the
dx kernel's [P, r] intermediates.

TPU notes: block_tokens must be a multiple of 8 (f32) / 16 (bf16); block_out (if given) a multiple
of 128; d_in and r are whole-array block dims, so any rank works. Grid axis 0 may be "parallel",
the d_out axis is "arbitrary" (the intermediate output block is revisited).

GPU notes: the Triton and Mosaic-GPU lowerings in jax 0.10 reject scalar prefetch
("scalar prefetch not implemented in the Triton backend"), so with interpret=False this only
lowers on TPU. A GPU version would pass tile_group as an ordinary int32 operand (whole-array
block), give A/B `memory_space=ANY`-style unblocked specs and load A[g], B[g] inside the kernel with
dynamic `pl.ds` slicing (or use a Mosaic-GPU pipeline with manual copies). On GPU use the jnp
backend (preft_jax.adapters.apply) or interpret=True (correct but slow).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._group_layout import gather_rows, group_layout, padded_rows, scatter_rows
from ._platform import check_lora_shapes, resolve_interpret
from .grouped_outer import grouped_outer_sum


def lora_sgmv_reference(x, A, B, adapter_idx):
    """Plain jnp per-token gather, float32 throughout; returns x.dtype."""
    xf = x.astype(jnp.float32)
    Ag = A.astype(jnp.float32)[adapter_idx]                                    # [T, d_in, r]
    Bg = B.astype(jnp.float32)[adapter_idx]                                    # [T, r, d_out]
    xa = jnp.einsum("td,tdr->tr", xf, Ag)
    return jnp.einsum("tr,tro->to", xa, Bg).astype(x.dtype)


def _sgmv_kernel(tg_ref, nu_ref, x_ref, a_ref, b_ref, *out_refs, compute_dtype):
    y_ref = out_refs[0]

    @pl.when(pl.program_id(0) < nu_ref[0])
    def _tile():
        xa = jnp.dot(x_ref[...].astype(compute_dtype), a_ref[...].astype(compute_dtype),
                     preferred_element_type=jnp.float32)                      # [tm, r]
        w = b_ref[...]
        y = jnp.dot(xa.astype(w.dtype), w, preferred_element_type=jnp.float32)  # [tm, tn]
        y_ref[...] = y.astype(y_ref.dtype)
        if len(out_refs) > 1:
            out_refs[1][...] = xa


def grouped_lora_padded(x_pad, A, B, layout, *, block_tokens, block_out, interpret, with_inter):
    """Kernel on the padded layout: x_pad [P, d_in] -> y_pad [P, d_out] (+ f32 [P, r] x@A)."""
    num_rows, d_in = x_pad.shape
    r, d_out = B.shape[1], B.shape[2]
    tm = block_tokens
    tn = d_out if block_out is None or block_out >= d_out else block_out
    d_out_p = -(-d_out // tn) * tn
    if d_out_p != d_out:
        B = jnp.pad(B, ((0, 0), (0, 0), (0, d_out_p - d_out)))
    grid = (num_rows // tm, d_out_p // tn)
    out_shape = [jax.ShapeDtypeStruct((num_rows, d_out_p), x_pad.dtype)]
    out_specs = [pl.BlockSpec((tm, tn), lambda i, j, tg, nu: (i, j))]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, r), jnp.float32))
        out_specs.append(pl.BlockSpec((tm, r), lambda i, j, tg, nu: (i, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=grid,
        in_specs=[pl.BlockSpec((tm, d_in), lambda i, j, tg, nu: (i, 0)),
                  pl.BlockSpec((None, d_in, r), lambda i, j, tg, nu: (tg[i], 0, 0)),
                  pl.BlockSpec((None, r, tn), lambda i, j, tg, nu: (tg[i], 0, j))],
        out_specs=out_specs,
    )
    compute_dtype = jnp.promote_types(x_pad.dtype, A.dtype)
    outs = pl.pallas_call(
        functools.partial(_sgmv_kernel, compute_dtype=compute_dtype),
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="lora_sgmv",
    )(layout.tile_group, layout.num_used, x_pad, A, B)
    y_pad = outs[0][:, :d_out]
    return (y_pad, outs[1]) if with_inter else y_pad


def _forward(x, A, B, idx, block_tokens, block_out, interpret, with_inter):
    layout = group_layout(idx, A.shape[0], block_tokens)
    num_rows = padded_rows(x.shape[0], A.shape[0], block_tokens)
    x_pad = scatter_rows(x, layout.dest, num_rows)
    res = grouped_lora_padded(x_pad, A, B, layout, block_tokens=block_tokens,
                              block_out=block_out, interpret=interpret, with_inter=with_inter)
    y_pad, inter = res if with_inter else (res, None)
    return gather_rows(y_pad, layout.dest), layout, inter


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _sgmv(x, A, B, idx, block_tokens, block_out, interpret):
    return _forward(x, A, B, idx, block_tokens, block_out, interpret, False)[0]


def _sgmv_fwd(x, A, B, idx, block_tokens, block_out, interpret):
    y, layout, xa_pad = _forward(x, A, B, idx, block_tokens, block_out, interpret, True)
    return y, (x, A, B, layout, xa_pad)


def _sgmv_bwd(block_tokens, block_out, interpret, res, dy):
    x, A, B, layout, xa_pad = res
    num_rows = xa_pad.shape[0]
    dy_pad = scatter_rows(dy.astype(x.dtype), layout.dest, num_rows)
    dx_pad, dxa_pad = grouped_lora_padded(
        dy_pad, jnp.swapaxes(B, 1, 2), jnp.swapaxes(A, 1, 2), layout,
        block_tokens=block_tokens, block_out=block_out, interpret=interpret, with_inter=True)
    dx = gather_rows(dx_pad, layout.dest)
    x_pad = scatter_rows(x, layout.dest, num_rows)
    n = A.shape[0]
    dA = grouped_outer_sum(x_pad, dxa_pad, layout, n, block_tokens, interpret)
    dB = grouped_outer_sum(xa_pad, dy_pad, layout, n, block_tokens, interpret)
    return dx, dA.astype(A.dtype), dB.astype(B.dtype), None


_sgmv.defvjp(_sgmv_fwd, _sgmv_bwd)


@functools.partial(jax.jit, static_argnames=("block_tokens", "block_out", "interpret"))
def lora_sgmv(x, A, B, adapter_idx, *, block_tokens: int = 16, block_out: int | None = None,
              interpret: bool | None = None):
    """Grouped LoRA delta [T, d_out] for mixed-adapter token batches (see module docstring)."""
    check_lora_shapes(x, A, B, adapter_idx)
    if block_tokens < 1 or (block_out is not None and block_out < 1):
        raise ValueError(f"block sizes must be positive, got {block_tokens}, {block_out}")
    return _sgmv(x, A, B, adapter_idx.astype(jnp.int32), int(block_tokens), block_out,
                 resolve_interpret(interpret))
