"""Grouped LoRA on the padded layout (SGMV), Pallas Triton kernel.

y_pad[p] = (x_pad[p] @ W1[g]) @ W2[g] for every padded row p of a used tile (g its tile's slot);
with transposed=True the weights are W1 = B [N, r, K] and W2 = A [N, N_out, r] (the dx pass) and
are read transposed in the kernel (no transposed copies).

Grid (tiles, N_out / tn). Program (i, j) reads g = tile_group[i] from an ordinary int32 operand,
skips tiles past num_used, accumulates the shrink [tm, r_p] over power-of-two chunks of K from
W1[g] (unblocked operand, dynamic pl.ds slices), then walks its tn output columns in chunks,
each [tm, r_p] @ W2[g][:, chunk]. The f32 shrink is rounded to W2.dtype before the expand and is
optionally written out (by the j == 0 programs) for the backward pass.

Supports: block_tokens a power of two in [16, 128]; any K, N_out (zero-padded to multiples of 16);
any rank with block_tokens * next_pow2(max(r, 16)) <= 16384 (padded with zeros); block_out None
(whole N_out per program) or a multiple of 16.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._tiling import compute_dtype, pad_to, round_up
from ..errors import TilingError
from ..metadata import GroupMetadata
from ._common import (check_block_tokens, chunk, compiler_params, mma, padded_dim,
                      padded_rank)

NAME = "lora_sgmv"


def _kernel(tg_ref, nu_ref, x_ref, w1_ref, w2_ref, *out_refs, transposed, bk, bn, cdt):
    i, j = pl.program_id(0), pl.program_id(1)
    tm, k_p = x_ref.shape
    tn = out_refs[0].shape[1]
    r_p = w1_ref.shape[1] if transposed else w1_ref.shape[2]

    @pl.when(i < nu_ref[0])
    def _tile():
        g = tg_ref[i]

        def shrink(k, acc):
            cols = pl.ds(pl.multiple_of(k * bk, bk), bk)
            w = w1_ref[g, :, cols] if transposed else w1_ref[g, cols, :]
            return acc + mma(x_ref[:, cols], w, cdt, trans_b=transposed)

        xa = lax.fori_loop(0, k_p // bk, shrink, jnp.zeros((tm, r_p), jnp.float32))
        if len(out_refs) > 1:
            @pl.when(j == 0)
            def _inter():
                out_refs[1][...] = xa

        lhs = xa.astype(w2_ref.dtype)

        def expand(c, carry):
            cols = pl.ds(pl.multiple_of(j * tn + c * bn, bn), bn)
            w = w2_ref[g, cols, :] if transposed else w2_ref[g, :, cols]
            y = mma(lhs, w, w2_ref.dtype, trans_b=transposed)
            out_refs[0][:, pl.ds(pl.multiple_of(c * bn, bn), bn)] = y.astype(out_refs[0].dtype)
            return carry

        lax.fori_loop(0, tn // bn, expand, 0)


def grouped_lora(x_pad, W1, W2, md: GroupMetadata, *, transposed: bool, with_inter: bool,
                 block_out: int | None, interpret: bool):
    """x_pad [P, K] -> y_pad [P, N_out] (x dtype) (+ f32 [P, r] shrink)."""
    num_rows, k = x_pad.shape
    n, r = W1.shape[0], (W1.shape[1] if transposed else W1.shape[2])
    d_out = W2.shape[1] if transposed else W2.shape[2]
    tm = md.block_tokens
    check_block_tokens(NAME, tm)
    r_p, k_p = padded_rank(NAME, r, tm), padded_dim(k)
    tn = padded_dim(d_out)
    if block_out is not None and block_out < tn:
        if block_out % 16:
            raise TilingError(NAME, "gpu", f"block_out={block_out} < d_out={d_out}",
                              "a GPU output tile must be a multiple of 16 (or None)")
        tn = block_out
    d_out_p = round_up(d_out, tn)
    bk, bn = chunk(k_p, max(tm, r_p)), chunk(tn, max(tm, r_p))

    x_pad = pad_to(x_pad, (num_rows, k_p))
    if transposed:
        W1, W2 = pad_to(W1, (n, r_p, k_p)), pad_to(W2, (n, d_out_p, r_p))
    else:
        W1, W2 = pad_to(W1, (n, k_p, r_p)), pad_to(W2, (n, r_p, d_out_p))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    out_shape = [jax.ShapeDtypeStruct((num_rows, d_out_p), x_pad.dtype)]
    out_specs = [pl.BlockSpec((tm, tn), lambda i, j: (i, j))]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, r_p), jnp.float32))
        out_specs.append(pl.BlockSpec((tm, r_p), lambda i, j: (i, 0)))
    outs = pl.pallas_call(
        functools.partial(_kernel, transposed=transposed, bk=bk, bn=bn,
                          cdt=compute_dtype(x_pad.dtype, W1.dtype)),
        out_shape=out_shape,
        grid=(num_rows // tm, d_out_p // tn),
        in_specs=[whole(md.tile_group), whole(md.num_used),
                  pl.BlockSpec((tm, k_p), lambda i, j: (i, 0)), whole(W1), whole(W2)],
        out_specs=out_specs,
        compiler_params=compiler_params(), interpret=interpret, name=NAME,
    )(md.tile_group, md.num_used, x_pad, W1, W2)
    y_pad = outs[0][:, :d_out]
    return (y_pad, outs[1][:, :r]) if with_inter else y_pad
