"""Per-token gathered LoRA for decode (BGMV), Pallas Triton kernel.

y[t] = (x[t] @ W1[g]) @ W2[g], g = idx[t]; with transposed=True the weights are W1 = B [N, r, K],
W2 = A [N, N_out, r] (the dx pass), read transposed in the kernel.

Decode rows are single tokens, below Triton's 16-row dot minimum, so each program does
matrix-vector products on the CUDA cores: grid (T, splits); program (t, j) reads g = idx[t] from
an ordinary int32 operand, reduces x[t, chunk] * W1[g][chunk, :] over power-of-two chunks of K
into the f32 shrink [r_p] (rounded to W2.dtype), then writes its N_out / splits output columns
chunk by chunk. The output columns are split across programs until there are >= 128 programs, so
a small decode batch still fills the GPU (each split recomputes the cheap shrink).

Supports: any T, K, N_out (zero-padded to multiples of 16); rank up to 1024 (padded to a power
of two).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._tiling import pad_to
from ._common import chunk, compiler_params, padded_dim, padded_rank

NAME = "lora_bgmv"
_MIN_PROGRAMS = 128


def _kernel(idx_ref, x_ref, w1_ref, w2_ref, *out_refs, transposed, bk, bn):
    t, j = pl.program_id(0), pl.program_id(1)
    (k_p,) = x_ref.shape
    (tn,) = out_refs[0].shape
    g = idx_ref[t]
    r_p = w1_ref.shape[1] if transposed else w1_ref.shape[2]

    def shrink(k, acc):
        cols = pl.ds(pl.multiple_of(k * bk, bk), bk)
        xs = x_ref[cols].astype(jnp.float32)
        if transposed:
            return acc + jnp.sum(w1_ref[g, :, cols].astype(jnp.float32) * xs[None, :], axis=1)
        return acc + jnp.sum(xs[:, None] * w1_ref[g, cols, :].astype(jnp.float32), axis=0)

    xa = lax.fori_loop(0, k_p // bk, shrink, jnp.zeros((r_p,), jnp.float32))
    if len(out_refs) > 1:
        @pl.when(j == 0)
        def _inter():
            out_refs[1][...] = xa

    xr = xa.astype(w2_ref.dtype).astype(jnp.float32)

    def expand(c, carry):
        cols = pl.ds(pl.multiple_of(j * tn + c * bn, bn), bn)
        if transposed:
            y = jnp.sum(w2_ref[g, cols, :].astype(jnp.float32) * xr[None, :], axis=1)
        else:
            y = jnp.sum(xr[:, None] * w2_ref[g, :, cols].astype(jnp.float32), axis=0)
        out_refs[0][pl.ds(pl.multiple_of(c * bn, bn), bn)] = y.astype(out_refs[0].dtype)
        return carry

    lax.fori_loop(0, tn // bn, expand, 0)


def _splits(num_tokens: int, num_chunks: int) -> int:
    """Smallest divisor s of num_chunks with num_tokens * s >= _MIN_PROGRAMS (else num_chunks)."""
    for s in range(1, num_chunks + 1):
        if num_chunks % s == 0 and num_tokens * s >= _MIN_PROGRAMS:
            return s
    return num_chunks


def bgmv(x, W1, W2, idx, *, transposed: bool, with_inter: bool, interpret: bool):
    """x [T, K] -> y [T, N_out] (x dtype) (+ f32 [T, r] shrink); idx int32 [T] in range."""
    num_tokens, k = x.shape
    n, r = W1.shape[0], (W1.shape[1] if transposed else W1.shape[2])
    d_out = W2.shape[1] if transposed else W2.shape[2]
    r_p = padded_rank(NAME, r, 16, min_rank=1)       # [16, r_p] weight chunks
    k_p, d_out_p = padded_dim(k), padded_dim(d_out)
    bk, bn = chunk(k_p, r_p), chunk(d_out_p, r_p)
    tn = d_out_p // _splits(num_tokens, d_out_p // bn)

    x = pad_to(x, (num_tokens, k_p))
    if transposed:
        W1, W2 = pad_to(W1, (n, r_p, k_p)), pad_to(W2, (n, d_out_p, r_p))
    else:
        W1, W2 = pad_to(W1, (n, k_p, r_p)), pad_to(W2, (n, r_p, d_out_p))
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)
    out_shape = [jax.ShapeDtypeStruct((num_tokens, d_out_p), x.dtype)]
    out_specs = [pl.BlockSpec((None, tn), lambda t, j: (t, j))]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_tokens, r_p), jnp.float32))
        out_specs.append(pl.BlockSpec((None, r_p), lambda t, j: (t, 0)))
    outs = pl.pallas_call(
        functools.partial(_kernel, transposed=transposed, bk=bk, bn=bn),
        out_shape=out_shape,
        grid=(num_tokens, d_out_p // tn),
        in_specs=[whole(idx), pl.BlockSpec((None, k_p), lambda t, j: (t, 0)), whole(W1),
                  whole(W2)],
        out_specs=out_specs,
        compiler_params=compiler_params(), interpret=interpret, name=NAME,
    )(idx, x, W1, W2)
    y = outs[0][:, :d_out]
    return (y, outs[1][:, :r]) if with_inter else y

