"""Adapter registry with tiers: disk -> host cache (bytes-bounded LRU) -> device adapter slots.

A thin facade over two parts, so the engine and scheduler see one object:

* serve/adapter_catalog.py: names (registered, or found under `adapter_dir` on first use), name and
  weight validation, folder signatures, containment in the adapter root, the host tier with its
  loader threads, and the references requests hold (`acquire` / `release`): an adapter in use is
  never unloaded under a request; `unload(name, drain=True)` retires it for new requests at once
  and unloads it when its last request ends;
* serve/adapter_slots.py: the device bank's `capacity` adapter slots (slot 0 is the base model),
  pinned while a request's prefill runs (PreFT) or while it runs (mode "all"), LRU-evicted,
  written by the bank's one slot writer (preft_jax/adapters/bank.py).

A folder that changes on disk (new weights, same name) is detected by its file signature at
`acquire`: the new version is loaded and gets its own adapter slot; requests already running keep
the version they started with. `identity(ref)` names the exact weights (and position policy) a
request uses, which the prefix cache keys adapted KV blocks on.

The registry's `mode` decides which tokens every adapter acts on, whatever policy the adapter was
saved with: "prefill" (prompt tokens only; a saved first_k / last_k prompt window is kept) or "all"
(`preft_jax.adapters.policy.serving_policy`); an activated (aLoRA) adapter keeps its own policy in
both modes. Its invocation sequence is stored in its adapter slot: `max_invocation_tokens` (default
16) is the longest one the bank holds; a longer one fails to load with an error saying so.
"""
from __future__ import annotations

import concurrent.futures
import os
from typing import Sequence

import jax.numpy as jnp

from preft_jax.adapters.bank import AdapterBank
from preft_jax.adapters.config import LORA_TARGETS, LoraWeights, ReftWeights
from preft_jax.adapters.policy import PositionPolicy, with_serving_policy
from preft_jax.config import ModelConfig
from serve.adapter_catalog import (MODES, AdapterCatalog, AdapterRef, HostEntry, TierStats, check_adapter_name,
                                   check_mode, check_weights, folder_signature, weights_digest)
from serve.adapter_slots import AdapterSlots, NoDeviceSlot

__all__ = ["AdapterRegistry", "AdapterRef", "HostEntry", "NoDeviceSlot", "TierStats", "MODES",
           "check_adapter_name", "check_weights", "folder_signature", "weights_digest", "with_policy"]


DEFAULT_MAX_INVOCATION_TOKENS = 16      # the longest aLoRA invocation sequence an adapter slot holds


def with_policy(weights: LoraWeights | ReftWeights, mode: str) -> LoraWeights | ReftWeights:
    """`weights` with the position policy a registry of `mode` serves it with (`policy.serving_policy`)."""
    return with_serving_policy(weights, mode)


class AdapterRegistry:
    def __init__(self, cfg: ModelConfig, capacity: int, lora_targets: Sequence[str] = LORA_TARGETS,
                 lora_rank: int = 16, reft_rank: int = 8, mode: str = "prefill", dtype=None,
                 adapter_dir: str | os.PathLike | None = None, host_cache_bytes: int = 1 << 30,
                 loader_threads: int = 2, max_registered: int | None = None,
                 max_invocation_tokens: int = DEFAULT_MAX_INVOCATION_TOKENS, *, _slots: AdapterSlots | None = None):
        check_mode(mode)
        self.cfg, self.stats, self._static_names = cfg, TierStats(), []
        self.slots = _slots or AdapterSlots.empty(cfg, capacity, lora_targets, lora_rank, reft_rank,
                                                  dtype or jnp.float32, max_invocation_tokens=max_invocation_tokens)
        self.slots.stats = self.stats
        self.catalog = AdapterCatalog(cfg, None if self.slots.bank is None else self.slots.update_for, mode, adapter_dir,
                                      host_cache_bytes, loader_threads, max_registered, self.stats)

    @classmethod
    def from_bank(cls, cfg: ModelConfig, bank: AdapterBank, names: Sequence[str],
                  mode: str = "prefill") -> "AdapterRegistry":
        """Registers a prebuilt bank (e.g. from `build_bank`): names[i] -> slot i + 1, always resident.

        The bank's per-slot policies are used as they are (the caller built them for `mode`)."""
        if len(names) > bank.n_slots - 1:
            raise ValueError(f"{len(names)} names for {bank.n_slots - 1} adapter slots")
        reg = cls(cfg, capacity=0, mode=mode, _slots=AdapterSlots(bank))
        reg._static_names = list(names)
        reg._register_static()
        return reg

    def _register_static(self) -> None:
        bank = self.slots.bank
        kind = "lora" if bank.lora_A else "reft"
        for slot, name in enumerate(self._static_names, start=1):
            policy = bank.policy.slot_policy(slot)
            entry = self.catalog.add_static(name, kind, slot, policy)
            self.slots.mark_static(slot, (name, entry.digest))

    # ---- attributes the engine, the server and the benchmarks read ------------------------------
    @property
    def bank(self) -> AdapterBank | None:
        return self.slots.bank

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def mode(self) -> str:
        return self.catalog.mode

    @property
    def adapter_dir(self) -> str | None:
        return self.catalog.adapter_dir

    def set_mode(self, mode: str) -> None:
        """Switches every adapter to `mode` (the engine sets its registry's mode at construction).
        Cached versions are dropped (they carry the old policy) and reload on next use."""
        with self.catalog.lock:
            if not self.catalog.set_mode(mode):
                return
            self.slots.set_mode(mode)
            if self._static_names:
                self._register_static()            # the prebuilt bank's switched policies

    # ---- the catalog -------------------------------------------------------------------------
    def load(self, name: str, adapter: LoraWeights | ReftWeights | str | os.PathLike, root: str | None = None) -> str:
        """Registers `name` (a folder or weights) and loads it into the host tier now, so a bad
        adapter fails here. Returns its kind ("lora" | "reft"). `root`: every file of the folder must
        resolve inside it (serve/access.py). Raises AdapterExistsError, AdapterDirError,
        AdapterInUseError (still draining), AdapterCapacityError or AdapterLoadError."""
        return self.catalog.load(name, adapter, root)

    def check_loadable(self, name: str) -> None:
        """Raises what `load(name, ...)` would for the name alone (exists, draining, --adapter-dir, capacity)."""
        self.catalog.check_loadable(name)

    def unload(self, name: str, drain: bool = False) -> str:
        """Forgets a registered adapter: "unloaded", or with `drain` while requests hold it,
        "draining" (unknown to new requests; unloaded when the last one ends). Raises
        UnknownAdapterError, AdapterDirError, or AdapterInUseError while in use without `drain`."""
        with self.catalog.lock:
            state = self.catalog.unload(name, drain)
            if state == "unloaded":
                self.slots.forget(name)
            return state

    def draining(self) -> dict[str, int]:
        """Adapters draining: name -> requests still holding them."""
        return self.catalog.draining()

    def __contains__(self, name) -> bool:
        return name in self.catalog

    def names(self) -> dict[str, str]:
        """Registered adapters and adapters in the host tier: name -> "lora" | "reft"."""
        return self.catalog.names()

    def policies(self) -> dict[str, PositionPolicy | None]:
        """The position policy each adapter of `names()` is served with (None: not loaded now)."""
        return self.catalog.policies()

    def prepare(self, name: str) -> concurrent.futures.Future:
        """A future of the current host entry of `name` (loading it in the background if needed)."""
        return self.catalog.prepare(name)

    def acquire(self, name: str | None) -> AdapterRef | None:
        """A reference on `name` for a request (None: the base model). Raises UnknownAdapterError."""
        return self.catalog.acquire(name)

    def release(self, ref: AdapterRef | None) -> None:
        """Drops a request's reference (its device pin is the scheduler's: released before this)."""
        if ref is None:
            return
        if self.catalog.release(ref):              # the last request of a draining adapter: unloaded
            self.slots.forget(ref.name)

    def in_use(self, name: str) -> int:
        return self.catalog.in_use(name)

    def resolve(self, ref: AdapterRef) -> HostEntry | None:
        """The host entry the request will use (fixed at first success); None while loading.
        Raises the load error when the adapter cannot be loaded."""
        return self.catalog.resolve(ref)

    def identity(self, ref: AdapterRef | None) -> bytes | None:
        return None if ref is None or ref.entry is None else ref.entry.name.encode() + b"\0" + ref.entry.digest

    def policy(self, ref: AdapterRef | None) -> PositionPolicy | None:
        """The serving position policy of the version `ref` resolved to (None: base model)."""
        if ref is None:
            return None
        if ref.entry is None:
            raise RuntimeError(f"adapter {ref.name!r} is not resolved yet")
        return ref.entry.policy

    # ---- adapter slots -----------------------------------------------------------------------
    def place(self, shardings) -> None:
        """Places the device bank by `shardings` (preft_jax.sharding.bank_shardings); later slot
        writes keep them."""
        self.slots.place(shardings)

    def pin(self, ref: AdapterRef) -> int:
        """An adapter slot holding `ref`'s weights, pinned until `unpin`. Engine thread only.
        Raises NoDeviceSlot."""
        return self.slots.pin(ref)

    def unpin(self, ref: AdapterRef) -> None:
        self.slots.unpin(ref)

    def device_free_slots(self) -> int:
        return self.slots.free_slots()

    def resident(self, ref: AdapterRef) -> bool:
        return self.slots.resident(ref)

    def occupancy(self) -> dict:
        return {**self.slots.occupancy(), **self.catalog.occupancy()}

    def close(self):
        self.catalog.close()
