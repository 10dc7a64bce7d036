"""Multi-adapter bank: N adapter slots stacked per layer, slot 0 = the base model (all zeros).

A bank is a pytree of jax arrays, passed as an argument to the jitted steps. Its *structure*
(which LoRA targets exist, whether a ReFT part exists, capacity and ranks) is static; the slot
contents can change at run time without recompiling (see `set_slot`).

    lora_A[target]: [n_layers, n_slots, d_in, r]     lora_B[target]: [n_layers, n_slots, r, d_out]
        (B has the adapter's alpha/r scale folded in; smaller ranks are zero-padded to r)
    reft_R, reft_W: [n_layers, n_slots, r, d_model]   reft_b: [n_layers, n_slots, r]
    reft_subtract:  [n_slots] (1.0 LoReFT, 0.0 DiReFT)
    policy: PolicyTable            each slot's position policy (`preft_jax.adapters.policy` encodes and
                                   decodes it; nothing else reads it)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters.config import LoraWeights, ReftWeights
from preft_jax.adapters.policy import PolicyTable, PositionPolicy, slot_entry
from preft_jax.config import PROJECTION_AXES, ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdapterBank:
    lora_A: dict
    lora_B: dict
    reft_R: jax.Array | None
    reft_W: jax.Array | None
    reft_b: jax.Array | None
    reft_subtract: jax.Array | None
    policy: PolicyTable

    @property
    def n_slots(self) -> int:
        return self.policy.n_slots

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return tuple(sorted(self.lora_A))

    @property
    def has_reft(self) -> bool:
        return self.reft_R is not None

    def logical_axes(self) -> "AdapterBank":
        """The logical axes of every array (preft_jax.sharding): LoRA A / B follow the input / output
        dimension of their projection; slots ("adapters") and ranks are replicated."""
        def opt(x, axes):
            return None if x is None else axes
        return AdapterBank(
            {t: ("layers", "adapters", PROJECTION_AXES[t][0], "rank") for t in self.lora_A},
            {t: ("layers", "adapters", "rank", PROJECTION_AXES[t][1]) for t in self.lora_B},
            opt(self.reft_R, ("layers", "adapters", "rank", "embed")),
            opt(self.reft_W, ("layers", "adapters", "rank", "embed")),
            opt(self.reft_b, ("layers", "adapters", "rank")),
            opt(self.reft_subtract, ("adapters",)), policy=self.policy.logical_axes())

    def layer(self, i):
        """The per-layer slice used inside the layer scan (everything with a layer axis)."""
        return LayerAdapters(
            lora_A={t: a[i] for t, a in self.lora_A.items()},
            lora_B={t: b[i] for t, b in self.lora_B.items()},
            reft_R=None if self.reft_R is None else self.reft_R[i],
            reft_W=None if self.reft_W is None else self.reft_W[i],
            reft_b=None if self.reft_b is None else self.reft_b[i],
        )

    def per_layer(self):
        """Layer-stacked arrays as a pytree with leading axis n_layers (the scan's xs)."""
        return LayerAdapters(lora_A=self.lora_A, lora_B=self.lora_B, reft_R=self.reft_R,
                             reft_W=self.reft_W, reft_b=self.reft_b)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerAdapters:
    lora_A: dict
    lora_B: dict
    reft_R: jax.Array | None
    reft_W: jax.Array | None
    reft_b: jax.Array | None


def empty_bank(cfg: ModelConfig, n_slots: int, lora_targets: Sequence[str] = (), lora_rank: int = 0,
               reft_rank: int = 0, dtype=jnp.float32, max_invocation_tokens: int = 0) -> AdapterBank:
    """A bank of `n_slots` slots (slot 0 = base), all zero, every slot in prefill mode; activated
    adapters written into it later may have invocation sequences of up to `max_invocation_tokens`."""
    if n_slots < 1:
        raise ValueError("a bank needs at least the base slot")
    dims = cfg.projection_dims()
    L = cfg.n_layers
    lora_A = {t: jnp.zeros((L, n_slots, dims[t][0], lora_rank), dtype) for t in lora_targets}
    lora_B = {t: jnp.zeros((L, n_slots, lora_rank, dims[t][1]), dtype) for t in lora_targets}
    reft = [None] * 4
    if reft_rank:
        reft = [jnp.zeros((L, n_slots, reft_rank, cfg.d_model), dtype),
                jnp.zeros((L, n_slots, reft_rank, cfg.d_model), dtype),
                jnp.zeros((L, n_slots, reft_rank), dtype), jnp.zeros((n_slots,), dtype)]
    return AdapterBank(lora_A, lora_B, *reft,
                       policy=PolicyTable.encode([PositionPolicy()] * n_slots, max_invocation_tokens))


def _pad_to(x: np.ndarray, axis: int, size: int, what: str) -> np.ndarray:
    if x.shape[axis] > size:
        raise ValueError(f"{what}: rank {x.shape[axis]} exceeds the bank's rank {size}")
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return np.pad(x, pad)


def set_slot(bank: AdapterBank, slot: int, weights: LoraWeights | ReftWeights | None) -> AdapterBank:
    """Returns a bank with `slot` holding `weights` (None clears the slot to base)."""
    if not 0 < slot < bank.n_slots:
        raise ValueError(f"slot {slot} out of range 1..{bank.n_slots - 1} (slot 0 is the base model)")
    lora_A, lora_B = dict(bank.lora_A), dict(bank.lora_B)
    for t in lora_A:
        lora_A[t] = lora_A[t].at[:, slot].set(0)
        lora_B[t] = lora_B[t].at[:, slot].set(0)
    R, W, b, sub = bank.reft_R, bank.reft_W, bank.reft_b, bank.reft_subtract
    if R is not None:
        R, W, b, sub = R.at[:, slot].set(0), W.at[:, slot].set(0), b.at[:, slot].set(0), sub.at[slot].set(0)
    policy = PositionPolicy()
    if isinstance(weights, LoraWeights):
        policy = weights.config.policy
        missing = set(weights.config.targets) - set(lora_A)
        if missing:
            raise ValueError(f"bank has no LoRA slots for targets {sorted(missing)}; "
                             f"bank targets are {sorted(lora_A)}")
        rank = next(iter(lora_A.values())).shape[-1]
        for t in weights.config.targets:
            a = _pad_to(np.asarray(weights.A[t], np.float32), -1, rank, f"LoRA {t}")
            bb = _pad_to(np.asarray(weights.B[t], np.float32) * weights.config.scale, -2, rank, f"LoRA {t}")
            lora_A[t] = lora_A[t].at[:, slot].set(jnp.asarray(a, lora_A[t].dtype))
            lora_B[t] = lora_B[t].at[:, slot].set(jnp.asarray(bb, lora_B[t].dtype))
    elif isinstance(weights, ReftWeights):
        policy = weights.config.policy
        if R is None:
            raise ValueError("bank was built without ReFT slots")
        rank = R.shape[-2]
        R = R.at[:, slot].set(jnp.asarray(_pad_to(np.asarray(weights.R), -2, rank, "ReFT R"), R.dtype))
        W = W.at[:, slot].set(jnp.asarray(_pad_to(np.asarray(weights.W), -2, rank, "ReFT W"), W.dtype))
        b = b.at[:, slot].set(jnp.asarray(_pad_to(np.asarray(weights.b), -1, rank, "ReFT b"), b.dtype))
        sub = sub.at[slot].set(1.0 if weights.config.kind == "loreft" else 0.0)
    elif weights is not None:
        raise TypeError(f"expected LoraWeights or ReftWeights, got {type(weights).__name__}")
    return AdapterBank(lora_A, lora_B, R, W, b, sub, policy=bank.policy.write(slot, slot_entry(policy, bank.policy)))


def build_bank(cfg: ModelConfig, adapters: Sequence[LoraWeights | ReftWeights], capacity: int | None = None,
               dtype=jnp.float32) -> AdapterBank:
    """Bank with adapters[i] in slot i + 1; `capacity` = number of adapter slots (default len(adapters)).

    Assembled in host memory and transferred once (set_slot per adapter would copy the bank N times).
    """
    capacity = len(adapters) if capacity is None else capacity
    if capacity < len(adapters):
        raise ValueError(f"capacity {capacity} < {len(adapters)} adapters")
    loras = [a for a in adapters if isinstance(a, LoraWeights)]
    refts = [a for a in adapters if isinstance(a, ReftWeights)]
    if len(loras) + len(refts) != len(adapters):
        raise TypeError("adapters must be LoraWeights or ReftWeights")
    targets = sorted({t for a in loras for t in a.config.targets})
    lora_rank = max((a.config.rank for a in loras), default=0)
    reft_rank = max((a.config.rank for a in refts), default=0)
    n, L, dims = capacity + 1, cfg.n_layers, cfg.projection_dims()
    A = {t: np.zeros((L, n, dims[t][0], lora_rank), np.float32) for t in targets}
    B = {t: np.zeros((L, n, lora_rank, dims[t][1]), np.float32) for t in targets}
    R = W = b = sub = None
    if refts:
        R = np.zeros((L, n, reft_rank, cfg.d_model), np.float32)
        W, b, sub = np.zeros_like(R), np.zeros((L, n, reft_rank), np.float32), np.zeros(n, np.float32)
    for slot, w in enumerate(adapters, start=1):
        if isinstance(w, LoraWeights):
            for t in w.config.targets:
                A[t][:, slot, :, :w.config.rank] = w.A[t]
                B[t][:, slot, :w.config.rank, :] = np.asarray(w.B[t], np.float32) * w.config.scale
        else:
            r = w.config.rank
            R[:, slot, :r], W[:, slot, :r], b[:, slot, :r] = w.R, w.W, w.b
            sub[slot] = 1.0 if w.config.kind == "loreft" else 0.0
    policy = PolicyTable.encode([PositionPolicy()] + [w.config.policy for w in adapters]
                                + [PositionPolicy()] * (capacity - len(adapters)))
    put = lambda x: None if x is None else jnp.asarray(x, dtype)
    return AdapterBank({t: put(x) for t, x in A.items()}, {t: put(x) for t, x in B.items()},
                       put(R), put(W), put(b), put(sub), policy=policy)
