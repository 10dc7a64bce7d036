"""Per-token gathered LoRA for decode (BGMV), Mosaic TPU kernel.

y[t] = (x[t] @ W1[g]) @ W2[g], g = idx[t]; with transposed=True the weights are W1 = B [N, r, K],
W2 = A [N, N_out, r] (the dx pass) and are swapped first.

No sorting: the grid runs over tokens, idx is scalar-prefetched and the W1/W2 index_maps gather
slot idx[t] for step t. Tokens are viewed as [T, 1, d] so each block's last two dims equal the
array's. Each step is a [1, K] matvec (weight-bandwidth bound, which decode is).

Supports: any T, K, r, N_out; VMEM footprint (whole [K, r] and [r, N_out] blocks) up to VMEM_BUDGET.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._tiling import compute_dtype, dot_precision
from ._common import compiler_params

NAME = "lora_bgmv"


def _kernel(idx_ref, x_ref, w1_ref, w2_ref, *out_refs, cdt):
    xa = jnp.dot(x_ref[...].astype(cdt), w1_ref[...].astype(cdt),
                 preferred_element_type=jnp.float32, precision=dot_precision(cdt))   # [1, r]
    w = w2_ref[...]
    y = jnp.dot(xa.astype(w.dtype), w, preferred_element_type=jnp.float32,
                precision=dot_precision(w.dtype))                                   # [1, N_out]
    out_refs[0][...] = y.astype(out_refs[0].dtype)
    if len(out_refs) > 1:
        out_refs[1][...] = xa


def bgmv(x, W1, W2, idx, *, transposed: bool, with_inter: bool, interpret: bool):
    """x [T, K] -> y [T, N_out] (x dtype) (+ f32 [T, r] shrink); idx int32 [T] in range."""
    if transposed:
        W1, W2 = jnp.swapaxes(W1, 1, 2), jnp.swapaxes(W2, 1, 2)
    num_tokens, d_in = x.shape
    r, d_out = W2.shape[1], W2.shape[2]
    out_shape = [jax.ShapeDtypeStruct((num_tokens, 1, d_out), x.dtype)]
    out_specs = [pl.BlockSpec((None, 1, d_out), lambda t, ix: (t, 0, 0))]
    blocks = [(1, d_in, x.dtype), (d_in, r, W1.dtype), (r, d_out, W2.dtype), (1, d_out, x.dtype)]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_tokens, 1, r), jnp.float32))
        out_specs.append(pl.BlockSpec((None, 1, r), lambda t, ix: (t, 0, 0)))
        blocks.append((1, r, jnp.float32))
    params = compiler_params(NAME, ("parallel",), blocks,
                             f"W1 [{d_in}, {r}], W2 [{r}, {d_out}]")
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_tokens,),
        in_specs=[pl.BlockSpec((None, 1, d_in), lambda t, ix: (t, 0, 0)),
                  pl.BlockSpec((None, d_in, r), lambda t, ix: (ix[t], 0, 0)),
                  pl.BlockSpec((None, r, d_out), lambda t, ix: (ix[t], 0, 0))],
        out_specs=out_specs,
    )
    outs = pl.pallas_call(
        functools.partial(_kernel, cdt=compute_dtype(x.dtype, W1.dtype)),
        out_shape=out_shape, grid_spec=grid_spec, compiler_params=params,
        interpret=interpret, name=NAME,
    )(idx, x[:, None, :], W1, W2)
    y = outs[0][:, 0, :]
    return (y, outs[1][:, 0, :]) if with_inter else y
