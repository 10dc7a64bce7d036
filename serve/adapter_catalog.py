"""The adapter catalog: which adapters exist and their loaded weights in host memory.

* **known adapters**: registered by name (`load(name, folder | weights)`, at start or at run time)
  or found by name on first use as a subfolder of `adapter_dir` (PEFT LoRA, ReFT, pyreft, Orbax);
* **host tier**: loaded, validated weights in host memory with their bank slot arrays built once
  (`HostEntry.update`), LRU-evicted past `host_cache_bytes` (adapters registered as in-memory
  weights have no file to reload from and are never evicted); loading runs on a small thread pool,
  never on the engine's step;
* **references**: every request holds one (`acquire` -> `AdapterRef`, `release`) from submit to its
  end, so an adapter in use is never unloaded under it. A folder that changes on disk (new weights,
  same name) is detected by its file signature: the new version is loaded; requests already running
  keep the version they resolved (`resolve`);
* **draining** (`unload(name, drain=True)`, what DELETE /v1/adapters/{name} does, as SGLang's
  unregister + wait_for_unload): the name is gone at once for new requests (unknown: 404, as vLLM
  and SGLang answer), the requests that hold a reference (running or queued) finish on it, and the
  last one's `release` unloads it (host entry dropped; the registry then empties its adapter slots).
  Loading the same name again while it drains is a 409 (`AdapterInUseError`);
* **containment and what clients see**: a folder loaded from a root (the server's
  `--adapter-root`, or `adapter_dir`) has every file checked to resolve inside that root before and
  after it is read (serve/access.py `check_files_inside`) and must not change while it is read.
  A load error (`AdapterLoadError`) keeps the loader's full message for the operator and library
  callers (and the log); its `public_message`, all a client gets, names the adapter and the kind of
  problem, never a server path or anything read from the files;
* names that `adapter_dir` provides are managed on disk: loading or unloading them by name over the
  API is a 409 (`AdapterDirError`), both ways.

Device bank slots are serve/adapter_slots.py's; serve/registry.py puts the two together.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import re
import threading
import time
from typing import Callable

import numpy as np
from prometheus_client import Histogram

from preft_jax.adapters.config import LoraWeights, ReftWeights
from preft_jax.adapters.peft_io import AdapterFileNotFoundError, UnsupportedAdapterError
from preft_jax.adapters.policy import PositionPolicy, with_serving_policy
from preft_jax.adapters.reft_io import load_adapter
from preft_jax.config import ModelConfig
from serve.access import OutsideRootError, check_files_inside
from serve.errors import (AdapterCapacityError, AdapterDirError, AdapterExistsError, AdapterFitError, AdapterInUseError,
                          AdapterLoadError, RequestError, UnknownAdapterError)

MODES = ("prefill", "all")                     # engine modes (policy.serving_policy)
LOAD_TRIES = 3                                 # loads of an adapter a request waits on before it fails
LOAD_RETRY_S = 0.25                            # the pause before the k-th retry: k x this
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger("serve.registry")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"registry mode must be one of {MODES}, got {mode!r}")
    return mode


def check_adapter_name(name) -> str:
    """Adapter names are 1-64 characters of [A-Za-z0-9._-] (they appear in URLs, paths and metrics)."""
    if not isinstance(name, str) or not NAME_RE.match(name) or name in (".", ".."):
        raise RequestError(f"adapter name must match {NAME_RE.pattern} (1-64 letters, digits, '.', '_', '-'), "
                           f"got {name!r}"[:300], "name")
    return name


def check_weights(weights: LoraWeights | ReftWeights, cfg: ModelConfig) -> None:
    """Shapes, ranks and finiteness of adapter weights, checked before they reach the bank (a NaN
    or Inf in one adapter must never reach a device step)."""
    if isinstance(weights, LoraWeights):
        dims, r = cfg.projection_dims(), weights.config.rank
        arrays = []
        for t in weights.config.targets:
            d_in, d_out = dims[t]
            for part, table, shape in (("A", weights.A, (cfg.n_layers, d_in, r)),
                                       ("B", weights.B, (cfg.n_layers, r, d_out))):
                if t not in table:
                    raise ValueError(f"LoRA {part} has no weights for target {t!r}")
                a = np.asarray(table[t])
                if a.shape != shape:
                    raise ValueError(f"LoRA {part}[{t}] has shape {a.shape}, expected {shape}")
                arrays.append((f"LoRA {part}[{t}]", a))
    elif isinstance(weights, ReftWeights):
        r, L, d = weights.config.rank, cfg.n_layers, cfg.d_model
        arrays = []
        for part, a, shape in (("R", weights.R, (L, r, d)), ("W", weights.W, (L, r, d)), ("b", weights.b, (L, r))):
            a = np.asarray(a)
            if a.shape != shape:
                raise ValueError(f"ReFT {part} has shape {a.shape}, expected {shape}")
            arrays.append((f"ReFT {part}", a))
    else:
        raise TypeError(f"expected LoraWeights or ReftWeights, got {type(weights).__name__}")
    for what, a in arrays:
        if not np.issubdtype(a.dtype, np.floating):
            raise ValueError(f"{what} must hold floats, got {a.dtype}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{what} holds NaN or Inf values")


def folder_signature(path: str, max_files: int = 512) -> tuple:
    """(relative path, size, mtime_ns, inode) of every file under `path`: changes when any file does."""
    out = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            out.append((os.path.relpath(p, path), st.st_size, st.st_mtime_ns, st.st_ino))
            if len(out) >= max_files:
                return tuple(out)
    return tuple(out)


def weights_digest(weights: LoraWeights | ReftWeights) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    c = weights.config
    h.update(repr((type(weights).__name__, c.rank, getattr(c, "kind", None), getattr(c, "alpha", None),
                   getattr(c, "use_rslora", None), tuple(getattr(c, "targets", ())), c.policy)).encode())
    if isinstance(weights, LoraWeights):
        for t in sorted(weights.A):
            h.update(np.ascontiguousarray(weights.A[t], np.float32).tobytes())
            h.update(np.ascontiguousarray(weights.B[t], np.float32).tobytes())
    else:
        for a in (weights.R, weights.W, weights.b):
            h.update(np.ascontiguousarray(a, np.float32).tobytes())
    return h.digest()


def _nbytes(weights) -> int:
    if isinstance(weights, LoraWeights):
        return int(sum(np.asarray(a).nbytes for a in weights.A.values()) +
                   sum(np.asarray(b).nbytes for b in weights.B.values()))
    return int(np.asarray(weights.R).nbytes + np.asarray(weights.W).nbytes + np.asarray(weights.b).nbytes)


class _FitError(ValueError):
    """Valid weights that do not fit the adapter bank (raised by `slot_update`)."""


class _ChangedWhileReading(ValueError):
    pass


def _failed(error: Exception) -> concurrent.futures.Future:
    f = concurrent.futures.Future()
    f.set_exception(error)
    return f


def _public_reason(e: Exception, path: str | None) -> str:
    """Why a folder did not load, for a client: the kind of problem and the file it is in, never a
    server path or a value read from the files (the full message is the operator's: the log, str())."""
    if isinstance(e, (OutsideRootError, _ChangedWhileReading)):
        return str(e)                               # built from file names only
    msg, folder = str(e), (path or "").rstrip(os.sep)
    if isinstance(e, AdapterFileNotFoundError) and folder:      # fixed file names and the folder: no contents
        return msg.replace(folder + os.sep, "").replace(folder, "the adapter folder")
    m = re.search(re.escape(folder + os.sep) + r"([^\s:'\"]+)", msg) if folder else None
    where = repr(m.group(1)) if m else "the adapter folder"
    if isinstance(e, UnsupportedAdapterError):
        return f"{where} uses a feature preft_jax does not serve (DoRA, biases, modules_to_save, per-module ranks, ...)"
    if isinstance(e, (ValueError, TypeError)):
        return f"{where} is malformed or does not fit this model"
    if isinstance(e, OSError):
        return f"{where} cannot be read"
    return "not a valid adapter"


def _folder_kind(path: str) -> str:
    from preft_jax.adapters.reft_io import adapter_kind
    try:
        return adapter_kind(path)
    except (OSError, ValueError):
        return "unknown"


@dataclasses.dataclass
class HostEntry:
    name: str
    weights: LoraWeights | ReftWeights | None   # with the registry's serving policy (None: prebuilt bank)
    kind: str                                   # "lora" | "reft"
    digest: bytes                               # weights + policy
    nbytes: int
    signature: tuple | None                     # folder signature (None: in-memory registration)
    path: str | None
    update: dict | None = None                  # the bank slot arrays (preft_jax.adapters.bank.slot_update)
    policy: PositionPolicy | None = None        # the serving policy (weights.config.policy)

    @functools.cached_property
    def done_future(self) -> concurrent.futures.Future:
        """A completed future of this entry, made once (`prepare` on a loaded adapter, per request)."""
        f = concurrent.futures.Future()
        f.set_result(self)
        return f


@dataclasses.dataclass(eq=False)
class AdapterRef:
    """A request's hold on an adapter (from submit to the request's end)."""
    name: str
    entry: HostEntry | None = None              # the version this request uses, fixed when first resolved
    slot: int = 0                               # adapter slot while pinned (0: not pinned)
    pending: concurrent.futures.Future | None = dataclasses.field(default=None, repr=False)
                                                # the load `resolve` waits on (its failure is this request's)
    failed_loads: int = 0                       # loads of it that failed for this request (`resolve`)
    retry_at: float = 0.0                       # time.monotonic() before which no new load is started


@dataclasses.dataclass
class _Source:
    path: str | None
    weights: LoraWeights | ReftWeights | None
    root: str | None = None                     # every file of `path` must resolve inside it (None: trusted)
    draining: bool = False                      # unloaded: no new requests; the last release forgets it


class TierStats:
    def __init__(self):
        self.host_hits = self.host_misses = self.host_evictions = 0
        self.device_hits = self.device_misses = self.device_evictions = 0
        self.load_failures = 0
        self.load_seconds = Histogram("preft_adapter_load_seconds", "disk -> host adapter load latency",
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
                                      registry=None)


class AdapterCatalog:
    """Names, validation, the host tier and request references. `slot_update(weights)` builds (and
    checks the fit of) an adapter's bank slot arrays; None when there are no adapter slots."""

    def __init__(self, cfg: ModelConfig, slot_update: Callable[[object], dict] | None, mode: str = "prefill",
                 adapter_dir: str | os.PathLike | None = None, host_cache_bytes: int = 1 << 30,
                 loader_threads: int = 2, max_registered: int | None = None, stats: TierStats | None = None):
        if adapter_dir is not None and not os.path.isdir(adapter_dir):
            raise ValueError(f"adapter_dir is not a folder: {adapter_dir}")
        if host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes (the server's --host-cache-bytes) must be >= 0, got {host_cache_bytes}")
        self.cfg, self.mode, self.slot_update = cfg, check_mode(mode), slot_update
        self.adapter_dir = None if adapter_dir is None else os.path.realpath(adapter_dir)
        self.host_cache_bytes, self.max_registered = int(host_cache_bytes), max_registered
        self.stats = stats or TierStats()
        self.lock = threading.RLock()
        self._sources: dict[str, _Source] = {}
        self._host: collections.OrderedDict[str, HostEntry] = collections.OrderedDict()   # LRU first
        self._host_bytes = 0
        self._loading: dict[str, concurrent.futures.Future] = {}
        self.refs: collections.Counter = collections.Counter()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, loader_threads), thread_name_prefix="adapter-load")

    def add_static(self, name: str, kind: str, slot: int, policy: PositionPolicy) -> HostEntry:
        """Registers `name` as the prebuilt bank's adapter in `slot` (always resident, no weights)."""
        entry = HostEntry(name, None, kind, slot.to_bytes(4, "little") + b"static", 0, None, None, policy=policy)
        with self.lock:
            self._sources[name] = _Source(None, None)
            self._host[name] = entry
        return entry

    def set_mode(self, mode: str) -> bool:
        """Switches every adapter to `mode`; False when it already was. Cached versions are rebuilt
        (in-memory weights) or dropped (they carry the old policy; folders reload on next use)."""
        check_mode(mode)
        with self.lock:
            if mode == self.mode:
                return False
            if any(self.refs.values()):
                raise RuntimeError("cannot change the registry's mode while adapters are in use")
            self.mode = mode
            for name, entry in list(self._host.items()):
                src = self._sources.get(name)
                if src is not None and src.weights is not None:
                    self._host[name] = self._entry(name, src.weights, None, None)
                elif entry.weights is not None:
                    self._drop_host_locked(name)
            return True

    # ---- known adapters ----------------------------------------------------------------------
    def load(self, name: str, adapter: LoraWeights | ReftWeights | str | os.PathLike, root: str | None = None) -> str:
        """Registers `name` (a folder or weights) and loads it into the host tier now, so a bad
        adapter fails here. Returns its kind ("lora" | "reft"). `root`: every file of the folder must
        resolve inside it, now and on every reload (a run-time load from the server's adapter root).
        Raises AdapterExistsError, AdapterDirError (a name `adapter_dir` provides), AdapterInUseError
        (its previous registration is still draining), AdapterCapacityError (more than
        max_registered) or AdapterLoadError."""
        check_adapter_name(name)
        with self.lock:
            self._check_loadable_locked(name)
        path = os.fspath(adapter) if isinstance(adapter, (str, os.PathLike)) else None
        if path is None and not isinstance(adapter, (LoraWeights, ReftWeights)):
            raise AdapterLoadError(f"cannot load adapter {name!r}: expected LoraWeights, ReftWeights or a folder "
                                   f"path, got {type(adapter).__name__}")
        src = _Source(path, None if path else adapter, root=None if root is None else os.path.realpath(root))
        entry = self._load_entry(name, src)
        with self.lock:
            self._check_loadable_locked(name)
            self._sources[name] = src
            self._loading.pop(name, None)        # a load of what the name was before lands nowhere
            self._insert_host_locked(entry)
        return entry.kind

    def check_loadable(self, name: str) -> None:
        """Raises what `load(name, ...)` would for the name alone (exists, draining, --adapter-dir, capacity)."""
        check_adapter_name(name)
        with self.lock:
            self._check_loadable_locked(name)

    def _check_loadable_locked(self, name: str):
        src = self._sources.get(name)
        if src is not None and src.draining:
            raise AdapterInUseError(f"adapter {name!r} is still draining: {self.refs[name]} running or queued "
                                    f"request(s) use its previous registration; load it again once it has "
                                    f"unloaded (DELETE /v1/adapters/{name} reports its state)")
        if src is not None:
            raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
        if self._dir_path(name) is not None:
            raise AdapterDirError(f"adapter name {name!r} is taken by a folder in the adapter directory "
                                  f"(--adapter-dir), which serves it by name; choose another name")
        if self.slot_update is None:
            raise AdapterCapacityError("this engine was started without adapter slots (capacity 0)")
        if self.max_registered is not None and len(self._sources) >= self.max_registered:
            raise AdapterCapacityError(f"all {self.max_registered} adapter registrations are in use; unload one first")

    def unload(self, name: str, drain: bool = False) -> str:
        """Forgets a registered adapter: "unloaded" when no request holds it. While requests hold it:
        with `drain`, "draining" (new requests no longer find it; the last release unloads it; asking
        again answers the state again), else AdapterInUseError. Raises UnknownAdapterError, or
        AdapterDirError for a name `adapter_dir` provides (it is managed on disk)."""
        with self.lock:
            src = self._sources.get(name)
            if src is None:
                if self._dir_path(name) is not None:
                    raise AdapterDirError(f"adapter {name!r} is served from the adapter directory (--adapter-dir) "
                                          f"and cannot be unloaded over the API; remove or rename its folder")
                raise self._unknown(name)
            if self.refs[name]:
                if not (drain or src.draining):
                    raise AdapterInUseError(f"adapter {name!r} is used by {self.refs[name]} running or queued "
                                            f"request(s); retry when they finish")
                if not src.draining:
                    src.draining = True
                    log.info("adapter %r draining: %d running or queued request(s) finish on it first",
                             name, self.refs[name])
                return "draining"
            self._forget_locked(name)
            return "unloaded"

    def _forget_locked(self, name: str) -> None:
        del self._sources[name]
        self._drop_host_locked(name)
        self._loading.pop(name, None)            # a load under way for this registration lands nowhere now

    def draining(self) -> dict[str, int]:
        """Adapters unloaded while in use: name -> the references still held."""
        with self.lock:
            return {n: self.refs[n] for n, src in self._sources.items() if src.draining}

    def _dir_path(self, name: str) -> str | None:
        """adapter_dir/name when it is a folder inside adapter_dir (symlinks resolved)."""
        if self.adapter_dir is None or not NAME_RE.match(name) or name in (".", ".."):
            return None
        real = os.path.realpath(os.path.join(self.adapter_dir, name))
        if os.path.commonpath([self.adapter_dir, real]) != self.adapter_dir or not os.path.isdir(real):
            return None
        return real

    def _live(self, name: str) -> _Source | None:
        """The registration new requests may use (None: unknown or draining)."""
        src = self._sources.get(name)
        return None if src is None or src.draining else src

    def _unknown(self, name: str) -> UnknownAdapterError:
        known = sorted(n for n, src in self._sources.items() if not src.draining)
        listing = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "") if known else "none"
        extra = " or in the adapter directory" if self.adapter_dir else ""
        return UnknownAdapterError(f"unknown adapter {name!r} (not registered{extra}; registered: {listing})")

    def __contains__(self, name) -> bool:
        with self.lock:
            return isinstance(name, str) and (self._live(name) is not None or self._dir_path(name) is not None)

    def names(self) -> dict[str, str]:
        """Registered adapters and adapters in the host tier: name -> "lora" | "reft"."""
        with self.lock:
            gone = {n for n, src in self._sources.items() if src.draining}
            out = {n: e.kind for n, e in self._host.items() if n not in gone}
            for n, src in self._sources.items():
                if n not in out and n not in gone:
                    out[n] = _folder_kind(src.path) if src.path else (
                        "lora" if isinstance(src.weights, LoraWeights) else "reft")
            return out

    def policies(self) -> dict[str, PositionPolicy | None]:
        """The serving position policy of every adapter `names()` lists (None: a folder adapter not
        in the host tier now; its policy is known once it loads)."""
        with self.lock:
            names = self.names()
            out = {n: e.policy for n, e in self._host.items() if n in names}
            for n, src in self._sources.items():
                if n in names and n not in out:
                    out[n] = None if src.weights is None else with_serving_policy(src.weights, self.mode).config.policy
            return out

    # ---- host tier ---------------------------------------------------------------------------
    def _entry(self, name, weights, path, signature) -> HostEntry:
        check_weights(weights, self.cfg)
        if self.slot_update is None:
            raise ValueError("this engine was started without adapter slots")
        weights = with_serving_policy(weights, self.mode)
        try:
            update = self.slot_update(weights)           # raises ValueError when it does not fit the bank
        except ValueError as e:
            raise _FitError(f"{e} (the server's --lora-rank / --reft-rank / --max-invocation-tokens size the "
                            f"adapter bank)") from None
        kind = "lora" if isinstance(weights, LoraWeights) else "reft"
        return HostEntry(name, weights, kind, weights_digest(weights), _nbytes(weights), signature, path,
                         update=update, policy=weights.config.policy)

    def _load_entry(self, name: str, src: _Source) -> HostEntry:
        """Reads and validates one adapter (loader thread or caller). Raises AdapterLoadError (its
        `public_message` without server paths or file contents) or AdapterFitError."""
        t0 = time.monotonic()
        path, weights = src.path, src.weights
        try:
            signature = None
            if path is not None:
                weights, signature = self._read_folder(path, src.root)
        except Exception as e:  # noqa: BLE001 - any loader failure is the adapter's problem, never a 500
            self.stats.load_failures += 1
            detail = f"cannot load adapter {name!r} from {path!r}: {e}"
            if isinstance(e, (OSError, ValueError, TypeError)):
                log.warning("%s", detail)
            else:
                log.exception("unexpected error loading adapter %r from %r", name, path)
            raise AdapterLoadError(detail, "model", f"cannot load adapter {name!r}: {_public_reason(e, path)}") from e
        try:
            entry = self._entry(name, weights, path, signature)
        except (ValueError, TypeError) as e:    # our own checks of the weights: no file contents, no paths
            self.stats.load_failures += 1
            cls = AdapterFitError if isinstance(e, _FitError) else AdapterLoadError
            raise cls(f"cannot load adapter {name!r}" + (f" from {path!r}" if path else "") + f": {e}", "model",
                      f"cannot load adapter {name!r}: {e}") from e
        self.stats.load_seconds.observe(time.monotonic() - t0)
        return entry

    def _read_folder(self, path: str, root: str | None):
        """(weights, folder signature) of an adapter folder; with a `root`, every file resolves inside
        it before and after the read, and the folder must not change while it is read."""
        if root is not None:
            check_files_inside(path, root)
        signature = folder_signature(path)
        weights = load_adapter(path, self.cfg)
        if root is not None:
            check_files_inside(path, root)
            if folder_signature(path) != signature:
                raise _ChangedWhileReading("the adapter folder changed while it was read; retry")
        return weights, signature

    def _insert_host_locked(self, entry: HostEntry):
        self._drop_host_locked(entry.name)
        self._host[entry.name] = entry
        self._host_bytes += entry.nbytes
        while self._host_bytes > self.host_cache_bytes:
            victim = next((n for n, e in self._host.items() if e.path is not None and n != entry.name), None)
            if victim is None:
                break
            self._drop_host_locked(victim)
            self.stats.host_evictions += 1

    def _drop_host_locked(self, name: str):
        e = self._host.pop(name, None)
        if e is not None:
            self._host_bytes -= e.nbytes

    def _source(self, name: str) -> _Source | None:
        """How to (re)load `name`: its registration (draining included: requests that hold it still
        resolve it) or its folder in `adapter_dir`."""
        src = self._sources.get(name)
        if src is not None:
            return src
        path = self._dir_path(name)
        return None if path is None else _Source(path, None, root=self.adapter_dir)

    def _current_locked(self, name: str) -> HostEntry | None:
        """The host entry for `name` if present and not stale (its folder unchanged)."""
        e = self._host.get(name)
        if e is None:
            return None
        if e.path is not None and folder_signature(e.path) != e.signature:
            log.info("adapter %r changed on disk; reloading", name)
            self._drop_host_locked(name)
            return None
        self._host.move_to_end(name)
        return e

    def prepare(self, name: str) -> concurrent.futures.Future:
        """A future of the current host entry of `name` (loading it in the background if needed);
        a draining adapter is unknown to new requests."""
        with self.lock:
            if name in self._sources and self._live(name) is None:
                return _failed(self._unknown(name))
            return self._prepare_any(name)

    def _prepare_any(self, name: str) -> concurrent.futures.Future:
        with self.lock:
            entry = self._current_locked(name)
            if entry is not None:
                self.stats.host_hits += 1
                return entry.done_future
            if name in self._loading:
                return self._loading[name]
            src = self._source(name)
            if src is None or (src.path is None and src.weights is None):
                return _failed(self._unknown(name))
            self.stats.host_misses += 1
            fut = self._pool.submit(self._load_entry, name, src)
            self._loading[name] = fut

        def done(f):
            with self.lock:
                if self._loading.get(name) is f:
                    del self._loading[name]
                # only into the host tier of the registration it was read for: one unloaded (and
                # perhaps registered again from another folder) meanwhile gets nothing of it
                if not f.cancelled() and f.exception() is None and self._same_source_locked(name, src):
                    self._insert_host_locked(f.result())
        fut.add_done_callback(done)
        return fut

    def _same_source_locked(self, name: str, src: _Source) -> bool:
        """Whether `src` (what a load read) is still how `name` is served: its registration, or its
        folder in `adapter_dir` for a name that is not registered."""
        registered = self._sources.get(name)
        if registered is not None:
            return registered is src
        return src.weights is None and src.root == self.adapter_dir and self._dir_path(name) == src.path

    # ---- requests ----------------------------------------------------------------------------
    def acquire(self, name: str | None) -> AdapterRef | None:
        """A reference on `name` for a request (None: the base model). Raises UnknownAdapterError."""
        if name is None:
            return None
        with self.lock:
            if self._live(name) is None and self._dir_path(name) is None:
                raise self._unknown(name)
            self.refs[name] += 1
        return AdapterRef(name)

    def release(self, ref: AdapterRef) -> bool:
        """Drops `ref`'s reference (its adapter slot must be unpinned already). True when it was the
        last reference on a draining adapter, which is now unloaded."""
        with self.lock:
            self.refs[ref.name] -= 1
            if self.refs[ref.name] > 0:
                return False
            del self.refs[ref.name]
            src = self._sources.get(ref.name)
            if src is None or not src.draining:
                return False
            self._forget_locked(ref.name)
            log.info("adapter %r drained and unloaded", ref.name)
            return True

    def in_use(self, name: str) -> int:
        """Requests holding `name`. Known: registered, on the host, or a folder in `adapter_dir` (as
        `acquire` knows it: a folder whose load is under way or done but not yet on the host, e.g. in
        the moment between its future resolving and its done-callback, is known and held by 0)."""
        with self.lock:
            if name not in self._sources and name not in self._host and self._dir_path(name) is None:
                raise self._unknown(name)
            return self.refs[name]

    def resolve(self, ref: AdapterRef) -> HostEntry | None:
        """The host entry the request will use (fixed at first success); None while loading.
        Raises the load error when the adapter cannot be loaded."""
        if ref.entry is not None:
            return ref.entry
        fut = ref.pending                        # the load this request waits on: its outcome is this
        if fut is None or fut.cancelled():       # request's (a new load per call never ended, retrying a
            if time.monotonic() < ref.retry_at:  # broken folder at every engine step)
                return None
            fut = ref.pending = self._prepare_any(ref.name)    # (a draining adapter too: this request holds it)
        if not fut.done():
            return None
        ref.pending = None
        try:
            ref.entry = fut.result()             # raises AdapterLoadError / UnknownAdapterError
        except AdapterLoadError as e:            # a folder caught mid-update may load in a moment: a few
            ref.failed_loads += 1                # spaced tries, then the request fails with the error
            if isinstance(e, AdapterFitError) or ref.failed_loads >= LOAD_TRIES:
                raise
            ref.retry_at = time.monotonic() + LOAD_RETRY_S * ref.failed_loads
            return None
        return ref.entry

    def occupancy(self) -> dict:
        with self.lock:
            return {"host_entries": len(self._host), "host_bytes": self._host_bytes,
                    "registered": len(self._sources), "loading": len(self._loading),
                    "draining": sum(src.draining for src in self._sources.values()),
                    "references": sum(self.refs.values())}

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
