"""Batched ReFT intervention on the padded layout, Mosaic TPU kernel.

out_pad[p] = h_pad[p] + (h_pad[p] M[g]^T + b[g]) R[g]     (g the slot of p's tile)

with R, M [N, r, d], b [N, r] (the caller folds M = W - subtract * R). The edit u = h M^T + b is
kept in f32 (optional [P, r] output) and rounded to R.dtype for the up-projection; the residual add
is done in f32. Grid: one step per row tile, slot blocks picked by the scalar-prefetched
tile_group; tiles past num_used are skipped.

Supports: any d, r (whole-array block dims); block_tokens a multiple of 8 (32-bit) / 16 (16-bit);
VMEM footprint up to VMEM_BUDGET.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._tiling import compute_dtype, dot_precision
from ..metadata import GroupMetadata
from ._common import check_block_tokens, compiler_params

NAME = "reft_apply"


def _kernel(tg_ref, nu_ref, h_ref, r_ref, m_ref, b_ref, *out_refs, cdt):
    @pl.when(pl.program_id(0) < nu_ref[0])
    def _tile():
        h = h_ref[...]
        u = lax.dot_general(h.astype(cdt), m_ref[...].astype(cdt), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=dot_precision(cdt))
        u = u + b_ref[...].astype(jnp.float32)                                 # [tm, r]
        rr = r_ref[...]
        delta = jnp.dot(u.astype(rr.dtype), rr, preferred_element_type=jnp.float32,
                        precision=dot_precision(rr.dtype))
        out_refs[0][...] = (h.astype(jnp.float32) + delta).astype(out_refs[0].dtype)
        if len(out_refs) > 1:
            out_refs[1][...] = u


def reft_padded(h_pad, R, M, b, md: GroupMetadata, *, with_inter: bool, interpret: bool):
    """h_pad [P, d] -> out_pad [P, d] (h dtype) (+ f32 [P, r] edit u); b is [N, r]."""
    num_rows, d = h_pad.shape
    r = R.shape[1]
    tm = md.block_tokens
    check_block_tokens(NAME, tm, (h_pad.dtype,))
    out_shape = [jax.ShapeDtypeStruct((num_rows, d), h_pad.dtype)]
    out_specs = [pl.BlockSpec((tm, d), lambda i, tg, nu: (i, 0))]
    blocks = [(tm, d, h_pad.dtype), (r, d, R.dtype), (r, d, M.dtype), (1, r, b.dtype),
              (tm, d, h_pad.dtype)]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, r), jnp.float32))
        out_specs.append(pl.BlockSpec((tm, r), lambda i, tg, nu: (i, 0)))
        blocks.append((tm, r, jnp.float32))
    params = compiler_params(NAME, ("parallel",), blocks,
                             f"h tile [{tm}, {d}], R/M [{r}, {d}]")
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
        functools.partial(_kernel, cdt=compute_dtype(h_pad.dtype, M.dtype)),
        out_shape=out_shape, grid_spec=grid_spec, compiler_params=params,
        interpret=interpret, name=NAME,
    )(md.tile_group, md.num_used, h_pad, R, M, b[:, None, :])
    return tuple(outs) if with_inter else outs[0]
