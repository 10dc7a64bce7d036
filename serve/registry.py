"""Adapter registry: names -> fixed bank slots, loaded at start or at run time, reference counted.

The bank's structure (capacity, LoRA targets and rank, ReFT rank) is fixed at construction so that
loading an adapter never recompiles the serving steps. A slot is reused only after its adapter is
unloaded, and unloading is refused while requests still use it (each submitted request holds a
reference on its adapter's slot until it finishes), so in-flight requests never see a slot change.

The registry's `mode` decides which tokens every adapter acts on, whatever policy the adapter was
saved with: "prefill" (PreFT: prompt tokens only; an adapter's first_k / last_k prompt window is
kept) or "all" (the all-token baseline: prompt and generated tokens).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
from typing import Sequence

import numpy as np

from preft_jax.adapters.bank import AdapterBank, empty_bank, set_slot
from preft_jax.adapters.config import LORA_TARGETS, LoraWeights, PositionPolicy, ReftWeights
from preft_jax.adapters.reft_io import load_adapter
from preft_jax.config import ModelConfig
from serve.errors import (AdapterCapacityError, AdapterExistsError, AdapterInUseError, AdapterLoadError,
                          RequestError, UnknownAdapterError)

MODES = ("prefill", "all")
NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
log = logging.getLogger("serve.registry")


def check_adapter_name(name) -> str:
    """Adapter names are 1-64 characters of [A-Za-z0-9._-] (they appear in URLs and metrics)."""
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


def serving_policy(policy: PositionPolicy, mode: str) -> PositionPolicy:
    """The position policy an adapter gets in a registry of `mode`."""
    if mode == "all":
        return PositionPolicy(mode="all")
    return policy if policy.mode == "prefill" else PositionPolicy()


def with_policy(weights: LoraWeights | ReftWeights, mode: str) -> LoraWeights | ReftWeights:
    policy = serving_policy(weights.config.policy, mode)
    if policy == weights.config.policy:
        return weights
    return dataclasses.replace(weights, config=dataclasses.replace(weights.config, policy=policy))


class AdapterRegistry:
    def __init__(self, cfg: ModelConfig, capacity: int, lora_targets: Sequence[str] = LORA_TARGETS,
                 lora_rank: int = 16, reft_rank: int = 8, mode: str = "prefill", dtype=None):
        import jax.numpy as jnp
        if mode not in MODES:
            raise ValueError(f"registry mode must be one of {MODES}, got {mode!r}")
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.cfg = cfg
        self.mode = mode
        self.capacity = capacity
        self._lock = threading.Lock()
        self._slots: dict[str, int] = {}
        self._kinds: dict[str, str] = {}
        self._refs = [0] * (capacity + 1)
        self.bank: AdapterBank | None = None
        if capacity:
            self.bank = empty_bank(cfg, capacity + 1, tuple(lora_targets), lora_rank, reft_rank,
                                   dtype or jnp.float32)

    @classmethod
    def from_bank(cls, cfg: ModelConfig, bank: AdapterBank, names: Sequence[str],
                  mode: str = "prefill") -> "AdapterRegistry":
        """Registers a prebuilt bank (e.g. from `build_bank`): names[i] -> slot i + 1.

        The bank's per-slot policies are used as they are (the caller built them for `mode`)."""
        if len(names) > bank.n_slots - 1:
            raise ValueError(f"{len(names)} names for {bank.n_slots - 1} adapter slots")
        reg = cls(cfg, capacity=0, mode=mode)
        reg.capacity, reg.bank = bank.n_slots - 1, bank
        reg._refs = [0] * bank.n_slots
        for slot, name in enumerate(names, start=1):
            reg._slots[name] = slot
            reg._kinds[name] = "lora" if bank.lora_A else "reft"
        return reg

    def set_mode(self, mode: str) -> None:
        """Switches every loaded adapter to `mode` (the engine sets its registry's mode at construction).

        "all" makes every slot all-token; "prefill" makes every slot prompt-only (a first_k / last_k
        window saved with an adapter survives only if the registry was built in "prefill" mode)."""
        if mode not in MODES:
            raise ValueError(f"registry mode must be one of {MODES}, got {mode!r}")
        import jax.numpy as jnp
        import numpy as np
        with self._lock:
            if mode == self.mode:
                return
            self.mode = mode
            if self.bank is None:
                return
            n = self.bank.n_slots
            at = np.full(n, mode == "all")
            at[0] = False
            fk, lk = np.asarray(self.bank.first_k), np.asarray(self.bank.last_k)
            if mode == "all":
                fk, lk = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
            self.bank = dataclasses.replace(self.bank, all_tokens=jnp.asarray(at), first_k=jnp.asarray(fk),
                                            last_k=jnp.asarray(lk))

    # ---- loading ---------------------------------------------------------------------------
    def load(self, name: str, adapter: LoraWeights | ReftWeights | str | os.PathLike) -> int:
        """Loads weights (or an adapter folder) under `name`; returns its slot.

        Raises AdapterExistsError (name taken), AdapterCapacityError (no free slot), AdapterLoadError
        (bad folder, or the adapter does not fit the bank's targets / ranks)."""
        check_adapter_name(name)
        with self._lock:                       # cheap checks first: no file reading for a taken name
            self._check_loadable_locked(name)
        where = os.fspath(adapter) if isinstance(adapter, (str, os.PathLike)) else None
        try:
            if where is not None:
                weights = load_adapter(adapter, self.cfg)
            elif isinstance(adapter, (LoraWeights, ReftWeights)):
                weights = adapter
            else:
                raise TypeError(f"expected LoraWeights, ReftWeights or a folder path, got {type(adapter).__name__}")
            check_weights(weights, self.cfg)
        except (OSError, ValueError, TypeError) as e:
            raise AdapterLoadError(f"cannot load adapter {name!r}" + (f" from {where!r}" if where else "")
                                   + f": {e}") from e
        except Exception as e:  # noqa: BLE001 - any loader failure is the adapter's problem, never a 500
            log.exception("unexpected error loading adapter %r from %r", name, where)
            raise AdapterLoadError(f"cannot load adapter {name!r}: not a valid adapter") from e
        weights = with_policy(weights, self.mode)
        with self._lock:
            self._check_loadable_locked(name)
            used = set(self._slots.values())
            slot = next(s for s in range(1, self.capacity + 1) if s not in used)
            try:
                self.bank = set_slot(self.bank, slot, weights)
            except (ValueError, TypeError) as e:
                raise AdapterLoadError(f"adapter {name!r} does not fit this server's adapter bank: {e}") from e
            self._slots[name] = slot
            self._kinds[name] = "lora" if isinstance(weights, LoraWeights) else "reft"
            return slot

    def _check_loadable_locked(self, name: str):
        if name in self._slots:
            raise AdapterExistsError(f"adapter {name!r} is already loaded; unload it first")
        if self.bank is None:
            raise AdapterCapacityError("this engine was started without adapter slots (capacity 0)")
        if len(self._slots) >= self.capacity:
            raise AdapterCapacityError(f"all {self.capacity} adapter slots are in use; unload one first")

    def unload(self, name: str) -> None:
        """Clears the adapter's slot. Raises UnknownAdapterError, or AdapterInUseError while in use."""
        with self._lock:
            slot = self._slot_locked(name)
            if self._refs[slot]:
                raise AdapterInUseError(f"adapter {name!r} is used by {self._refs[slot]} running or queued "
                                        f"request(s); retry when they finish")
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

    def in_use(self, name: str) -> int:
        with self._lock:
            return self._refs[self._slot_locked(name)]

    def __contains__(self, name) -> bool:
        with self._lock:
            return name in self._slots

    def names(self) -> dict[str, str]:
        """Loaded adapters: name -> "lora" | "reft"."""
        with self._lock:
            return dict(self._kinds)
