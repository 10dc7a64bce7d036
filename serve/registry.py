"""Adapter registry: names -> fixed bank slots, loaded at start or at run time, reference counted.

The bank's structure (capacity, LoRA targets and rank, ReFT rank) is fixed at construction so that
loading an adapter never recompiles the serving steps. A slot is reused only after its adapter is
unloaded, and unloading is refused while requests still use it.
"""
from __future__ import annotations

import threading
from typing import Sequence

from preft_jax.adapters.bank import AdapterBank, empty_bank, set_slot
from preft_jax.adapters.config import LORA_TARGETS, LoraWeights, ReftWeights
from preft_jax.adapters.reft_io import load_adapter
from preft_jax.config import ModelConfig
from serve.errors import AdapterInUseError, RequestError, UnknownAdapterError


class AdapterRegistry:
    def __init__(self, cfg: ModelConfig, capacity: int, lora_targets: Sequence[str] = LORA_TARGETS,
                 lora_rank: int = 16, reft_rank: int = 8, dtype=None):
        import jax.numpy as jnp
        self.cfg = cfg
        self.capacity = capacity
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}
        self._refs = [0] * (capacity + 1)
        self._kinds: dict[str, str] = {}
        self.bank: AdapterBank | None = None
        if capacity:
            self.bank = empty_bank(cfg, capacity + 1, tuple(lora_targets), lora_rank, reft_rank,
                                   dtype or jnp.float32)

    @classmethod
    def from_bank(cls, cfg: ModelConfig, bank: AdapterBank, names: Sequence[str]) -> "AdapterRegistry":
        """Registers a prebuilt bank (e.g. from `build_bank`): names[i] -> slot i + 1."""
        if len(names) > bank.n_slots - 1:
            raise ValueError(f"{len(names)} names for {bank.n_slots - 1} adapter slots")
        reg = cls(cfg, capacity=0)
        reg.capacity, reg.bank = bank.n_slots - 1, bank
        reg._refs = [0] * bank.n_slots
        for slot, name in enumerate(names, start=1):
            reg._slots[name] = slot
            reg._kinds[name] = "lora" if bank.lora_A else "reft"
        return reg

    # ---- loading ---------------------------------------------------------------------------
    def load(self, name: str, adapter: LoraWeights | ReftWeights | str) -> int:
        """Loads weights (or a folder) under `name`; returns its slot. Replacing a name is refused."""
        if not name or not isinstance(name, str):
            raise RequestError("adapter name must be a non-empty string")
        weights = load_adapter(adapter, self.cfg) if isinstance(adapter, str) else adapter
        with self._lock:
            if name in self._slots:
                raise RequestError(f"adapter {name!r} is already loaded; unload it first")
            if self.bank is None:
                raise RequestError("this server was started without adapter slots (capacity 0)")
            used = set(self._slots.values())
            free = [s for s in range(1, self.capacity + 1) if s not in used]
            if not free:
                raise RequestError(f"all {self.capacity} adapter slots are in use")
            slot = free[0]
            self.bank = set_slot(self.bank, slot, weights)     # raises ValueError on mismatch
            self._slots[name] = slot
            self._kinds[name] = "lora" if isinstance(weights, LoraWeights) else "reft"
            return slot

    def unload(self, name: str) -> None:
        with self._lock:
            slot = self._slot_locked(name)
            if self._refs[slot]:
                raise AdapterInUseError(f"adapter {name!r} is used by {self._refs[slot]} running request(s)")
            self.bank = set_slot(self.bank, slot, None)
            del self._slots[name], self._kinds[name]

    # ---- lookup and use --------------------------------------------------------------------
    def _slot_locked(self, name: str) -> int:
        if name not in self._slots:
            known = ", ".join(sorted(self._slots)) or "none"
            raise UnknownAdapterError(f"unknown adapter {name!r} (loaded adapters: {known})")
        return self._slots[name]

    def acquire(self, name: str | None) -> int:
        """Slot for a request (0 = base) with a reference held until `release`."""
        if name is None:
            return 0
        with self._lock:
            slot = self._slot_locked(name)
            self._refs[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        if slot:
            with self._lock:
                self._refs[slot] -= 1

    def names(self) -> dict[str, str]:
        with self._lock:
            return dict(self._kinds)
