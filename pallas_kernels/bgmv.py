"""lora_bgmv: per-token gathered multi-adapter LoRA for decode (BGMV), custom_vjp over the kernels.

lora_bgmv(x, A, B, adapter_idx) -> delta
  x            [T, d_in]       one token per sequence (decode step), any T
  A            [N, d_in, r]    shrink weights per slot
  B            [N, r, d_out]   expand weights per slot (scale folded in)
  adapter_idx  int [T]         slot per token in [0, N) (clipped)
  delta        [T, d_out]      (x[t] @ A[g]) @ B[g], g = adapter_idx[t]; x.dtype, f32 accumulate

No sorting: every token gathers its slot's weights (tpu/bgmv.py, gpu/bgmv.py); for multi-token
chunks use lora_sgmv. Backward: dx is the same kernel with the weights read transposed; dA, dB
are per-token outer products summed per slot with jax.ops.segment_sum (decode-sized T).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._checks import check_lora
from .dispatch import check_platform, dispatch
from .gpu import bgmv as gpu_bgmv
from .tpu import bgmv as tpu_bgmv


class _Config(NamedTuple):
    platform: str | None
    interpret: bool | None


def _gathered_lora(x, W1, W2, idx, cfg: _Config, *, transposed: bool, with_inter: bool):
    impls = {v: functools.partial(m.bgmv, transposed=transposed, with_inter=with_inter)
             for v, m in (("tpu", tpu_bgmv), ("gpu", gpu_bgmv))}
    return dispatch(impls, (x, W1, W2, idx), platform=cfg.platform, interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _bgmv(x, A, B, idx, cfg):
    return _gathered_lora(x, A, B, idx, cfg, transposed=False, with_inter=False)


def _bgmv_fwd(x, A, B, idx, cfg):
    y, xa = _gathered_lora(x, A, B, idx, cfg, transposed=False, with_inter=True)
    return y, (x, A, B, idx, xa)


def _bgmv_bwd(cfg, res, dy):
    x, A, B, idx, xa = res
    dx, dxa = _gathered_lora(dy.astype(x.dtype), B, A, idx, cfg, transposed=True, with_inter=True)
    n = A.shape[0]
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
    dA = jax.ops.segment_sum(xf[:, :, None] * dxa[:, None, :], idx, num_segments=n)
    dB = jax.ops.segment_sum(xa[:, :, None] * dyf[:, None, :], idx, num_segments=n)
    return dx, dA.astype(A.dtype), dB.astype(B.dtype), None


_bgmv.defvjp(_bgmv_fwd, _bgmv_bwd)


@functools.partial(jax.jit, static_argnames=("interpret", "platform"))
def lora_bgmv(x, A, B, adapter_idx, *, interpret: bool | None = None,
              platform: str | None = None):
    """Per-token gathered LoRA delta [T, d_out] (see module docstring).

    platform / interpret: variant selection (dispatch.py). Raises TilingError (trace time) for
    shapes a traced variant cannot tile.
    """
    check_lora("lora_bgmv", x, A, B, adapter_idx)
    check_platform(platform)
    if x.shape[0] == 0:
        return jnp.zeros((0, B.shape[2]), x.dtype)
    idx = jnp.clip(adapter_idx.astype(jnp.int32), 0, A.shape[0] - 1)
    return _bgmv(x, A, B, idx, _Config(platform, interpret))
