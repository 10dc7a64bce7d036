"""Trace-time validation of the public ops' arguments (clear errors naming the problem)."""
from __future__ import annotations

import jax.numpy as jnp


def check_lora(kernel: str, x, A, B, adapter_idx) -> None:
    """x [T, d_in], A [N, d_in, r], B [N, r, d_out], adapter_idx integer [T]."""
    if x.ndim != 2 or A.ndim != 3 or B.ndim != 3:
        raise ValueError(f"{kernel}: expected x [T, d_in], A [N, d_in, r], B [N, r, d_out]; got "
                         f"{x.shape}, {A.shape}, {B.shape}")
    if A.shape[1] != x.shape[1] or B.shape[:2] != (A.shape[0], A.shape[2]):
        raise ValueError(f"{kernel}: shape mismatch: x {x.shape}, A {A.shape}, B {B.shape}")
    if A.shape[0] < 1:
        raise ValueError(f"{kernel}: the adapter bank needs at least one slot, got A {A.shape}")
    _check_idx(kernel, adapter_idx, x.shape[0])


def check_reft(kernel: str, h, R, W, b, subtract, adapter_idx) -> None:
    """h [T, d], R/W [N, r, d], b [N, r], subtract [N], adapter_idx integer [T]."""
    if h.ndim != 2 or R.ndim != 3 or W.shape != R.shape or R.shape[2] != h.shape[1]:
        raise ValueError(f"{kernel}: expected h [T, d], R/W [N, r, d]; got {h.shape}, {R.shape}, "
                         f"{W.shape}")
    n, r, _ = R.shape
    if n < 1:
        raise ValueError(f"{kernel}: the adapter bank needs at least one slot, got R {R.shape}")
    if b.shape != (n, r) or subtract.shape != (n,):
        raise ValueError(f"{kernel}: expected b [N, r]={[n, r]}, subtract [N]={[n]}; got "
                         f"{b.shape}, {subtract.shape}")
    _check_idx(kernel, adapter_idx, h.shape[0])


def _check_idx(kernel: str, adapter_idx, num_tokens: int) -> None:
    if adapter_idx.shape != (num_tokens,) or not jnp.issubdtype(adapter_idx.dtype, jnp.integer):
        raise ValueError(f"{kernel}: adapter_idx must be an integer [T]=[{num_tokens}] array, got "
                         f"{adapter_idx.dtype}{list(adapter_idx.shape)}")


def check_positive(kernel: str, **sizes) -> None:
    for name, value in sizes.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{kernel}: {name} must be a positive int or None, got {value!r}")
