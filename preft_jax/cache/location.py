"""Where preft_jax keeps its caches.

Root: `$PREFT_JAX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/preft_jax` (an absolute path: the XDG
spec ignores a relative one), else `~/.cache/preft_jax`, where `~` is $HOME when it is an absolute
path, else the user's home in the password database (an empty or relative HOME would put the cache
under whatever folder a command runs in), else `<tmp>/preft_jax-<uid>` when it is this user's alone
(mode 0700; a shared predictable folder could be planted with a library by another user).
Layout under the root:

    weights/v1/<sha256 of the model file>-<dtype>/   dequantized weights (see preft_jax.cache.weights)
    hashes/<sha256 of the absolute path>.json        (path, size, mtime, inode) -> content sha256 memo
    jax/                                             JAX persistent compilation cache
    cpu_native/<key>/                                the compiled native CPU library (pallas_kernels.cpu)

`PREFT_JAX_NO_CACHE=1` turns the weight cache and the compilation cache off by default.
"""
from __future__ import annotations

import os
import pathlib
import stat
import tempfile

ENV_CACHE_DIR = "PREFT_JAX_CACHE_DIR"
ENV_NO_CACHE = "PREFT_JAX_NO_CACHE"
_FALSY = ("", "0", "false", "no", "off")


def home() -> pathlib.Path:
    """$HOME when absolute, else the password database's home for this user, else `_private_home()`
    (pallas_kernels/cpu/_build.py mirrors this: it cannot import it)."""
    env = os.environ.get("HOME", "")
    if os.path.isabs(env):
        return pathlib.Path(env)
    try:
        import pwd
        entry = pwd.getpwuid(os.getuid()).pw_dir
    except (ImportError, KeyError, OSError):
        entry = ""
    if os.path.isabs(entry):
        return pathlib.Path(entry)
    return pathlib.Path(_private_home())


def _private_home() -> str:
    """`<tmp>/preft_jax-<uid>`, made mode 0700, used only when it is a real folder of this user that no
    one else can write (a shared predictable path could be planted with a library by another user);
    else a path that cannot be created (the caches then report that they run without persistence)."""
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


def cache_root() -> pathlib.Path:
    """The cache root directory (not created here)."""
    explicit = os.environ.get(ENV_CACHE_DIR)
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = pathlib.Path(xdg) if os.path.isabs(xdg) else home() / ".cache"
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


def native_dir() -> pathlib.Path:
    """Where pallas_kernels.cpu keeps its compiled library (it computes the same path itself: the
    kernels package sits below preft_jax and cannot import it)."""
    return cache_root() / "cpu_native"


def is_folder(path: str | os.PathLike) -> bool:
    """`path` is a folder this process can see. pathlib's is_dir() raises for a folder above it that
    cannot be entered (permission denied) or a name too long; a cache treats all of those as absent."""
    try:
        return pathlib.Path(path).is_dir()
    except (OSError, ValueError):
        return False


def writable_reason(path: str | os.PathLike) -> str:
    """"" when files can be created in the directory `path` (created, with its parents, if missing),
    else why not (e.g. "Permission denied: /x"). Probes by creating and removing a file:
    permission bits alone do not tell (root, read-only mounts, ACLs)."""
    path = pathlib.Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
        return ""
    except OSError as e:
        if not e.strerror:
            return str(e)
        failed = e.filename if e.filename and not pathlib.Path(e.filename).name.startswith(".probe-") else path
        return f"{e.strerror}: {failed}"
