"""Batched ReFT intervention on the padded layout, Pallas Triton kernel.

out_pad[p] = h_pad[p] + (h_pad[p] M[g]^T + b[g]) R[g]     (g the slot of p's tile)

Grid: one program per row tile; g = tile_group[i] from an ordinary int32 operand, tiles past
num_used skipped. The edit u [tm, r_p] accumulates h[:, chunk] @ M[g][:, chunk]^T over
power-of-two chunks of d (f32, optional [P, r] output), then each output chunk is
h[:, chunk] + (u rounded to R.dtype) @ R[g][:, chunk], added in f32.

Supports: block_tokens a power of two in [16, 128]; any d (zero-padded to a multiple of 16); any
rank with block_tokens * next_pow2(max(r, 16)) <= 16384 (padded with zeros).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._tiling import compute_dtype, pad_to
from ..metadata import GroupMetadata
from ._common import check_block_tokens, chunk, compiler_params, mma, padded_dim, padded_rank

NAME = "reft_apply"


def _kernel(tg_ref, nu_ref, h_ref, r_ref, m_ref, b_ref, *out_refs, bk, cdt):
    i = pl.program_id(0)
    tm, d_p = h_ref.shape
    r_p = r_ref.shape[1]

    @pl.when(i < nu_ref[0])
    def _tile():
        g = tg_ref[i]

        def down(k, acc):
            cols = pl.ds(pl.multiple_of(k * bk, bk), bk)
            return acc + mma(h_ref[:, cols], m_ref[g, :, cols], cdt, trans_b=True)

        u = lax.fori_loop(0, d_p // bk, down, jnp.zeros((tm, r_p), jnp.float32))
        u = u + b_ref[pl.ds(g, 1), :].astype(jnp.float32)
        if len(out_refs) > 1:
            out_refs[1][...] = u
        lhs = u.astype(r_ref.dtype)

        def up(c, carry):
            cols = pl.ds(pl.multiple_of(c * bk, bk), bk)
            delta = mma(lhs, r_ref[g, :, cols], r_ref.dtype)
            out = h_ref[:, cols].astype(jnp.float32) + delta
            out_refs[0][:, cols] = out.astype(out_refs[0].dtype)
            return carry

        lax.fori_loop(0, d_p // bk, up, 0)


def reft_padded(h_pad, R, M, b, md: GroupMetadata, *, with_inter: bool, interpret: bool):
    """h_pad [P, d] -> out_pad [P, d] (h dtype) (+ f32 [P, r] edit u); b is [N, r]."""
    num_rows, d = h_pad.shape
    n, r = R.shape[:2]
    tm = md.block_tokens
    check_block_tokens(NAME, tm)
    r_p, d_p = padded_rank(NAME, r, tm), padded_dim(d)
    bk = chunk(d_p, max(tm, r_p))
    h_pad = pad_to(h_pad, (num_rows, d_p))
    R, M, b = pad_to(R, (n, r_p, d_p)), pad_to(M, (n, r_p, d_p)), pad_to(b, (n, r_p))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)
    out_shape = [jax.ShapeDtypeStruct((num_rows, d_p), h_pad.dtype)]
    out_specs = [pl.BlockSpec((tm, d_p), lambda i: (i, 0))]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, r_p), jnp.float32))
        out_specs.append(pl.BlockSpec((tm, r_p), lambda i: (i, 0)))
    outs = pl.pallas_call(
        functools.partial(_kernel, bk=bk, cdt=compute_dtype(h_pad.dtype, M.dtype)),
        out_shape=out_shape,
        grid=(num_rows // tm,),
        in_specs=[whole(md.tile_group), whole(md.num_used),
                  pl.BlockSpec((tm, d_p), lambda i: (i, 0)), whole(R), whole(M), whole(b)],
        out_specs=out_specs,
        compiler_params=compiler_params(), interpret=interpret, name=NAME,
    )(md.tile_group, md.num_used, h_pad, R, M, b)
    out = outs[0][:, :d]
    return (out, outs[1][:, :r]) if with_inter else out
