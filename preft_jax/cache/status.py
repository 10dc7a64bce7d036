"""What the caches (and the compiled native CPU library) are doing in this process, and the one log
line each degraded mode gets.

    from preft_jax.cache import status
    status()   # {"cache_root", "compilation_cache", "weight_cache", "native_library", "degraded"}

Degraded modes never stop a command: a cache root that cannot be created or written (a missing or
read-only home, a read-only mount) turns the caches it holds into read-only ones (entries already
there are reused, nothing new is saved), reported ONCE per process and root by
`report_unwritable`; the native CPU library reports its own state (pallas_kernels.cpu.library_status).
`status()` only reads what was recorded: it writes nothing, so `/health` may call it freely.
"""
from __future__ import annotations

import logging
import os
import pathlib
import threading

from preft_jax.cache.location import cache_disabled_by_env, cache_root, ENV_CACHE_DIR, ENV_NO_CACHE, is_folder

log = logging.getLogger("preft_jax.cache")
_lock = threading.Lock()
_unwritable: dict[str, str] = {}          # directory (a cache root, or a cache outside it) -> reason
_compilation: dict = {"state": "off", "path": None, "reason": "not enabled in this process"}

HINT = f"set {ENV_CACHE_DIR} to a writable folder, or {ENV_NO_CACHE}=1 to turn the caches off"


def _root_of(path: pathlib.Path) -> pathlib.Path:
    """The cache root when `path` lies under it (one report covers every cache there), else `path`."""
    root = cache_root()
    try:
        path.resolve(strict=False).relative_to(root.resolve(strict=False))
        return root
    except ValueError:
        return path


def report_unwritable(path: str | os.PathLike, reason: str) -> bool:
    """Record that nothing can be saved under `path` and log it, once per cache root per process.
    Returns True when this call logged the line (False: already reported)."""
    where = _root_of(pathlib.Path(path))
    key = str(where)
    with _lock:
        if key in _unwritable:
            return False
        _unwritable[key] = reason
    if is_folder(where):
        log.warning("preft_jax cache: %s is read-only (%s): entries already there are reused, new ones are not "
                    "saved (%s)", where, reason, HINT)
    else:
        log.warning("preft_jax cache: cannot create %s (%s): running without the persistent caches (%s)",
                    where, reason, HINT)
    return True


def unwritable_reason(path: str | os.PathLike) -> str:
    """The recorded reason when `path`'s cache root was reported unwritable, else ""."""
    return _unwritable.get(str(_root_of(pathlib.Path(path))), "")


def record_compilation(state: str, path: str | os.PathLike | None, reason: str = "") -> None:
    """state: "on" (read and write), "read_only" (an existing cache nothing can be added to),
    "unavailable" (its folder cannot be created) or "off" (not enabled, or turned off)."""
    _compilation.update(state=state, path=None if path is None else str(path), reason=reason)


def status() -> dict:
    """The caches' state in this process (nothing is probed or written). `degraded` lists one line per
    degraded mode (a cache folder that cannot be written, no native library), empty when everything
    works as configured."""
    from pallas_kernels.cpu import library_status
    root = cache_root()
    if cache_disabled_by_env():
        weights = {"state": "off", "reason": f"{ENV_NO_CACHE}=1"}
    else:
        why = unwritable_reason(root / "weights")
        weights = ({"state": "read_only" if is_folder(root) else "unavailable", "reason": why} if why
                   else {"state": "on", "reason": ""})
    native = library_status()
    with _lock:
        unwritable = dict(_unwritable)
    degraded = [f"cache {where} {'is read-only' if is_folder(where) else 'cannot be created'}: {why}"
                for where, why in unwritable.items()]
    if native["state"] in ("unavailable", "temporary"):
        degraded.append(f"native CPU library {native['state']}: {native['reason']}")
    return {"cache_root": str(root), "compilation_cache": dict(_compilation), "weight_cache": weights,
            "native_library": native, "degraded": degraded}
