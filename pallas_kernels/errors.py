"""The exception a kernel raises (at trace time) for a shape or block size it cannot tile."""
from __future__ import annotations


class TilingError(ValueError):
    """A kernel variant cannot tile these shapes / block sizes.

    Raised while tracing, before anything runs, so callers can catch it and fall back to an XLA
    path. The message names the kernel, the variant, the offending shape and the constraint.
    """

    def __init__(self, kernel: str, variant: str, problem: str, constraint: str):
        self.kernel, self.variant = kernel, variant
        super().__init__(f"{kernel} [{variant}]: {problem}; {constraint}")
