"""Small static helpers for choosing block sizes and padding (shared by the kernel variants)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n (n >= 1)."""
    return min(n & -n, cap if is_pow2(cap) else next_pow2(cap) // 2)


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Zero-pads x at the end of each axis up to `shape` (no copy when already that shape)."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


def compute_dtype(*dtypes) -> jnp.dtype:
    return jnp.dtype(jnp.result_type(*dtypes))


def dot_precision(dtype):
    """Full f32 precision for f32 operands (no TF32 / bf16 passes); default for 16-bit inputs."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
