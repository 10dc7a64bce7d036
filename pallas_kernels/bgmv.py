"""Per-token gathered multi-adapter LoRA for decode (BGMV), Pallas + custom_vjp.

lora_bgmv(x, A, B, adapter_idx) -> delta
  x            [T, d_in]       one token per sequence (decode step), any T
  A            [N, d_in, r]    shrink weights per slot
  B            [N, r, d_out]   expand weights per slot (scale folded in)
  adapter_idx  int32 [T]       slot per token in [0, N) (clipped)
  delta        [T, d_out]      (x[t] @ A[g]) @ B[g], g = adapter_idx[t]; x.dtype, f32 accumulate

No sorting: the grid runs over tokens, adapter_idx is scalar-prefetched and the A/B index_maps
gather slot adapter_idx[t] for step t. Tokens are viewed as [T, 1, d] so each block's last two
dims equal the array's (valid TPU block shapes for any T, d, r). Each step is a [1, d_in] matvec,
which is what decode is (weight-bandwidth bound); for multi-token chunks use lora_sgmv.

Backward (custom_vjp): dx reuses the kernel with A' = B^T, B' = A^T; dA, dB are per-token outer
products summed per slot with jax.ops.segment_sum (fine for decode-sized T).

GPU: Triton / Mosaic-GPU lowerings reject scalar prefetch (see sgmv.py); a GPU version would take
adapter_idx as a normal operand and load A[g]/B[g] with in-kernel dynamic slicing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._platform import check_lora_shapes, resolve_interpret
from .sgmv import lora_sgmv_reference  # noqa: F401  (same semantics; re-exported)


def _bgmv_kernel(idx_ref, x_ref, a_ref, b_ref, *out_refs, compute_dtype):
    xa = jnp.dot(x_ref[...].astype(compute_dtype), a_ref[...].astype(compute_dtype),
                 preferred_element_type=jnp.float32)                          # [1, r]
    w = b_ref[...]
    y = jnp.dot(xa.astype(w.dtype), w, preferred_element_type=jnp.float32)    # [1, d_out]
    out_refs[0][...] = y.astype(out_refs[0].dtype)
    if len(out_refs) > 1:
        out_refs[1][...] = xa


def _bgmv_call(x, A, B, idx, interpret, with_inter):
    """x [T, d_in] -> y [T, d_out] (+ f32 [T, r] x@A[g])."""
    num_tokens, d_in = x.shape
    r, d_out = B.shape[1], B.shape[2]
    out_shape = [jax.ShapeDtypeStruct((num_tokens, 1, d_out), x.dtype)]
    out_specs = [pl.BlockSpec((None, 1, d_out), lambda t, ix: (t, 0, 0))]
    if with_inter:
        out_shape.append(jax.ShapeDtypeStruct((num_tokens, 1, r), jnp.float32))
        out_specs.append(pl.BlockSpec((None, 1, r), lambda t, ix: (t, 0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(num_tokens,),
        in_specs=[pl.BlockSpec((None, 1, d_in), lambda t, ix: (t, 0, 0)),
                  pl.BlockSpec((None, d_in, r), lambda t, ix: (ix[t], 0, 0)),
                  pl.BlockSpec((None, r, d_out), lambda t, ix: (ix[t], 0, 0))],
        out_specs=out_specs,
    )
    outs = pl.pallas_call(
        functools.partial(_bgmv_kernel, compute_dtype=jnp.promote_types(x.dtype, A.dtype)),
        out_shape=out_shape,
        grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="lora_bgmv",
    )(idx, x[:, None, :], A, B)
    y = outs[0][:, 0, :]
    return (y, outs[1][:, 0, :]) if with_inter else y


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _bgmv(x, A, B, idx, interpret):
    return _bgmv_call(x, A, B, idx, interpret, False)


def _bgmv_fwd(x, A, B, idx, interpret):
    y, xa = _bgmv_call(x, A, B, idx, interpret, True)
    return y, (x, A, B, idx, xa)


def _bgmv_bwd(interpret, res, dy):
    x, A, B, idx, xa = res
    dx, dxa = _bgmv_call(dy.astype(x.dtype), jnp.swapaxes(B, 1, 2), jnp.swapaxes(A, 1, 2), idx,
                         interpret, True)
    n = A.shape[0]
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
    dA = jax.ops.segment_sum(xf[:, :, None] * dxa[:, None, :], idx, num_segments=n)
    dB = jax.ops.segment_sum(xa[:, :, None] * dyf[:, None, :], idx, num_segments=n)
    return dx, dA.astype(A.dtype), dB.astype(B.dtype), None


_bgmv.defvjp(_bgmv_fwd, _bgmv_bwd)


@functools.partial(jax.jit, static_argnames=("interpret",))
def lora_bgmv(x, A, B, adapter_idx, *, interpret: bool | None = None):
    """Per-token gathered LoRA delta [T, d_out] (see module docstring)."""
    check_lora_shapes(x, A, B, adapter_idx)
    idx = jnp.clip(adapter_idx.astype(jnp.int32), 0, A.shape[0] - 1)
    return _bgmv(x, A, B, idx, resolve_interpret(interpret))
