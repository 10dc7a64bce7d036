"""TPU tiling rules shared by the Mosaic kernels: sublane multiples and a VMEM footprint check.

Mosaic blocks must have their last two dims divisible by (sublane, 128) or equal to the array's.
The kernels keep whole [d, r] weight blocks and [block_tokens, d] activation tiles resident in VMEM
(double-buffered), so the footprint grows with d; shapes above VMEM_BUDGET raise TilingError and
kernels above the smallest default scoped limit ask for a larger vmem_limit_bytes.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from .._tiling import round_up
from ..errors import TilingError

VMEM_BUDGET = 48 << 20          # fits v5e/v6e (128 MiB) and v7x (64 MiB per core) physical VMEM
_DEFAULT_SCOPED = 16 << 20      # smallest default scoped VMEM limit (v4/v5e)


def sublane(dtype) -> int:
    return {4: 8, 2: 16, 1: 32}.get(jnp.dtype(dtype).itemsize, 8)


def check_block_tokens(kernel: str, block_tokens: int, dtypes) -> None:
    need = max(sublane(d) for d in dtypes)
    if block_tokens % need:
        raise TilingError(kernel, "tpu", f"block_tokens={block_tokens} with dtypes "
                          f"{sorted({jnp.dtype(d).name for d in dtypes})}",
                          f"TPU row tiles must be a multiple of {need} (8 for 32-bit, 16 for 16-bit)")


def _tile_bytes(rows: int, cols: int, dtype) -> int:
    return round_up(rows, sublane(dtype)) * round_up(cols, 128) * jnp.dtype(dtype).itemsize


def compiler_params(kernel: str, semantics: tuple[str, ...], blocks, what: str):
    """blocks: (rows, cols, dtype) of every pipelined operand block (each double-buffered)."""
    need = sum(2 * _tile_bytes(r, c, dt) for r, c, dt in blocks)
    if need > VMEM_BUDGET:
        raise TilingError(kernel, "tpu", f"{what} needs ~{need / 2**20:.1f} MiB of VMEM",
                          f"the TPU variant keeps whole weight blocks resident and supports up to "
                          f"{VMEM_BUDGET >> 20} MiB (use a smaller block_tokens / block_out)")
    limit = None
    if need > _DEFAULT_SCOPED * 3 // 4:
        limit = min(round_up(need * 5 // 4 + (4 << 20), 1 << 20), 64 << 20)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=limit)
