"""Device adapter slots: the adapter bank on the device and which adapter each of its slots holds.

`capacity` adapter slots (slot 0 of the bank is the base model and holds none). PreFT's decode never
reads the adapter, so a request needs its adapter in an adapter slot only while its prompt is
prefilled: the scheduler (serve/scheduler.py, the one owner of pins) pins a slot for a request when
its prefill starts and unpins it when the prefill ends (mode "prefill"), or when the request ends
(mode "all", the all-token baseline).
Unpinned slots keep their weights (a later request for the same version is a device hit) until
evicted least-recently-used. Slot contents are written by the bank's one slot writer
(`preft_jax.adapters.bank.write_slot`, a jitted donated update), from the host arrays the catalog
built when it loaded the adapter (`HostEntry.update`).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import jax

from preft_jax.adapters.bank import AdapterBank, BankLayout, empty_bank, slot_update, slot_writer, write_slot
from preft_jax.adapters.config import LoraWeights, ReftWeights
from preft_jax.adapters.policy import serving_table
from preft_jax.config import ModelConfig
from serve.adapter_catalog import AdapterRef, TierStats


class NoDeviceSlot(RuntimeError):
    """Every adapter slot is pinned by a running prefill (the request waits for the next step)."""


@dataclasses.dataclass
class _Slot:
    key: tuple | None = None                    # (name, digest) of the weights in this slot
    pins: int = 0
    last_used: int = 0
    static: bool = False                        # prebuilt bank (from_bank): never evicted


class AdapterSlots:
    """`bank` (None: no adapter slots) with per-slot pin counts and LRU. `pin` and `place` replace
    `self.bank` and run on the engine thread."""

    def __init__(self, bank: AdapterBank | None, stats: TierStats | None = None):
        self.bank = bank
        self.stats = stats or TierStats()
        self.capacity = 0 if bank is None else bank.n_slots - 1
        self.layout = None if bank is None else BankLayout.of(bank)
        self._lock = threading.Lock()
        self._slots = [_Slot() for _ in range(self.capacity + 1)]       # index 0 unused (base)
        self._where: dict[tuple, int] = {}                             # key -> the slot holding it
        self._tick = 0
        self._shardings = None                                         # set by `place` (a sharded engine)
        self._writer = slot_writer()

    @classmethod
    def empty(cls, cfg: ModelConfig, capacity: int, lora_targets: Sequence[str], lora_rank: int, reft_rank: int,
              dtype, stats: TierStats | None = None, max_invocation_tokens: int = 0) -> "AdapterSlots":
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        if max_invocation_tokens < 0:
            raise ValueError(f"max_invocation_tokens must be >= 0, got {max_invocation_tokens}")
        for name, rank in (("lora_rank", lora_rank), ("reft_rank", reft_rank)):
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise ValueError(f"{name} (the largest rank a device slot holds; the server's "
                                 f"--{name.replace('_', '-')}) must be an integer >= 1, got {rank!r}")
        bank = empty_bank(cfg, capacity + 1, tuple(lora_targets), lora_rank, reft_rank, dtype,
                          max_invocation_tokens) if capacity else None
        return cls(bank, stats)

    def update_for(self, weights: LoraWeights | ReftWeights) -> dict:
        """The host arrays of one adapter slot holding `weights` (ValueError when they do not fit)."""
        return slot_update(self.layout, weights)

    def mark_static(self, slot: int, key: tuple) -> None:
        """Slot `slot` of a prebuilt bank holds `key` for good (never evicted)."""
        with self._lock:
            self._set_key(slot, None)
            self._slots[slot] = _Slot(static=True)
            self._set_key(slot, key)

    def set_mode(self, mode: str) -> None:
        """A prebuilt bank switches its per-slot policy arrays; other slots are emptied (their
        versions carry the old policy and are rewritten on the next pin)."""
        with self._lock:
            if self.bank is None:
                return
            if any(s.static for s in self._slots[1:]):
                self._set_bank(dataclasses.replace(self.bank, policy=serving_table(self.bank.policy, mode)))
                return
            for i in range(1, len(self._slots)):
                self._set_key(i, None)

    def forget(self, name: str) -> None:
        """Unpinned slots holding any version of `name` are emptied (an unloaded adapter)."""
        with self._lock:
            for i, s in enumerate(self._slots):
                if i and s.key is not None and s.key[0] == name and not s.pins and not s.static:
                    self._set_key(i, None)

    def place(self, shardings) -> None:
        """Places the bank by `shardings` (a NamedSharding tree of the bank, from
        `preft_jax.sharding.bank_shardings`); every later slot write keeps them (explicit out_shardings)."""
        with self._lock:
            if self.bank is None:
                return
            self._shardings = shardings
            self.bank = jax.device_put(self.bank, shardings)
            self._writer = slot_writer(shardings)

    def _set_key(self, slot: int, key: tuple | None) -> None:
        """Slot `slot` holds `key` (None: nothing); the one writer of `_Slot.key` and its index. Lock held."""
        old = self._slots[slot].key
        if old is not None and self._where.get(old) == slot:
            del self._where[old]
        self._slots[slot].key = key
        if key is not None:
            self._where[key] = slot

    def _set_bank(self, bank: AdapterBank) -> None:
        self.bank = bank if self._shardings is None else jax.device_put(bank, self._shardings)

    def pin(self, ref: AdapterRef) -> int:
        """An adapter slot holding `ref`'s weights, pinned until `unpin` (uploads into the LRU unpinned
        slot when not resident). Engine thread only: it replaces `self.bank`. Raises NoDeviceSlot."""
        if ref.slot:
            return ref.slot
        entry = ref.entry
        if entry is None:
            raise RuntimeError(f"adapter {ref.name!r} is not resolved yet")
        key = (entry.name, entry.digest)
        with self._lock:
            self._tick += 1
            slot = self._where.get(key)
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
                self._set_key(slot, None)
                self.bank = write_slot(self.bank, slot, entry.update, self._writer)
                self._set_key(slot, key)
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

    def free_slots(self) -> int:
        with self._lock:
            return sum(1 for i, s in enumerate(self._slots) if i and not s.pins and not s.static)

    def resident(self, ref: AdapterRef) -> bool:
        e = ref.entry
        with self._lock:
            return e is not None and (e.name, e.digest) in self._where

    def occupancy(self) -> dict:
        with self._lock:
            return {"device_slots": self.capacity, "device_pinned": sum(s.pins > 0 for s in self._slots[1:]),
                    "device_resident": sum(s.key is not None for s in self._slots[1:])}
