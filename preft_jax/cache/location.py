"""Where preft_jax keeps its caches.

Root: `$PREFT_JAX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/preft_jax`, else `~/.cache/preft_jax`.
Layout under the root:

    weights/v1/<sha256 of the model file>-<dtype>/   dequantized weights (see preft_jax.cache.weights)
    hashes/<sha256 of the absolute path>.json        (path, size, mtime, inode) -> content sha256 memo
    jax/                                             JAX persistent compilation cache

`PREFT_JAX_NO_CACHE=1` turns the weight cache and the compilation cache off by default.
"""
from __future__ import annotations

import os
import pathlib

ENV_CACHE_DIR = "PREFT_JAX_CACHE_DIR"
ENV_NO_CACHE = "PREFT_JAX_NO_CACHE"
_FALSY = ("", "0", "false", "no", "off")


def cache_root() -> pathlib.Path:
    """The cache root directory (not created here)."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return base / "preft_jax"


def cache_disabled_by_env() -> bool:
    """True when `PREFT_JAX_NO_CACHE` is set to a true value (1, true, yes, on)."""
    return os.environ.get(ENV_NO_CACHE, "").strip().lower() not in _FALSY


def weights_dir() -> pathlib.Path:
    return cache_root() / "weights"


def hashes_dir() -> pathlib.Path:
    return cache_root() / "hashes"


def compilation_dir() -> pathlib.Path:
    return cache_root() / "jax"
