"""reft_apply: batched multi-adapter ReFT intervention on the residual stream, custom_vjp.

reft_apply(h, R, W, b, subtract, adapter_idx) -> out
  h            [T, d]       hidden states (flattened tokens)
  R            [N, r, d]    low-rank projection per slot (slot with R == 0 -> identity)
  W            [N, r, d]    learned projection per slot
  b            [N, r]       learned bias per slot
  subtract     float [N]    1.0 = LoReFT, 0.0 = DiReFT
  adapter_idx  int [T]      slot per token in [0, N) (clipped)
  out          [T, d]       h[t] + R[g]^T (W[g] h[t] + b[g] - subtract[g] R[g] h[t]); h.dtype

The wrapper folds M = W - subtract * R (float32, [N, r, d]), so the kernels (tpu/reft.py,
gpu/reft.py) compute out = h + (h M[g]^T + b[g]) R[g] per sorted row tile in the layout of
`metadata` (built here when not given). Backward (custom_vjp over h, R, M, b): dh = dy + (dy R^T) M
is the same kernel with (R, M, b) -> (M, R, 0); dR = sum u^T dy and dM = sum v^T h (u the edit,
v = dy R^T) come from the grouped outer-product kernel (outer.py), db = segment_sum(v). Gradients
to W and subtract flow through the fold by autodiff.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ._checks import check_positive, check_reft
from .dispatch import check_platform, dispatch
from .gpu import reft as gpu_reft
from .metadata import GroupMetadata, gather_rows, resolve_metadata, scatter_rows
from .outer import grouped_outer
from .tpu import reft as tpu_reft


class _Config(NamedTuple):
    platform: str | None
    interpret: bool | None


def _reft_padded(h_pad, R, M, b, md, cfg: _Config, *, with_inter: bool):
    impls = {v: functools.partial(m.reft_padded, with_inter=with_inter)
             for v, m in (("tpu", tpu_reft), ("gpu", gpu_reft))}
    return dispatch(impls, (h_pad, R, M, b, md), platform=cfg.platform, interpret=cfg.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _reft(h, R, M, b, idx, md, cfg):
    return gather_rows(_reft_padded(scatter_rows(h, md), R, M, b, md, cfg, with_inter=False), md)


def _reft_fwd(h, R, M, b, idx, md, cfg):
    h_pad = scatter_rows(h, md)
    out_pad, u_pad = _reft_padded(h_pad, R, M, b, md, cfg, with_inter=True)
    return gather_rows(out_pad, md), (h, R, M, b, idx, md, u_pad)


def _reft_bwd(cfg, res, dy):
    h, R, M, b, idx, md, u_pad = res
    dy_pad = scatter_rows(dy.astype(h.dtype), md)
    dh_pad, v_pad = _reft_padded(dy_pad, M, R, jnp.zeros_like(b), md, cfg, with_inter=True)
    outer = functools.partial(grouped_outer, md=md, platform=cfg.platform,
                              interpret=cfg.interpret)
    dR = outer(u_pad, dy_pad)
    dM = outer(v_pad, scatter_rows(h, md))
    db = jax.ops.segment_sum(gather_rows(v_pad, md), idx, num_segments=R.shape[0])
    return (gather_rows(dh_pad, md), dR.astype(R.dtype), dM.astype(M.dtype), db.astype(b.dtype),
            None, None)


_reft.defvjp(_reft_fwd, _reft_bwd)


@functools.partial(jax.jit, static_argnames=("block_tokens", "interpret", "platform"))
def reft_apply(h, R, W, b, subtract, adapter_idx, *, block_tokens: int | None = None,
               interpret: bool | None = None, platform: str | None = None,
               metadata: GroupMetadata | None = None):
    """Batched ReFT intervention [T, d] (see module docstring).

    block_tokens / metadata / platform / interpret: as for lora_sgmv. Raises TilingError (trace
    time) for shapes a traced variant cannot tile.
    """
    check_reft("reft_apply", h, R, W, b, subtract, adapter_idx)
    check_positive("reft_apply", block_tokens=block_tokens)
    check_platform(platform)
    n = R.shape[0]
    md = resolve_metadata("reft_apply", adapter_idx, n, block_tokens, metadata)
    if h.shape[0] == 0:
        return h
    idx = jnp.clip(adapter_idx.astype(jnp.int32), 0, n - 1)
    M = W.astype(jnp.float32) - subtract.astype(jnp.float32)[:, None, None] * R.astype(jnp.float32)
    return _reft(h, R, M, b.astype(jnp.float32), idx, md, _Config(platform, interpret))
