"""Compiles decode.cc into a shared library (once per source, jaxlib version and CPU) and registers
its XLA FFI handlers with jax.

The library is built with a C++ compiler (-O3 -march=native -fopenmp -std=c++17) against jaxlib's
XLA FFI headers into a cache folder keyed by the source, the jaxlib version, this CPU's model and
instruction-set flags, the C library's version, and $CXX (a compiler command may carry flags:
`g++ -mno-avx512f`) (<cache>/cpu_native/<key>/, <cache> as preft_jax.cache's: $PREFT_JAX_CACHE_DIR, else
$XDG_CACHE_HOME/preft_jax, else ~/.cache/preft_jax), so a cache shared between machines never
hands one CPU another's build, nor one compiler command another's. Nothing is built at import: the
first `available()` (or op call) builds, later processes load the cached file.

Compiler: `$CXX` when set (only it: the user chose it), else the first of c++, clang++, g++ on PATH
that builds the file. A compile that has not finished in $PREFT_CPU_NATIVE_BUILD_TIMEOUT seconds
(default 300; a stuck compiler wrapper) is killed with everything it started, and counts as failed.

The cached file is never trusted blindly: the folder holds the library and its SHA-256
(`libpreft_cpu_native.so.sha256`), built in a hidden temporary folder and published with one atomic
rename, so a failed or interrupted build leaves nothing behind. Before loading, the library is
checked against its checksum; a truncated or garbled file (loading one can kill the process with a
bus error), or one that matches its checksum but does not load, is deleted and rebuilt. A cache
folder that cannot be written, or cannot hold a loadable library, gets a build in a temporary folder
for this process only. Every degraded outcome (no compiler, a failed build, a rebuilt or
temporary library) logs ONE line on the "pallas_kernels.cpu" logger; `library_status()` tells
what happened, and the caller falls back to the XLA path when the library is unavailable.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import uuid

import jax
import jaxlib

log = logging.getLogger("pallas_kernels.cpu")
SOURCE = pathlib.Path(__file__).with_name("decode.cc")
TARGETS = {"preft_packed_matmul": "PreftPackedMatmul", "preft_decode_step": "PreftDecodeStep"}
LIBRARY = "libpreft_cpu_native.so"
CHECKSUM = LIBRARY + ".sha256"
COMPILERS = ("c++", "clang++", "g++")         # tried in this order when $CXX is unset
_lock = threading.Lock()
_status: dict = {"state": "not_loaded", "path": None, "size": None, "reason": "not requested in this process"}


class BuildError(Exception):
    """The library could not be built (the message is one line)."""


MAX_BUILD_TIMEOUT_S = 86400.0


def build_timeout() -> float:
    """Seconds one compile may take ($PREFT_CPU_NATIVE_BUILD_TIMEOUT, default 300, at most a day)."""
    raw = os.environ.get("PREFT_CPU_NATIVE_BUILD_TIMEOUT", "").strip()
    try:
        value = float(raw) if raw else 300.0
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_BUILD_TIMEOUT_S:          # NaN and inf fail too
        log.warning("PREFT_CPU_NATIVE_BUILD_TIMEOUT=%r is not a number of seconds in (0, %g]; using 300", raw,
                    MAX_BUILD_TIMEOUT_S)
        value = 300.0
    return value


def _run(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """(exit status, the end of its stderr) of `cmd`; None for the status when it ran past `timeout`
    seconds. It runs in a session of its own, and whatever ends the wait (the timeout, Ctrl-C) kills
    that whole session: a compiler wrapper's children go with it. Its output goes to a file, not a
    pipe, so a child that outlives it (a compile server) cannot hold the wait open."""
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except BaseException as e:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                proc.kill()
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            return None, ""
        err.seek(0)
        return status, err.read()[-20000:]


def _cpu_signature() -> bytes:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor().encode()
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep)).encode()


def _home() -> str:
    """preft_jax.cache.location.home's answer (this package sits below preft_jax: it mirrors it)."""
    env = os.environ.get("HOME", "")
    if os.path.isabs(env):
        return env
    try:
        import pwd
        entry = pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError, OSError):
        entry = ""
    return entry if os.path.isabs(entry) else _private_home()


def _private_home() -> str:
    """preft_jax.cache.location._private_home's mirror: `<tmp>/preft_jax-<uid>`, made mode 0700, used
    only when it is a real folder of this user that no one else can write (a shared predictable path
    could be planted with a library by another user); else a path that cannot be created."""
    path = os.path.join(tempfile.gettempdir(), f"preft_jax-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return path                               # cannot be made: every cache reports it, once
    try:
        st = os.lstat(path)
    except OSError:
        return path
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
        return path
    return os.path.join(os.devnull, f"preft_jax-{os.getuid()} (not private)")


def libraries_dir() -> pathlib.Path:
    """<cache root>/cpu_native: one folder per build key (the root as preft_jax.cache.location's)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    root = os.environ.get("PREFT_JAX_CACHE_DIR") or os.path.join(
        xdg if os.path.isabs(xdg) else os.path.join(_home(), ".cache"), "preft_jax")
    return pathlib.Path(root).expanduser() / "cpu_native"


@functools.lru_cache(maxsize=1)
def build_key() -> str:
    """The source, jaxlib, this CPU, the C library (a cache shared by containers of other systems) and $CXX."""
    libc = "-".join(platform.libc_ver()).encode()
    return hashlib.sha256(SOURCE.read_bytes() + jaxlib.__version__.encode() + _cpu_signature() + libc
                          + os.environ.get("CXX", "").strip().encode()).hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    """The folder of this source / jaxlib / CPU's build."""
    return libraries_dir() / build_key()


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(folder: pathlib.Path) -> str:
    """"" when folder holds a library matching its recorded checksum, else what is wrong."""
    so, sums = folder / LIBRARY, folder / CHECKSUM
    try:
        expected = sums.read_text(encoding="ascii").split()[0]
    except FileNotFoundError:
        return f"no {CHECKSUM} beside the library"
    except (OSError, ValueError, IndexError) as e:
        return f"unreadable {CHECKSUM}: {e}"
    try:
        got = _sha256(so)
    except OSError as e:
        return f"unreadable {LIBRARY}: {e}"
    if got != expected:
        return f"{LIBRARY} ({so.stat().st_size} bytes) does not match its checksum (truncated or overwritten?)"
    return ""


def compilers() -> list[list[str]]:
    """The compiler commands to try: [$CXX] when set, else those of COMPILERS found on PATH."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        try:
            return [shlex.split(cxx)]             # only it: the user chose it
        except ValueError as e:                   # e.g. an unmatched quote
            raise BuildError(f"$CXX={cxx!r} cannot be read as a command ({e})") from None
    return [[c] for c in COMPILERS if shutil.which(c)]


def _compile_into(folder: pathlib.Path) -> None:
    """Builds the library and its checksum into an existing empty folder; BuildError (one line) if no
    compiler could."""
    candidates = compilers()
    if not candidates:
        raise BuildError(f"no C++ compiler found ($CXX is unset and none of {', '.join(COMPILERS)} is on PATH)")
    out, failures, timeout = folder / LIBRARY, [], build_timeout()
    for cxx in candidates:
        cmd = [*cxx, "-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
        name = f"$CXX={' '.join(cxx)}" if os.environ.get("CXX", "").strip() else " ".join(cxx)
        try:
            status, stderr = _run(cmd, timeout)
        except OSError as e:
            failures.append(f"{cxx[0]}: {e.strerror or e}")      # e.g. $CXX names no executable
            continue
        if status is None:
            failures.append(f"{name} did not finish in {timeout:g} s and was killed "
                            f"($PREFT_CPU_NATIVE_BUILD_TIMEOUT)")
            continue
        if status == 0 and out.is_file():
            (folder / CHECKSUM).write_text(f"{_sha256(out)}  {LIBRARY}\n", encoding="ascii")
            return
        log.debug("%s failed (status %d):\n%s", " ".join(cmd), status, stderr[-4000:])
        last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
        failures.append(f"{name} exited with status {status}" + (f" ({last[:300]})" if last else ""))
    raise BuildError(f"compiling {SOURCE.name} failed: " + "; ".join(failures))


def _discard(folder: pathlib.Path) -> None:
    """Removes a folder, renaming it away first so no reader sees it half-deleted."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _build_cached(final: pathlib.Path) -> pathlib.Path:
    """Builds into a hidden sibling of `final` and publishes it with one rename. OSError when the cache
    cannot be written; BuildError when the compile fails (nothing is left behind either way)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        _compile_into(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / LIBRARY).is_file():
                raise
            # a concurrent builder published first: keep theirs (checked by the caller)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / LIBRARY


def _dlopen(path: pathlib.Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(path))


def _noexec(folder: pathlib.Path) -> str:
    """"" or why libraries under `folder` cannot be loaded: its (nearest existing) folder is on a
    filesystem mounted noexec."""
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        flags = os.statvfs(probe).f_flag
    except (OSError, AttributeError):
        return ""
    return f"{probe} is on a filesystem mounted noexec" if flags & getattr(os, "ST_NOEXEC", 0) else ""


def _open_library() -> tuple[ctypes.CDLL, pathlib.Path, str, str]:
    """(library, its path, how: "cached" | "built" | "rebuilt" | "temporary", a note for the last two).
    BuildError or OSError when no library can be had. Where the cache cannot hold a loadable library
    (not writable, mounted noexec, a build there that does not load) it is compiled into a temporary
    folder for this process."""
    final, how, note = cache_dir(), "built", ""
    fallback = _noexec(final)
    if not fallback and final.exists():
        why = verify(final)
        if not why:
            try:
                return _dlopen(final / LIBRARY), final / LIBRARY, "cached", ""
            except OSError as e:                  # its checksum matches, but it is no library for this process
                why = f"it matches its checksum but does not load: {str(e)[:200]}"
        how, note = "rebuilt", f"the cached native CPU library in {final} was rejected ({why}); rebuilt it"
        try:
            _discard(final)
        except OSError:
            pass                                  # read-only cache: build into a temporary folder below
    if not fallback:
        try:
            so = _build_cached(final)
        except OSError as e:                      # the cache folder cannot be written
            fallback = f"cannot write {final.parent} ({e.strerror or e})"
        else:
            why = verify(final)
            if why:
                raise BuildError(f"the freshly built library in {final} fails its check: {why}")
            try:
                return _dlopen(so), so, how, note
            except OSError as e:                  # left out of the cache: the next start would reject it
                try:
                    _discard(final)
                except OSError:
                    pass
                fallback = f"the library built in {final} does not load ({str(e)[:200]})"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="preft_cpu_native_"))
    try:
        _compile_into(tmp)
        try:
            lib = _dlopen(tmp / LIBRARY)          # mapped: the file may go now
        except OSError as e:
            raise BuildError(f"{fallback}; the one compiled into a temporary folder does not load either "
                             f"({str(e)[:200]})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib, tmp / LIBRARY, "temporary", (f"native CPU library: {fallback}; compiled it into a temporary "
                                             f"folder for this process only")


@functools.lru_cache(maxsize=1)
def load() -> str:
    """Builds (if needed), loads and registers the handlers once; "" or why they are unavailable.
    A failure or a degraded build (rebuilt, temporary) is logged once, in one line."""
    if os.environ.get("PREFT_CPU_NATIVE", "1") == "0":
        _status.update(state="disabled", path=None, size=None, reason="disabled by PREFT_CPU_NATIVE=0")
        return _status["reason"]
    with _lock:
        try:
            so, path, how, note = _open_library()
        except (OSError, BuildError) as e:
            reason = f"cannot build the native CPU library: {e}"
            _status.update(state="unavailable", path=None, size=None, reason=reason)
            log.warning("%s; native CPU kernels are off in this process", reason)
            return reason
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(so, symbol)), platform="cpu")
        if how == "temporary":
            _status.update(state="temporary", path=None, size=None, reason=note)
        else:
            _status.update(state="loaded", path=str(path), size=path.stat().st_size, reason=note)
        if note:
            log.warning("%s", note)
        else:
            log.info("native CPU decode handlers registered (%s, %s)", path, how)
        return ""


def library_status() -> dict:
    """This process's native library: {"state": "not_loaded" | "loaded" | "temporary" | "unavailable" |
    "disabled", "path", "size" (bytes), "reason"} (nothing is built or probed here)."""
    return dict(_status)


def cached_libraries() -> list[dict]:
    """Every build folder under libraries_dir(): {"key", "path", "size" (bytes), "status": "ok" or what
    is wrong, "current": built for this source / jaxlib / CPU}."""
    root = libraries_dir()
    out = []
    if not root.is_dir():
        return out
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        out.append({"key": folder.name, "path": str(folder / LIBRARY), "size": size,
                    "status": verify(folder) or "ok", "current": folder.name == build_key()})
    return out


def clear_cached_libraries() -> int:
    """Deletes every cached build (and leftovers of interrupted ones); returns how many builds."""
    root = libraries_dir()
    if not root.is_dir():
        return 0
    n = 0
    for folder in list(root.iterdir()):
        if folder.is_dir():
            _discard(folder)
            n += not folder.name.startswith(".")
    return n
