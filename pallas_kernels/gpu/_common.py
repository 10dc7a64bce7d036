"""Triton tiling rules shared by the GPU kernels.

Triton loads, stores and dots need power-of-two block sizes, and tl.dot needs >= 16 in M, N and K.
Feature dims are zero-padded to a multiple of 16 and walked in power-of-two chunks inside the
kernel; ranks are zero-padded to a power of two >= 16. The f32 accumulators live in registers, so
block_tokens * padded rank is bounded by MAX_ACC_ELEMS.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from .._tiling import dot_precision, is_pow2, next_pow2, pow2_divisor, round_up
from ..errors import TilingError

MIN_DOT = 16
MAX_BLOCK_TOKENS = 128
MAX_ACC_ELEMS = 16384            # [block_tokens, rank] f32 accumulator (64 KiB of registers)
_MAX_LOAD_ELEMS = 8192
_MAX_CHUNK = 128


def check_block_tokens(kernel: str, block_tokens: int) -> None:
    if not (is_pow2(block_tokens) and MIN_DOT <= block_tokens <= MAX_BLOCK_TOKENS):
        raise TilingError(kernel, "gpu", f"block_tokens={block_tokens}",
                          f"GPU row tiles must be a power of two in [{MIN_DOT}, "
                          f"{MAX_BLOCK_TOKENS}] (Triton dots need >= 16 rows)")


def padded_rank(kernel: str, rank: int, rows: int, min_rank: int = MIN_DOT) -> int:
    """Rank padded to a power of two >= min_rank; rows * padded rank must fit MAX_ACC_ELEMS."""
    r_p = max(min_rank, next_pow2(rank))
    if rows * r_p > MAX_ACC_ELEMS:
        raise TilingError(kernel, "gpu", f"rank {rank} (padded to {r_p}) with {rows}-row tiles",
                          f"the GPU variant keeps a [rows, rank] f32 accumulator in registers and "
                          f"supports rows * padded rank <= {MAX_ACC_ELEMS}")
    return r_p


def padded_dim(d: int) -> int:
    return round_up(d, MIN_DOT)


def chunk(dim_p: int, other: int) -> int:
    """Power-of-two chunk of a padded feature dim for [other, chunk] loads (>= 16, <= 128)."""
    cap = max(MIN_DOT, min(_MAX_CHUNK, _MAX_LOAD_ELEMS // max(other, 1)))
    return pow2_divisor(dim_p, cap)


def mma(a, b, cdt, *, trans_a: bool = False, trans_b: bool = False):
    """f32-accumulated a @ b (operands optionally transposed) under Triton's dot constraints."""
    a, b = a.astype(cdt), b.astype(cdt)
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    assert all(is_pow2(v) and v >= MIN_DOT for v in (m, k, n)), (a.shape, b.shape)
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                           precision=dot_precision(cdt))


def compiler_params():
    return plgpu.CompilerParams(num_warps=4, num_stages=2)
