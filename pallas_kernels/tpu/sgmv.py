"""Grouped LoRA on the padded layout (SGMV), Mosaic TPU kernel.

y_pad[p] = (x_pad[p] @ W1[g]) @ W2[g] for every padded row p of a used tile (g its tile's slot);
with transposed=True the weights are given as W1 = B [N, r, K], W2 = A [N, N_out, r] (the dx pass)
and are swapped to [N, K, r] / [N, r, N_out] first.

Grid (tiles, d_out / tn); tile_group and num_used are scalar-prefetched, the W1/W2 index_maps pick
slot tile_group[i]. One step fuses shrink and expand: [tm, K] @ W1[g] -> [tm, r] (f32, rounded to
W2.dtype) @ W2[g][:, j-th tn] -> [tm, tn]; the optional f32 intermediate [P, r] is the shrink.
Tiles past num_used are skipped (their output rows are garbage and never read).

Supports: any K, r, N_out (whole-array block dims); block_tokens a multiple of 8 (32-bit) / 16
(16-bit); block_out None (whole d_out) or a multiple of 128 (d_out padded up to it); VMEM footprint
up to VMEM_BUDGET (see _common.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._tiling import compute_dtype, dot_precision, pad_to, round_up
from ..errors import TilingError
from ..metadata import GroupMetadata
from ._common import check_block_tokens, compiler_params

NAME = "lora_sgmv"


def _kernel(tg_ref, nu_ref, x_ref, w1_ref, w2_ref, *out_refs, cdt):
    y_ref = out_refs[0]

    @pl.when(pl.program_id(0) < nu_ref[0])
    def _tile():
        xa = jnp.dot(x_ref[...].astype(cdt), w1_ref[...].astype(cdt),
                     preferred_element_type=jnp.float32, precision=dot_precision(cdt))
        w = w2_ref[...]
        y = jnp.dot(xa.astype(w.dtype), w, preferred_element_type=jnp.float32,
                    precision=dot_precision(w.dtype))
        y_ref[...] = y.astype(y_ref.dtype)
        if len(out_refs) > 1:
            out_refs[1][...] = xa


def grouped_lora(x_pad, W1, W2, md: GroupMetadata, *, transposed: bool, with_inter: bool,
                 block_out: int | None, interpret: bool):
    """x_pad [P, K] -> y_pad [P, N_out] (x dtype) (+ f32 [P, r] shrink)."""
    if transposed:
        W1, W2 = jnp.swapaxes(W1, 1, 2), jnp.swapaxes(W2, 1, 2)
    num_rows, d_in = x_pad.shape
    r, d_out = W2.shape[1], W2.shape[2]
    tm = md.block_tokens
    check_block_tokens(NAME, tm, (x_pad.dtype,))
    if block_out is None or block_out >= d_out:
        tn = d_out
    elif block_out % 128:
        raise TilingError(NAME, "tpu", f"block_out={block_out} < d_out={d_out}",
                          "a TPU output tile must be a multiple of 128 lanes (or None)")
    else:
        tn = block_out
    d_out_p = round_up(d_out, tn)
    W2 = pad_to(W2, (W2.shape[0], r, d_out_p))
    out_shape = [jax.ShapeDtypeStruct((num_rows, d_out_p), x_pad.dtype)]
    out_specs = [pl.BlockSpec((tm, tn), lambda i, j, tg, nu: (i, j))]
    blocks = [(tm, d_in, x_pad.dtype), (d_in, r, W1.dtype), (r, tn, W2.dtype),
              (tm, tn, x_pad.dtype)]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, r), jnp.float32))
        out_specs.append(pl.BlockSpec((tm, r), lambda i, j, tg, nu: (i, 0)))
        blocks.append((tm, r, jnp.float32))
    params = compiler_params(NAME, ("parallel", "arbitrary"), blocks,
                             f"x tile [{tm}, {d_in}], W1 [{d_in}, {r}], W2 tile [{r}, {tn}]")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(num_rows // tm, d_out_p // tn),
        in_specs=[pl.BlockSpec((tm, d_in), lambda i, j, tg, nu: (i, 0)),
                  pl.BlockSpec((None, d_in, r), lambda i, j, tg, nu: (tg[i], 0, 0)),
                  pl.BlockSpec((None, r, tn), lambda i, j, tg, nu: (tg[i], 0, j))],
        out_specs=out_specs,
    )
    outs = pl.pallas_call(
        functools.partial(_kernel, cdt=compute_dtype(x_pad.dtype, W1.dtype)),
        out_shape=out_shape, grid_spec=grid_spec, compiler_params=params,
        interpret=interpret, name=NAME,
    )(md.tile_group, md.num_used, x_pad, W1, W2)
    y_pad = outs[0][:, :d_out]
    return (y_pad, outs[1]) if with_inter else y_pad
