"""The adapter catalog: which adapters exist and their loaded weights in host memory.

* **known adapters**: registered by name (`load(name, folder | weights)`, at start or at run time)
  or found by name on first use as a subfolder of `adapter_dir` (PEFT LoRA, ReFT, pyreft, Orbax);
* **host tier**: loaded, validated weights in host memory with their bank slot arrays built once
  (`HostEntry.update`), LRU-evicted past `host_cache_bytes` (adapters registered as in-memory
  weights have no file to reload from and are never evicted); loading runs on a small thread pool,
  never on the engine's step;
* **references**: every request holds one (`acquire` -> `AdapterRef`, `release`) from submit to its
  end, so an adapter in use is never unloaded. A folder that changes on disk (new weights, same
  name) is detected by its file signature: the new version is loaded; requests already running
  keep the version they resolved (`resolve`).

Device bank slots are serve/adapter_slots.py's; serve/registry.py puts the two together.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
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
from preft_jax.adapters.policy import PositionPolicy, with_serving_policy
from preft_jax.adapters.reft_io import load_adapter
from preft_jax.config import ModelConfig
from serve.errors import (AdapterCapacityError, AdapterExistsError, AdapterInUseError, AdapterLoadError,
                          RequestError, UnknownAdapterError)

MODES = ("prefill", "all")                     # engine modes (policy.serving_policy)
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


@dataclasses.dataclass(eq=False)
class AdapterRef:
    """A request's hold on an adapter (from submit to the request's end)."""
    name: str
    entry: HostEntry | None = None              # the version this request uses, fixed when first resolved
    slot: int = 0                               # adapter slot while pinned (0: not pinned)


@dataclasses.dataclass
class _Source:
    path: str | None
    weights: LoraWeights | ReftWeights | None


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
    def load(self, name: str, adapter: LoraWeights | ReftWeights | str | os.PathLike) -> str:
        """Registers `name` (a folder or weights) and loads it into the host tier now, so a bad
        adapter fails here. Returns its kind ("lora" | "reft"). Raises AdapterExistsError,
        AdapterCapacityError (more than max_registered) or AdapterLoadError."""
        check_adapter_name(name)
        with self.lock:
            self._check_loadable_locked(name)
        path = os.fspath(adapter) if isinstance(adapter, (str, os.PathLike)) else None
        if path is None and not isinstance(adapter, (LoraWeights, ReftWeights)):
            raise AdapterLoadError(f"cannot load adapter {name!r}: expected LoraWeights, ReftWeights or a folder "
                                   f"path, got {type(adapter).__name__}")
        entry = self._load_entry(name, path, None if path else adapter)
        with self.lock:
            self._check_loadable_locked(name)
            self._sources[name] = _Source(path, None if path else adapter)
            self._insert_host_locked(entry)
        return entry.kind

    def _check_loadable_locked(self, name: str):
        if name in self._sources:
            raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
        if self.slot_update is None:
            raise AdapterCapacityError("this engine was started without adapter slots (capacity 0)")
        if self.max_registered is not None and len(self._sources) >= self.max_registered:
            raise AdapterCapacityError(f"all {self.max_registered} adapter registrations are in use; unload one first")

    def unload(self, name: str) -> None:
        """Forgets a registered adapter. Raises UnknownAdapterError, or AdapterInUseError while in use."""
        with self.lock:
            if name not in self._sources:
                raise self._unknown(name)
            if self.refs[name]:
                raise AdapterInUseError(f"adapter {name!r} is used by {self.refs[name]} running or queued "
                                        f"request(s); retry when they finish")
            del self._sources[name]
            self._drop_host_locked(name)

    def _dir_path(self, name: str) -> str | None:
        """adapter_dir/name when it is a folder inside adapter_dir (symlinks resolved)."""
        if self.adapter_dir is None or not NAME_RE.match(name) or name in (".", ".."):
            return None
        real = os.path.realpath(os.path.join(self.adapter_dir, name))
        if os.path.commonpath([self.adapter_dir, real]) != self.adapter_dir or not os.path.isdir(real):
            return None
        return real

    def _unknown(self, name: str) -> UnknownAdapterError:
        known = sorted(self._sources)
        listing = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "") if known else "none"
        extra = " or in the adapter directory" if self.adapter_dir else ""
        return UnknownAdapterError(f"unknown adapter {name!r} (not registered{extra}; registered: {listing})")

    def __contains__(self, name) -> bool:
        with self.lock:
            return isinstance(name, str) and (name in self._sources or self._dir_path(name) is not None)

    def names(self) -> dict[str, str]:
        """Registered adapters and adapters in the host tier: name -> "lora" | "reft"."""
        with self.lock:
            out = {n: e.kind for n, e in self._host.items()}
            for n, src in self._sources.items():
                if n not in out:
                    out[n] = _folder_kind(src.path) if src.path else (
                        "lora" if isinstance(src.weights, LoraWeights) else "reft")
            return out

    # ---- host tier ---------------------------------------------------------------------------
    def _entry(self, name, weights, path, signature) -> HostEntry:
        check_weights(weights, self.cfg)
        if self.slot_update is None:
            raise ValueError("this engine was started without adapter slots")
        weights = with_serving_policy(weights, self.mode)
        if weights.config.policy.mode == "activated":       # issue 26 phase 2: the engine passes no starts yet
            raise ValueError("activated (aLoRA) adapters are not served yet (library generation supports them)")
        update = self.slot_update(weights)           # raises ValueError when it does not fit the bank
        kind = "lora" if isinstance(weights, LoraWeights) else "reft"
        return HostEntry(name, weights, kind, weights_digest(weights), _nbytes(weights), signature, path,
                         update=update, policy=weights.config.policy)

    def _load_entry(self, name: str, path: str | None, weights=None) -> HostEntry:
        """Reads and validates one adapter (loader thread or caller). Raises AdapterLoadError."""
        t0 = time.monotonic()
        try:
            signature = folder_signature(path) if path else None
            if path is not None:
                weights = load_adapter(path, self.cfg)
            entry = self._entry(name, weights, path, signature)
        except (OSError, ValueError, TypeError) as e:
            self.stats.load_failures += 1
            raise AdapterLoadError(f"cannot load adapter {name!r}" + (f" from {path!r}" if path else "") + f": {e}",
                                   "model") from e
        except Exception as e:  # noqa: BLE001 - any loader failure is the adapter's problem, never a 500
            self.stats.load_failures += 1
            log.exception("unexpected error loading adapter %r from %r", name, path)
            raise AdapterLoadError(f"cannot load adapter {name!r}: not a valid adapter", "model") from e
        self.stats.load_seconds.observe(time.monotonic() - t0)
        return entry

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

    def _source_path(self, name: str) -> str | None:
        src = self._sources.get(name)
        return src.path if src is not None else self._dir_path(name)

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
        """A future of the current host entry of `name` (loading it in the background if needed)."""
        with self.lock:
            entry = self._current_locked(name)
            if entry is not None:
                self.stats.host_hits += 1
                f = concurrent.futures.Future()
                f.set_result(entry)
                return f
            if name in self._loading:
                return self._loading[name]
            path = self._source_path(name)
            src = self._sources.get(name)
            if path is None and (src is None or src.weights is None):
                f = concurrent.futures.Future()
                f.set_exception(self._unknown(name))
                return f
            self.stats.host_misses += 1
            fut = self._pool.submit(self._load_entry, name, path, None if path else src.weights)
            self._loading[name] = fut

        def done(f):
            with self.lock:
                if self._loading.get(name) is f:
                    del self._loading[name]
                if f.exception() is None and (name in self._sources or self._dir_path(name)):
                    self._insert_host_locked(f.result())
        fut.add_done_callback(done)
        return fut

    # ---- requests ----------------------------------------------------------------------------
    def acquire(self, name: str | None) -> AdapterRef | None:
        """A reference on `name` for a request (None: the base model). Raises UnknownAdapterError."""
        if name is None:
            return None
        with self.lock:
            if name not in self._sources and self._dir_path(name) is None:
                raise self._unknown(name)
            self.refs[name] += 1
        return AdapterRef(name)

    def release(self, ref: AdapterRef) -> None:
        """Drops `ref`'s reference (its adapter slot must be unpinned already)."""
        with self.lock:
            self.refs[ref.name] -= 1
            if self.refs[ref.name] <= 0:
                del self.refs[ref.name]

    def in_use(self, name: str) -> int:
        with self.lock:
            if name not in self._sources and name not in self._host:
                raise self._unknown(name)
            return self.refs[name]

    def resolve(self, ref: AdapterRef) -> HostEntry | None:
        """The host entry the request will use (fixed at first success); None while loading.
        Raises the load error when the adapter cannot be loaded."""
        if ref.entry is not None:
            return ref.entry
        fut = self.prepare(ref.name)
        if not fut.done():
            return None
        ref.entry = fut.result()           # raises AdapterLoadError / UnknownAdapterError
        return ref.entry

    def occupancy(self) -> dict:
        with self.lock:
            return {"host_entries": len(self._host), "host_bytes": self._host_bytes,
                    "registered": len(self._sources), "loading": len(self._loading)}

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
