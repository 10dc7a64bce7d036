"""JAX persistent compilation cache, configured so that preft_jax's small CPU programs are cached too.

JAX's defaults only persist programs that took >= 1 s to compile; a 135M-parameter model's prefill
and decode loop compile in well under that on a GPU and the many small eager ops never reach it, so
every process start would recompile them. `enable_compilation_cache()` stores every program.
"""
from __future__ import annotations

import os
import pathlib

from preft_jax.cache.location import cache_disabled_by_env, compilation_dir


def enable_compilation_cache(path: str | os.PathLike | None = None, *, min_compile_time_secs: float = 0.0,
                             force: bool = False) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache; returns its directory (None when left off).

    path: default `<cache root>/jax` (see preft_jax.cache.location). A cache directory the user already
    configured (JAX_COMPILATION_CACHE_DIR / jax.config) is kept unless `path` is given. With
    `PREFT_JAX_NO_CACHE=1` in the environment nothing is changed unless `force=True`.
    Call it before the first compilation (programs compiled earlier are not written).
    """
    import jax

    if cache_disabled_by_env() and not force and path is None:
        return None
    current = jax.config.jax_compilation_cache_dir
    if path is None and current:
        target = pathlib.Path(current)
    else:
        target = pathlib.Path(path).expanduser() if path is not None else compilation_dir()
    target.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(target))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    # -1: no size threshold (0 lets JAX pick a filesystem-dependent minimum).
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return target
