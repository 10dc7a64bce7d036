"""Process start-up helpers for CLIs and servers: caches on, and no needless IPython import.

    from preft_jax.cache.startup import fast_start
    fast_start()            # first thing in main(), before jax compiles anything
"""
from __future__ import annotations

import logging
import os
import pathlib
import sys


def import_flax_quickly() -> None:
    """Import flax without its IPython probe when no IPython is running.

    `flax.nnx.reprlib.supports_color()` runs `from IPython import get_ipython` at import time just
    to learn whether a notebook is active; importing IPython costs ~0.4 s. When IPython is not
    already imported no shell can be running, so the probe's answer (False) is known: the import
    is made to fail for the duration of the flax import only.
    """
    if "flax.nnx" in sys.modules or "IPython" in sys.modules:
        return
    sys.modules["IPython"] = None          # `import IPython` raises ImportError while this is set
    try:
        import flax.nnx  # noqa: F401
    finally:
        if sys.modules.get("IPython", 0) is None:
            del sys.modules["IPython"]


class _QuietBackendProbe(logging.Filter):
    """Drops the INFO line jax logs for every optional backend it probes and skips ("Unable to initialize
    backend 'tpu': ..." on a machine without a TPU). A backend the user asked for (JAX_PLATFORMS) that
    fails raises instead, and nothing at WARNING or above is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not str(record.msg).startswith("Unable to initialize backend")


def quiet_backend_probe() -> None:
    """Install the filter above on jax's backend logger (idempotent; CLI start-up)."""
    logger = logging.getLogger("jax._src.xla_bridge")
    if not any(isinstance(f, _QuietBackendProbe) for f in logger.filters):
        logger.addFilter(_QuietBackendProbe())


def fast_start(*, use_cache: bool = True, compilation_cache_dir: str | os.PathLike | None = None
               ) -> pathlib.Path | None:
    """Enable the persistent compilation cache (unless `use_cache=False`), import flax quickly and
    drop jax's log line about optional backends it skipped (quiet_backend_probe).

    Returns the compilation cache directory, or None when caching is off.
    """
    import_flax_quickly()
    quiet_backend_probe()
    if not use_cache:
        from preft_jax.cache.status import record_compilation
        record_compilation("off", None, "turned off (--no-cache)")
        return None
    from preft_jax.cache.compilation import enable_compilation_cache
    return enable_compilation_cache(compilation_cache_dir)
