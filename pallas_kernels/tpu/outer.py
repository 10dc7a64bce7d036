"""Per-slot sum of tile outer products (the weight-gradient kernel, like megablox `tgmm`), Mosaic TPU.

out[g] = sum over padded rows p of slot g's tiles of L[p]^T R[p]   (float32 [N, a, b])

Grid: one step per row tile; the output block index is tile_group[i], so consecutive tiles of one
slot accumulate into the same resident block (the grid axis is "arbitrary"). Slots with no tokens
are zeroed after the call (their blocks are never visited).

Supports: any a, b (whole-array block dims); block_tokens a multiple of 8 (32-bit) / 16 (16-bit);
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

NAME = "grouped_outer"


def _kernel(tg_ref, nu_ref, l_ref, r_ref, o_ref, *, cdt):
    i = pl.program_id(0)
    first = jnp.logical_or(i == 0, tg_ref[i] != tg_ref[jnp.maximum(i - 1, 0)])

    @pl.when(first)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(i < nu_ref[0])
    def _acc():
        o_ref[...] += lax.dot_general(l_ref[...].astype(cdt), r_ref[...].astype(cdt),
                                      (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32,
                                      precision=dot_precision(cdt))


def grouped_outer(L, R, md: GroupMetadata, *, interpret: bool):
    """L [P, a], R [P, b] (padded layout; padding rows zero in one of them) -> f32 [N, a, b]."""
    num_rows, a = L.shape
    b = R.shape[1]
    tm = md.block_tokens
    check_block_tokens(NAME, tm, (L.dtype, R.dtype))
    params = compiler_params(NAME, ("arbitrary",),
                             [(tm, a, L.dtype), (tm, b, R.dtype), (a, b, jnp.float32)],
                             f"L tile [{tm}, {a}], R tile [{tm}, {b}], out [{a}, {b}]")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_rows // tm,),
        in_specs=[pl.BlockSpec((tm, a), lambda i, tg, nu: (i, 0)),
                  pl.BlockSpec((tm, b), lambda i, tg, nu: (i, 0))],
        out_specs=pl.BlockSpec((None, a, b), lambda i, tg, nu: (tg[i], 0, 0)),
    )
    out = pl.pallas_call(
        functools.partial(_kernel, cdt=compute_dtype(L.dtype, R.dtype)),
        out_shape=jax.ShapeDtypeStruct((md.num_groups, a, b), jnp.float32),
        grid_spec=grid_spec, compiler_params=params, interpret=interpret, name=NAME,
    )(md.tile_group, md.num_used, L, R)
    return jnp.where((md.counts > 0)[:, None, None], out, 0.0)
