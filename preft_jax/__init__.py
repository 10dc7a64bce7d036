"""preft_jax: prefill-only fine-tuning (PreFT) of LLMs in JAX/Flax.

`preft_jax.__version__` is the installed distribution's version (pyproject.toml), so the CLIs and the
server report the same one; it is looked up on first use (importing preft_jax reads no metadata).
"""
from __future__ import annotations


def __getattr__(name: str):
    if name == "__version__":
        from importlib import metadata
        try:
            version = metadata.version("preft-jax")
        except metadata.PackageNotFoundError:          # a source tree that is not installed
            version = "0.0.0+unknown"
        globals()["__version__"] = version
        return version
    raise AttributeError(f"module 'preft_jax' has no attribute {name!r}")
