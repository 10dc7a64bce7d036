"""Backend helpers shared by the kernels."""
from __future__ import annotations

import jax


def resolve_interpret(interpret: bool | None) -> bool:
    """None -> interpret on CPU (Pallas has no CPU lowering); an explicit bool wins."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)
