"""Backend helpers shared by the kernels."""
from __future__ import annotations

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret on CPU (Pallas has no CPU lowering); an explicit bool wins."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def check_lora_shapes(x, A, B, adapter_idx) -> None:
    """Validates x [T, d_in], A [N, d_in, r], B [N, r, d_out], adapter_idx [T] (trace time)."""
    if x.ndim != 2 or A.ndim != 3 or B.ndim != 3:
        raise ValueError(f"expected x [T, d_in], A [N, d_in, r], B [N, r, d_out]; got "
                         f"{x.shape}, {A.shape}, {B.shape}")
    if A.shape[1] != x.shape[1] or B.shape[:2] != (A.shape[0], A.shape[2]):
        raise ValueError(f"shape mismatch: x {x.shape}, A {A.shape}, B {B.shape}")
    if adapter_idx.shape != (x.shape[0],):
        raise ValueError(f"adapter_idx must be [T]={x.shape[0]}, got {adapter_idx.shape}")
