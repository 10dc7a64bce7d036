"""lora_sgmv: grouped multi-adapter LoRA for prefill / training (SGMV), custom_vjp over the kernels.

lora_sgmv(x, A, B, adapter_idx) -> delta
  x            [T, d_in]       flattened tokens
  A            [N, d_in, r]    shrink weights per slot (slot 0 = base, normally zeros)
  B            [N, r, d_out]   expand weights per slot (LoRA scale already folded in)
  adapter_idx  int [T]         slot of each token in [0, N) (clipped)
  delta        [T, d_out]      delta[t] = (x[t] @ A[g]) @ B[g], g = adapter_idx[t]; x.dtype

Tokens are scattered into the sorted, group-padded layout of `metadata` (metadata.py; built here
when not given), the kernel runs per row tile with the tile's slot weights (tpu/sgmv.py,
gpu/sgmv.py), and rows are gathered back. Backward: dx is the same kernel with the weights read
transposed; dA = sum x^T (dy B^T) and dB = sum (x A)^T dy per slot come from the grouped
outer-product kernel (outer.py) on the padded layout, using the forward's and the dx pass's
f32 [P, r] intermediates. The variant is picked per lowering platform (dispatch.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._checks import check_lora, check_positive
from .dispatch import check_platform, dispatch
from .gpu import sgmv as gpu_sgmv
from .metadata import GroupMetadata, gather_rows, resolve_metadata, scatter_rows
from .outer import grouped_outer
from .tpu import sgmv as tpu_sgmv

class _Config(NamedTuple):
    block_out: int | None
    platform: str | None
    interpret: bool | None


def _grouped_lora(x_pad, W1, W2, md, cfg: _Config, *, transposed: bool, with_inter: bool):
    impls = {v: functools.partial(m.grouped_lora, transposed=transposed, with_inter=with_inter,
                                  block_out=cfg.block_out)
             for v, m in (("tpu", tpu_sgmv), ("gpu", gpu_sgmv))}
    return dispatch(impls, (x_pad, W1, W2, md), platform=cfg.platform, interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sgmv(x, A, B, md, cfg):
    y_pad = _grouped_lora(scatter_rows(x, md), A, B, md, cfg, transposed=False, with_inter=False)
    return gather_rows(y_pad, md)


def _sgmv_fwd(x, A, B, md, cfg):
    y_pad, xa_pad = _grouped_lora(scatter_rows(x, md), A, B, md, cfg, transposed=False,
                                  with_inter=True)
    return gather_rows(y_pad, md), (x, A, B, md, xa_pad)


def _sgmv_bwd(cfg, res, dy):
    x, A, B, md, xa_pad = res
    dy_pad = scatter_rows(dy.astype(x.dtype), md)
    dx_pad, dxa_pad = _grouped_lora(dy_pad, B, A, md, cfg, transposed=True, with_inter=True)
    dA = grouped_outer(scatter_rows(x, md), dxa_pad, md, platform=cfg.platform,
                       interpret=cfg.interpret)
    dB = grouped_outer(xa_pad, dy_pad, md, platform=cfg.platform, interpret=cfg.interpret)
    return gather_rows(dx_pad, md), dA.astype(A.dtype), dB.astype(B.dtype), None


_sgmv.defvjp(_sgmv_fwd, _sgmv_bwd)


@functools.partial(jax.jit, static_argnames=("block_tokens", "block_out", "interpret", "platform"))
def lora_sgmv(x, A, B, adapter_idx, *, block_tokens: int | None = None,
              block_out: int | None = None, interpret: bool | None = None,
              platform: str | None = None, metadata: GroupMetadata | None = None):
    """Grouped LoRA delta [T, d_out] for mixed-adapter token batches (see module docstring).

    block_tokens: rows per tile (default: metadata's, else 16). block_out: output columns per
    program (None = all). platform / interpret: variant selection (dispatch.py). metadata: a
    GroupMetadata from make_group_metadata(adapter_idx, N, block_tokens), shared by all calls of
    a step. Raises TilingError (trace time) for shapes a traced variant cannot tile.
    """
    check_lora("lora_sgmv", x, A, B, adapter_idx)
    check_positive("lora_sgmv", block_tokens=block_tokens, block_out=block_out)
    check_platform(platform)
    md = resolve_metadata("lora_sgmv", adapter_idx, A.shape[0], block_tokens, metadata)
    if x.shape[0] == 0:
        return jnp.zeros((0, B.shape[2]), x.dtype)
    return _sgmv(x, A, B, md, _Config(block_out, platform, interpret))
