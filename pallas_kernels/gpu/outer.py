"""Per-slot sum of tile outer products (the weight-gradient kernel), Pallas Triton.

out[g] = sum over padded rows p of slot g's tiles of L[p]^T R[p]   (float32 [N, a, b])

GPU programs run concurrently, so instead of revisiting an output block tile after tile (the TPU
variant) each program owns one output block: grid (N, a / ba, b / bb), program (g, ia, ib) loops
over slot g's tiles [tile_offsets[g], tile_offsets[g + 1]) (a dynamic trip count; zero for an
empty slot, which therefore gets zeros) accumulating [tm, ba]^T @ [tm, bb] in f32.

Supports: block_tokens a power of two in [16, 128]; any a, b (zero-padded to multiples of 16).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._tiling import compute_dtype, pad_to
from ..metadata import GroupMetadata
from ._common import check_block_tokens, chunk, compiler_params, mma, padded_dim

NAME = "grouped_outer"


def _kernel(off_ref, l_ref, r_ref, o_ref, *, tm, cdt):
    g, ia, ib = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ba, bb = o_ref.shape

    def body(t, acc):
        rows = pl.ds(pl.multiple_of(t * tm, tm), tm)
        lhs = l_ref[rows, pl.ds(pl.multiple_of(ia * ba, ba), ba)]
        rhs = r_ref[rows, pl.ds(pl.multiple_of(ib * bb, bb), bb)]
        return acc + mma(lhs, rhs, cdt, trans_a=True)

    o_ref[...] = lax.fori_loop(off_ref[g], off_ref[g + 1], body, jnp.zeros((ba, bb), jnp.float32))


def grouped_outer(L, R, md: GroupMetadata, *, interpret: bool):
    """L [P, a], R [P, b] (padded layout; padding rows zero in one of them) -> f32 [N, a, b]."""
    num_rows, a = L.shape
    b = R.shape[1]
    tm = md.block_tokens
    check_block_tokens(NAME, tm)
    a_p, b_p = padded_dim(a), padded_dim(b)
    L, R = pad_to(L, (num_rows, a_p)), pad_to(R, (num_rows, b_p))
    ba = chunk(a_p, tm)
    bb = chunk(b_p, max(tm, ba))
    whole = lambda x: pl.BlockSpec(x.shape, lambda g, i, j: (0,) * x.ndim)
    out = pl.pallas_call(
        functools.partial(_kernel, tm=tm, cdt=compute_dtype(L.dtype, R.dtype)),
        out_shape=jax.ShapeDtypeStruct((md.num_groups, a_p, b_p), jnp.float32),
        grid=(md.num_groups, a_p // ba, b_p // bb),
        in_specs=[whole(md.tile_offsets), whole(L), whole(R)],
        out_specs=pl.BlockSpec((None, ba, bb), lambda g, i, j: (g, i, j)),
        compiler_params=compiler_params(), interpret=interpret, name=NAME,
    )(md.tile_offsets, L, R)
    return out[:, :a, :b]
