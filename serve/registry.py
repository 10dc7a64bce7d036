"""Adapter registry with tiers: disk -> host cache (bytes-bounded LRU) -> device bank slots.

PreFT's decode never reads the adapter, so a request needs its adapter on the device only while its
prompt is prefilled. The registry therefore separates three things:

* **known adapters**: registered by name (`load(name, folder | weights)`, at start or at run time)
  or found by name on first use as a subfolder of `adapter_dir` (PEFT LoRA, ReFT, pyreft, Orbax);
* **host tier**: loaded, validated weights in host memory, LRU-evicted past `host_cache_bytes`
  (adapters registered as in-memory weights have no file to reload from and are never evicted);
  loading runs on a small thread pool, never on the engine's step;
* **device tier**: `capacity` bank slots (slot 0 is the base model). The engine pins a slot for a
  request when its prefill starts and unpins it when the prefill ends (mode "prefill", PreFT), or
  when the request ends (mode "all", the all-token baseline). Unpinned slots keep their weights
  (a later request for the same adapter is a device hit) until evicted least-recently-used.

Every request holds a reference (`acquire` -> `AdapterRef`, `release`) from submit to its end, so an
adapter in use is never unloaded. A folder that changes on disk (new weights, same name) is detected
by its file signature at `acquire`: the new version is loaded and gets its own device slot; requests
already running keep the version they started with. `identity(ref)` names the exact weights (and
position policy) a request uses, which the prefix cache keys adapted KV blocks on.

The registry's `mode` decides which tokens every adapter acts on, whatever policy the adapter was
saved with: "prefill" (prompt tokens only; a saved first_k / last_k prompt window is kept) or "all"
(`preft_jax.adapters.policy.serving_policy`; an activated adapter keeps its own policy).
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
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters.bank import AdapterBank, empty_bank
from preft_jax.adapters.config import LORA_TARGETS, LoraWeights, ReftWeights
from preft_jax.adapters.policy import PositionPolicy, serving_table, slot_entry, with_serving_policy
from preft_jax.adapters.reft_io import load_adapter
from preft_jax.config import ModelConfig
from serve.errors import (AdapterCapacityError, AdapterExistsError, AdapterInUseError, AdapterLoadError,
                          RequestError, UnknownAdapterError)
from serve.metrics import Histogram

MODES = ("prefill", "all")
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger("serve.registry")


class NoDeviceSlot(RuntimeError):
    """Every device slot is pinned by a running prefill (the request waits for the next step)."""


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


def with_policy(weights: LoraWeights | ReftWeights, mode: str) -> LoraWeights | ReftWeights:
    """`weights` with the position policy a registry of `mode` serves it with (`policy.serving_policy`)."""
    return with_serving_policy(weights, mode)


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


@dataclasses.dataclass
class HostEntry:
    name: str
    weights: LoraWeights | ReftWeights          # with the registry's serving policy
    kind: str                                   # "lora" | "reft"
    digest: bytes                               # weights + policy
    nbytes: int
    signature: tuple | None                     # folder signature (None: in-memory registration)
    path: str | None
    update: dict | None = None                  # padded host arrays for the bank, built once
    policy: PositionPolicy | None = None        # the serving policy (weights.config.policy)


@dataclasses.dataclass(eq=False)
class AdapterRef:
    """A request's hold on an adapter (from submit to the request's end)."""
    name: str
    entry: HostEntry | None = None              # the version this request uses, fixed when first resolved
    slot: int = 0                               # device slot while pinned (0: not pinned)


@dataclasses.dataclass
class _Slot:
    key: tuple | None = None                    # (name, digest) of the weights in this slot
    pins: int = 0
    last_used: int = 0
    static: bool = False                        # prebuilt bank (from_bank): never evicted


@dataclasses.dataclass
class _Source:
    path: str | None
    weights: LoraWeights | ReftWeights | None


class TierStats:
    def __init__(self):
        self.host_hits = self.host_misses = self.host_evictions = 0
        self.device_hits = self.device_misses = self.device_evictions = 0
        self.load_failures = 0
        self.load_seconds = Histogram((0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))


class AdapterRegistry:
    def __init__(self, cfg: ModelConfig, capacity: int, lora_targets: Sequence[str] = LORA_TARGETS,
                 lora_rank: int = 16, reft_rank: int = 8, mode: str = "prefill", dtype=None,
                 adapter_dir: str | os.PathLike | None = None, host_cache_bytes: int = 1 << 30,
                 loader_threads: int = 2, max_registered: int | None = None):
        if mode not in MODES:
            raise ValueError(f"registry mode must be one of {MODES}, got {mode!r}")
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        if adapter_dir is not None and not os.path.isdir(adapter_dir):
            raise ValueError(f"adapter_dir is not a folder: {adapter_dir}")
        self.cfg, self.mode, self.capacity = cfg, mode, capacity
        self.adapter_dir = None if adapter_dir is None else os.path.realpath(adapter_dir)
        self.host_cache_bytes, self.max_registered = int(host_cache_bytes), max_registered
        self._lock = threading.RLock()
        self._sources: dict[str, _Source] = {}
        self._host: collections.OrderedDict[str, HostEntry] = collections.OrderedDict()   # LRU first
        self._host_bytes = 0
        self._loading: dict[str, concurrent.futures.Future] = {}
        self._refs: collections.Counter = collections.Counter()
        self._slots = [_Slot() for _ in range(capacity + 1)]       # index 0 unused (base)
        self._tick = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, loader_threads), thread_name_prefix="adapter-load")
        self.stats = TierStats()
        self.bank: AdapterBank | None = None
        self._bank_shardings = None                                 # set by `place` (a sharded engine)
        self._writer = _write_slot
        if capacity:
            self.bank = empty_bank(cfg, capacity + 1, tuple(lora_targets), lora_rank, reft_rank, dtype or jnp.float32)

    @classmethod
    def from_bank(cls, cfg: ModelConfig, bank: AdapterBank, names: Sequence[str],
                  mode: str = "prefill") -> "AdapterRegistry":
        """Registers a prebuilt bank (e.g. from `build_bank`): names[i] -> slot i + 1, always resident.

        The bank's per-slot policies are used as they are (the caller built them for `mode`)."""
        if len(names) > bank.n_slots - 1:
            raise ValueError(f"{len(names)} names for {bank.n_slots - 1} adapter slots")
        reg = cls(cfg, capacity=0, mode=mode)
        reg.capacity, reg.bank = bank.n_slots - 1, bank
        reg._slots = [_Slot() for _ in range(bank.n_slots)]
        for slot, name in enumerate(names, start=1):
            kind = "lora" if bank.lora_A else "reft"
            policy = bank.policy.slot_policy(slot)
            if policy.mode == "activated":                  # issue 26 phase 2: the engine passes no starts yet
                raise ValueError("activated (aLoRA) adapters are not served yet (library generation supports them)")
            reg._sources[name] = _Source(None, None)
            reg._host[name] = HostEntry(name, None, kind, slot.to_bytes(4, "little") + b"static", 0, None, None,
                                        policy=policy)
            reg._slots[slot] = _Slot(key=(name, reg._host[name].digest), static=True)
        return reg

    def set_mode(self, mode: str) -> None:
        """Switches every adapter to `mode` (the engine sets its registry's mode at construction).
        Cached versions are dropped (they carry the old policy) and reload on next use."""
        if mode not in MODES:
            raise ValueError(f"registry mode must be one of {MODES}, got {mode!r}")
        with self._lock:
            if mode == self.mode:
                return
            if any(self._refs.values()):
                raise RuntimeError("cannot change the registry's mode while adapters are in use")
            self.mode = mode
            if self.bank is None:
                return
            static = [s for s in self._slots[1:] if s.static]
            if static:                           # a prebuilt bank: switch its per-slot policies
                self.bank = dataclasses.replace(self.bank, policy=serving_table(self.bank.policy, mode))
                if self._bank_shardings is not None:
                    self.bank = jax.device_put(self.bank, self._bank_shardings)
                return
            for name, entry in list(self._host.items()):
                src = self._sources.get(name)
                if src is not None and src.weights is not None:
                    self._host[name] = self._entry(name, src.weights, None, None)
                else:
                    self._drop_host_locked(name)
            for s in self._slots[1:]:
                s.key = None

    # ---- known adapters ----------------------------------------------------------------------
    def load(self, name: str, adapter: LoraWeights | ReftWeights | str | os.PathLike) -> str:
        """Registers `name` (a folder or weights) and loads it into the host tier now, so a bad
        adapter fails here. Returns its kind ("lora" | "reft"). Raises AdapterExistsError,
        AdapterCapacityError (more than max_registered) or AdapterLoadError."""
        check_adapter_name(name)
        with self._lock:
            self._check_loadable_locked(name)
        path = os.fspath(adapter) if isinstance(adapter, (str, os.PathLike)) else None
        if path is None and not isinstance(adapter, (LoraWeights, ReftWeights)):
            raise AdapterLoadError(f"cannot load adapter {name!r}: expected LoraWeights, ReftWeights or a folder "
                                   f"path, got {type(adapter).__name__}")
        entry = self._load_entry(name, path, None if path else adapter)
        with self._lock:
            self._check_loadable_locked(name)
            self._sources[name] = _Source(path, None if path else adapter)
            self._insert_host_locked(entry)
        return entry.kind

    def _check_loadable_locked(self, name: str):
        if name in self._sources:
            raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
        if self.bank is None:
            raise AdapterCapacityError("this engine was started without adapter slots (capacity 0)")
        if self.max_registered is not None and len(self._sources) >= self.max_registered:
            raise AdapterCapacityError(f"all {self.max_registered} adapter registrations are in use; unload one first")

    def unload(self, name: str) -> None:
        """Forgets a registered adapter. Raises UnknownAdapterError, or AdapterInUseError while in use."""
        with self._lock:
            if name not in self._sources:
                raise self._unknown(name)
            if self._refs[name]:
                raise AdapterInUseError(f"adapter {name!r} is used by {self._refs[name]} running or queued "
                                        f"request(s); retry when they finish")
            del self._sources[name]
            self._drop_host_locked(name)
            for s in self._slots[1:]:
                if s.key is not None and s.key[0] == name and not s.pins and not s.static:
                    s.key = None

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
        with self._lock:
            return isinstance(name, str) and (name in self._sources or self._dir_path(name) is not None)

    def names(self) -> dict[str, str]:
        """Registered adapters and adapters in the host tier: name -> "lora" | "reft"."""
        with self._lock:
            out = {n: e.kind for n, e in self._host.items()}
            for n, src in self._sources.items():
                if n not in out:
                    out[n] = _folder_kind(src.path) if src.path else (
                        "lora" if isinstance(src.weights, LoraWeights) else "reft")
            return out

    # ---- host tier ---------------------------------------------------------------------------
    def _entry(self, name, weights, path, signature) -> HostEntry:
        check_weights(weights, self.cfg)
        self._check_fits(weights)
        weights = with_policy(weights, self.mode)
        if weights.config.policy.mode == "activated":       # issue 26 phase 2: the engine passes no starts yet
            raise ValueError("activated (aLoRA) adapters are not served yet (library generation supports them)")
        kind = "lora" if isinstance(weights, LoraWeights) else "reft"
        return HostEntry(name, weights, kind, weights_digest(weights), _nbytes(weights), signature, path,
                         policy=weights.config.policy)

    def _check_fits(self, weights):
        bank = self.bank
        if bank is None:
            raise ValueError("this engine was started without adapter slots")
        if isinstance(weights, LoraWeights):
            missing = set(weights.config.targets) - set(bank.lora_A)
            if missing:
                raise ValueError(f"the adapter bank has no LoRA slots for targets {sorted(missing)} "
                                 f"(bank targets: {sorted(bank.lora_A)})")
            rank = next(iter(bank.lora_A.values())).shape[-1] if bank.lora_A else 0
            if weights.config.rank > rank:
                raise ValueError(f"LoRA rank {weights.config.rank} exceeds the bank's rank {rank}")
        else:
            if bank.reft_R is None:
                raise ValueError("the adapter bank was built without ReFT slots")
            if weights.config.rank > bank.reft_R.shape[-2]:
                raise ValueError(f"ReFT rank {weights.config.rank} exceeds the bank's rank {bank.reft_R.shape[-2]}")

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
        entry.update = self._bank_update(entry.weights)
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
        with self._lock:
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
            with self._lock:
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
        with self._lock:
            if name not in self._sources and self._dir_path(name) is None:
                raise self._unknown(name)
            self._refs[name] += 1
        return AdapterRef(name)

    def release(self, ref: AdapterRef | None) -> None:
        if ref is None:
            return
        if ref.slot:
            self.unpin(ref)
        with self._lock:
            self._refs[ref.name] -= 1
            if self._refs[ref.name] <= 0:
                del self._refs[ref.name]

    def in_use(self, name: str) -> int:
        with self._lock:
            if name not in self._sources and name not in self._host:
                raise self._unknown(name)
            return self._refs[name]

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

    def identity(self, ref: AdapterRef | None) -> bytes | None:
        return None if ref is None or ref.entry is None else ref.entry.name.encode() + b"\0" + ref.entry.digest

    def policy(self, ref: AdapterRef | None) -> PositionPolicy | None:
        """The serving position policy of the version `ref` resolved to (None: base model)."""
        if ref is None:
            return None
        if ref.entry is None:
            raise RuntimeError(f"adapter {ref.name!r} is not resolved yet")
        return ref.entry.policy

    # ---- device tier -------------------------------------------------------------------------
    def place(self, shardings) -> None:
        """Places the device bank by `shardings` (a NamedSharding tree of the bank, from
        `preft_jax.sharding.bank_shardings`); every later slot write keeps them (explicit out_shardings)."""
        with self._lock:
            if self.bank is None:
                return
            self._bank_shardings = shardings
            self.bank = jax.device_put(self.bank, shardings)
            self._writer = jax.jit(_write_slot_impl.__wrapped__, donate_argnums=0, out_shardings=shardings)

    def pin(self, ref: AdapterRef) -> int:
        """A device slot holding `ref`'s weights, pinned until `unpin` (uploads into the LRU unpinned
        slot when not resident). Engine thread only: it replaces `self.bank`. Raises NoDeviceSlot."""
        if ref.slot:
            return ref.slot
        entry = ref.entry
        if entry is None:
            raise RuntimeError(f"adapter {ref.name!r} is not resolved yet")
        key = (entry.name, entry.digest)
        with self._lock:
            self._tick += 1
            slot = next((i for i, s in enumerate(self._slots) if i and s.key == key), None)
            if slot is not None:
                self.stats.device_hits += 1
            else:
                free = [i for i, s in enumerate(self._slots) if i and not s.pins and not s.static]
                if not free:
                    raise NoDeviceSlot(f"all {self.capacity} device adapter slots are pinned")
                empty = [i for i in free if self._slots[i].key is None]
                slot = empty[0] if empty else min(free, key=lambda i: self._slots[i].last_used)
                if not empty:
                    self.stats.device_evictions += 1
                self.stats.device_misses += 1
                self._slots[slot].key = None
                self.bank = self._writer(self.bank, jnp.int32(slot), entry.update or self._bank_update(entry.weights))
                self._slots[slot].key = key
            s = self._slots[slot]
            s.pins += 1
            s.last_used = self._tick
            ref.slot = slot
            return slot

    def unpin(self, ref: AdapterRef) -> None:
        if not ref.slot:
            return
        with self._lock:
            self._slots[ref.slot].pins -= 1
            ref.slot = 0

    def device_free_slots(self) -> int:
        with self._lock:
            return sum(1 for i, s in enumerate(self._slots) if i and not s.pins and not s.static)

    def resident(self, ref: AdapterRef) -> bool:
        e = ref.entry
        with self._lock:
            return e is not None and any(s.key == (e.name, e.digest) for s in self._slots[1:])

    def occupancy(self) -> dict:
        with self._lock:
            return {"device_slots": self.capacity, "device_pinned": sum(s.pins > 0 for s in self._slots[1:]),
                    "device_resident": sum(s.key is not None for s in self._slots[1:]),
                    "host_entries": len(self._host), "host_bytes": self._host_bytes,
                    "registered": len(self._sources), "loading": len(self._loading)}

    def _bank_update(self, weights) -> dict:
        """Host arrays for one bank slot (zero-padded to the bank's ranks, LoRA scale folded into B)."""
        bank = self.bank
        dt = np.float32
        L = self.cfg.n_layers
        upd = {"lora_A": {}, "lora_B": {}}
        for t, A in bank.lora_A.items():
            r = A.shape[-1]
            a = np.zeros((L,) + tuple(A.shape[2:]), dt)
            b = np.zeros((L,) + tuple(bank.lora_B[t].shape[2:]), dt)
            if isinstance(weights, LoraWeights) and t in weights.config.targets:
                k = weights.config.rank
                a[..., :k] = weights.A[t]
                b[:, :k, :] = np.asarray(weights.B[t], dt) * weights.config.scale
            upd["lora_A"][t], upd["lora_B"][t] = a, b
            assert a.shape[-1] == r
        if bank.reft_R is not None:
            r = bank.reft_R.shape[-2]
            R = np.zeros((L, r, self.cfg.d_model), dt)
            W, b = np.zeros_like(R), np.zeros((L, r), dt)
            sub = 0.0
            if isinstance(weights, ReftWeights):
                k = weights.config.rank
                R[:, :k], W[:, :k], b[:, :k] = weights.R, weights.W, weights.b
                sub = 1.0 if weights.config.kind == "loreft" else 0.0
            upd.update(reft_R=R, reft_W=W, reft_b=b, reft_subtract=np.float32(sub))
        upd["policy"] = slot_entry(weights.config.policy, bank.policy)
        return upd

    def close(self):
        self._pool.shutdown(wait=False, cancel_futures=True)


def _folder_kind(path: str) -> str:
    from preft_jax.adapters.reft_io import adapter_kind
    try:
        return adapter_kind(path)
    except (OSError, ValueError):
        return "unknown"


def _set(x, slot, value):
    return x.at[:, slot].set(jnp.asarray(value, x.dtype))


@jax.jit
def _write_slot_impl(bank: AdapterBank, slot, upd: dict) -> AdapterBank:
    A = {t: _set(a, slot, upd["lora_A"][t]) for t, a in bank.lora_A.items()}
    B = {t: _set(b, slot, upd["lora_B"][t]) for t, b in bank.lora_B.items()}
    R, W, b, sub = bank.reft_R, bank.reft_W, bank.reft_b, bank.reft_subtract
    if R is not None:
        R, W, b = _set(R, slot, upd["reft_R"]), _set(W, slot, upd["reft_W"]), _set(b, slot, upd["reft_b"])
        sub = sub.at[slot].set(jnp.asarray(upd["reft_subtract"], sub.dtype))
    return AdapterBank(A, B, R, W, b, sub, policy=bank.policy.write(slot, upd["policy"]))


_write_slot_donating = jax.jit(_write_slot_impl.__wrapped__, donate_argnums=0)


def _write_slot(bank, slot, upd):
    """One slot of the bank replaced in place (the old bank buffers are donated)."""
    return _write_slot_donating(bank, slot, upd)
