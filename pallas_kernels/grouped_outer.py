"""Per-group sum of tile outer products (the weight-gradient kernel, like megablox `tgmm`).

grouped_outer_sum(L, R, layout, num_groups, block_tokens) -> out [N, a, b] float32 with
  out[g] = sum over padded rows p whose tile belongs to slot g of L[p]^T R[p]
L: [P, a], R: [P, b] in the padded layout of `_group_layout` (group-padding rows of at least one
operand must be zero). Slots with no tokens get zeros.

Grid: one step per row tile; the output block index is tile_group[i], so consecutive tiles of one
slot accumulate into the same resident block (TPU: the grid axis must be "arbitrary").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._group_layout import GroupLayout


def _outer_kernel(tg_ref, nu_ref, l_ref, r_ref, o_ref, *, compute_dtype):
    i = pl.program_id(0)
    first = jnp.logical_or(i == 0, tg_ref[i] != tg_ref[jnp.maximum(i - 1, 0)])

    @pl.when(first)
    def _init():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(i < nu_ref[0])
    def _acc():
        lhs = l_ref[...].astype(compute_dtype)
        rhs = r_ref[...].astype(compute_dtype)
        o_ref[...] += lax.dot_general(lhs, rhs, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)


def grouped_outer_sum(L, R, layout: GroupLayout, num_groups: int, block_tokens: int,
                      interpret: bool) -> jax.Array:
    num_rows, a = L.shape
    b = R.shape[1]
    tm = block_tokens
    compute_dtype = jnp.promote_types(L.dtype, R.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_rows // tm,),
        in_specs=[pl.BlockSpec((tm, a), lambda i, tg, nu: (i, 0)),
                  pl.BlockSpec((tm, b), lambda i, tg, nu: (i, 0))],
        out_specs=pl.BlockSpec((None, a, b), lambda i, tg, nu: (tg[i], 0, 0)),
    )
    out = pl.pallas_call(
        lambda *refs: _outer_kernel(*refs, compute_dtype=compute_dtype),
        out_shape=jax.ShapeDtypeStruct((num_groups, a, b), jnp.float32),
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="grouped_outer_sum",
    )(layout.tile_group, layout.num_used, L, R)
    # unvisited slots hold uninitialised memory
    return jnp.where((layout.counts > 0)[:, None, None], out, 0.0)
