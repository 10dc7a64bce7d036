"""JAX persistent compilation cache, configured so that preft_jax's small CPU programs are cached too.

JAX's defaults only persist programs that took >= 1 s to compile; a 135M-parameter model's prefill
and decode loop compile in well under that on a GPU and the many small eager ops never reach it, so
every process start would recompile them. `enable_compilation_cache()` stores every program.

A cache folder that cannot be written never stops a command: an existing read-only one is used for
reading only (JAX's per-program "Error writing persistent compilation cache entry" warnings are
silenced), one that cannot be created leaves the cache off; either way ONE line is logged
(preft_jax.cache.status).
"""
from __future__ import annotations

import os
import pathlib
import warnings

from preft_jax.cache.location import ENV_NO_CACHE, cache_disabled_by_env, compilation_dir, is_folder, writable_reason
from preft_jax.cache.status import record_compilation, report_unwritable

# jax/_src/compiler.py warns this once per program it fails to save
_WRITE_WARNING = r"Error writing persistent compilation cache entry"


def enable_compilation_cache(path: str | os.PathLike | None = None, *, min_compile_time_secs: float = 0.0,
                             force: bool = False) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache; returns its directory (None when left off).

    path: default `<cache root>/jax` (see preft_jax.cache.location). A cache directory the user already
    configured (JAX_COMPILATION_CACHE_DIR / jax.config) is kept unless `path` is given. With
    `PREFT_JAX_NO_CACHE=1` in the environment nothing is changed unless `force=True`.
    Call it before the first compilation (programs compiled earlier are not written).
    A directory that exists but cannot be written is used read-only (returned); one that cannot be
    created leaves the cache off (None). Both log one warning line.
    """
    import jax

    if cache_disabled_by_env() and not force and path is None:
        record_compilation("off", None, f"{ENV_NO_CACHE}=1")
        return None
    current = jax.config.jax_compilation_cache_dir
    if path is None and current:
        target = pathlib.Path(current)
    else:
        target = pathlib.Path(path).expanduser() if path is not None else compilation_dir()
    why = writable_reason(target)
    if why:
        report_unwritable(target, why)
        if not (is_folder(target) and os.access(target, os.R_OK | os.X_OK)):
            record_compilation("unavailable", target, why)
            if current:      # the user's JAX_COMPILATION_CACHE_DIR: jax would warn on every program it reads
                jax.config.update("jax_compilation_cache_dir", None)
            return None
        # Reuse what is there; JAX would warn for every program it cannot save.
        warnings.filterwarnings("ignore", message=_WRITE_WARNING, category=UserWarning)
        record_compilation("read_only", target, why)
    else:
        record_compilation("on", target)
    jax.config.update("jax_compilation_cache_dir", str(target))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    # -1: no size threshold (0 lets JAX pick a filesystem-dependent minimum).
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return target
