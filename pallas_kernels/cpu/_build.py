"""Compiles decode.cc into a shared library (once per source, jaxlib version and CPU) and registers
its XLA FFI handlers with jax.

The library is built with the C++ compiler (`CXX`, default g++; -O3 -march=native -fopenmp) against
jaxlib's XLA FFI headers into a cache directory keyed by the source, the jaxlib version and this
CPU's model and instruction-set flags (<cache>/cpu_native/<key>/, <cache> as preft_jax.cache's:
$PREFT_JAX_CACHE_DIR, else $XDG_CACHE_HOME/preft_jax, else ~/.cache/preft_jax),
so a cache shared between machines never hands one CPU another's build. Nothing is built at import:
the first `available()` (or op call) builds, later processes load the cached file.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import subprocess
import threading

import jax
import jaxlib

log = logging.getLogger("pallas_kernels.cpu")
SOURCE = pathlib.Path(__file__).with_name("decode.cc")
TARGETS = {"preft_packed_matmul": "PreftPackedMatmul", "preft_decode_step": "PreftDecodeStep"}
_lock = threading.Lock()


def _cpu_signature() -> bytes:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep)).encode()


def cache_dir() -> pathlib.Path:
    root = os.environ.get("PREFT_JAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "preft_jax")
    key = hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode() + _cpu_signature()).hexdigest()[:16]
    return pathlib.Path(root) / "cpu_native" / key


def _compile() -> pathlib.Path:
    out = cache_dir() / "libpreft_cpu_native.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
           "-w", f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    os.replace(tmp, out)                       # atomic: concurrent builders never see a partial file
    return out


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Builds (if needed), loads and registers the handlers once; "" or why they are unavailable."""
    if os.environ.get("PREFT_CPU_NATIVE", "1") == "0":
        return "disabled by PREFT_CPU_NATIVE=0"
    with _lock:
        try:
            so = ctypes.CDLL(str(_compile()))
        except (OSError, RuntimeError) as e:
            return f"cannot build the native CPU library: {e}"
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(so, symbol)), platform="cpu")
        log.info("native CPU decode handlers registered (%s)", cache_dir())
        return ""
