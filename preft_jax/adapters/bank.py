"""Multi-adapter bank: N adapter slots stacked per layer, slot 0 = the base model (all zeros).

A bank is a pytree of jax arrays, passed as an argument to the jitted steps. Its *structure*
(which LoRA targets exist, whether a ReFT part exists, capacity and ranks) is static; the slot
contents can change at run time without recompiling.

Writing an adapter into a slot has one owner here: `slot_update` computes a slot's host arrays
(B x scale, rank padding, LoReFT/DiReFT subtract, the policy entry from `preft_jax.adapters.policy`),
`write_slot` writes them on the device (one jitted, donated update), `stack_slots` assembles a whole
bank from slot updates (`build_bank` on the host, training's differentiable 2-slot bank with jnp).

    lora_A[target]: [n_layers, n_slots, d_in, r]     lora_B[target]: [n_layers, n_slots, r, d_out]
        (B has the adapter's alpha/r scale folded in; smaller ranks are zero-padded to r)
    reft_R, reft_W: [n_layers, n_slots, r, d_model]   reft_b: [n_layers, n_slots, r]
    reft_subtract:  [n_slots] (1.0 LoReFT, 0.0 DiReFT)
    policy: PolicyTable            each slot's position policy (`preft_jax.adapters.policy` encodes and
                                   decodes it; nothing else reads it)
"""
from __future__ import annotations

import dataclasses
import functools
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


# ---- writing an adapter into a slot (the one owner) ------------------------------------------
@dataclasses.dataclass(frozen=True)
class BankLayout:
    """The per-slot array shapes of a bank: what `slot_update` pads an adapter to.

    lora: ((target, d_in, d_out), ...) in the bank's order; reft_rank 0 = no ReFT part;
    max_invocation_tokens: the longest activated (aLoRA) invocation sequence the policy table holds."""
    n_layers: int
    lora: tuple = ()
    lora_rank: int = 0
    reft_rank: int = 0
    d_model: int = 0
    max_invocation_tokens: int = 0

    @classmethod
    def of(cls, bank: AdapterBank) -> "BankLayout":
        lora = tuple((t, int(a.shape[2]), int(bank.lora_B[t].shape[3])) for t, a in bank.lora_A.items())
        A, R = next(iter(bank.lora_A.values()), None), bank.reft_R
        n_layers = next((int(x.shape[0]) for x in (A, R) if x is not None), 0)
        return cls(n_layers, lora, 0 if A is None else int(A.shape[-1]),
                   0 if R is None else int(R.shape[-2]), 0 if R is None else int(R.shape[-1]),
                   bank.policy.max_invocation_tokens)

    @classmethod
    def fitting(cls, cfg: ModelConfig, adapters: Sequence[LoraWeights | ReftWeights]) -> "BankLayout":
        """The smallest layout holding every adapter: the union of LoRA targets, the largest ranks."""
        loras = [a for a in adapters if isinstance(a, LoraWeights)]
        refts = [a for a in adapters if isinstance(a, ReftWeights)]
        if len(loras) + len(refts) != len(adapters):
            raise TypeError("adapters must be LoraWeights or ReftWeights")
        dims = cfg.projection_dims()
        targets = sorted({t for a in loras for t in a.config.targets})
        return cls(cfg.n_layers, tuple((t, *dims[t]) for t in targets),
                   max((a.config.rank for a in loras), default=0),
                   max((a.config.rank for a in refts), default=0), cfg.d_model,
                   max((len(a.config.policy.invocation_tokens or ()) for a in adapters), default=0))

    def check_fits(self, weights: LoraWeights | ReftWeights | None) -> None:
        """Raises ValueError (TypeError) naming why `weights` cannot go into a slot of this layout."""
        if weights is None:
            return
        if isinstance(weights, LoraWeights):
            targets = [t for t, _, _ in self.lora]
            missing = set(weights.config.targets) - set(targets)
            if missing:
                raise ValueError(f"the adapter bank has no LoRA slots for targets {sorted(missing)} "
                                 f"(bank targets: {sorted(targets)})")
            if weights.config.rank > self.lora_rank:
                raise ValueError(f"LoRA rank {weights.config.rank} exceeds the bank's rank {self.lora_rank}")
        elif isinstance(weights, ReftWeights):
            if not self.reft_rank:
                raise ValueError("the adapter bank was built without ReFT slots")
            if weights.config.rank > self.reft_rank:
                raise ValueError(f"ReFT rank {weights.config.rank} exceeds the bank's rank {self.reft_rank}")
        else:
            raise TypeError(f"expected LoraWeights or ReftWeights, got {type(weights).__name__}")


def _pad(x, axis: int, size: int, xp):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return xp.pad(x, pad) if size != x.shape[axis] else x


def slot_update(layout: BankLayout, weights: LoraWeights | ReftWeights | None, xp=np, dtype=np.float32) -> dict:
    """The arrays one bank slot holds for `weights` (None: the base model, all zeros):

        {"lora_A": {t: [L, d_in, r]}, "lora_B": {t: [L, r, d_out]},
         "reft_R", "reft_W": [L, r, d], "reft_b": [L, r], "reft_subtract": []   (ReFT layouts only),
         "policy": the slot's PolicyTable entry (`preft_jax.adapters.policy.slot_entry`)}

    LoRA B has the adapter's scale folded in, ranks are zero-padded to the layout's, a target the
    adapter lacks is zeros, `reft_subtract` is 1 for LoReFT and 0 for DiReFT; the policy entry
    encodes the adapter's `config.policy`. `xp=np` computes host arrays (cast to `dtype`) for
    `write_slot`; `xp=jnp` keeps the arrays traced (training differentiates through it)."""
    layout.check_fits(weights)
    L = layout.n_layers
    cast = lambda x: xp.asarray(x, dtype)
    lora = weights if isinstance(weights, LoraWeights) else None
    upd = {"lora_A": {}, "lora_B": {}}
    for t, d_in, d_out in layout.lora:
        if lora is not None and t in lora.config.targets:
            upd["lora_A"][t] = _pad(cast(lora.A[t]), -1, layout.lora_rank, xp)
            upd["lora_B"][t] = _pad(cast(lora.B[t]) * lora.config.scale, -2, layout.lora_rank, xp)
        else:
            upd["lora_A"][t] = xp.zeros((L, d_in, layout.lora_rank), dtype)
            upd["lora_B"][t] = xp.zeros((L, layout.lora_rank, d_out), dtype)
    if layout.reft_rank:
        r = layout.reft_rank
        if isinstance(weights, ReftWeights):
            upd["reft_R"] = _pad(cast(weights.R), -2, r, xp)
            upd["reft_W"] = _pad(cast(weights.W), -2, r, xp)
            upd["reft_b"] = _pad(cast(weights.b), -1, r, xp)
            sub = 1.0 if weights.config.kind == "loreft" else 0.0
        else:
            upd["reft_R"] = upd["reft_W"] = xp.zeros((L, r, layout.d_model), dtype)
            upd["reft_b"], sub = xp.zeros((L, r), dtype), 0.0
        upd["reft_subtract"] = xp.asarray(sub, dtype)
    upd["policy"] = slot_entry(PositionPolicy() if weights is None else weights.config.policy,
                               layout.max_invocation_tokens)
    return upd


def stack_slots(updates: Sequence[dict], xp=np, dtype=None) -> AdapterBank:
    """A bank whose slot i holds updates[i] (updates[0] is the base: `slot_update(layout, None)`).
    Host updates (xp=np) are stacked in host memory and transferred once, as `dtype`."""
    put = (lambda x: x) if xp is not np else (lambda x: jnp.asarray(x, dtype or x.dtype))
    stack = lambda xs, axis=1: put(xp.stack(list(xs), axis))
    first = updates[0]
    A = {t: stack(u["lora_A"][t] for u in updates) for t in first["lora_A"]}
    B = {t: stack(u["lora_B"][t] for u in updates) for t in first["lora_B"]}
    reft = [None] * 4
    if "reft_R" in first:
        reft = [stack(u[k] for u in updates) for k in ("reft_R", "reft_W", "reft_b")]
        reft.append(stack((u["reft_subtract"] for u in updates), 0))
    policy = jax.tree.map(lambda *xs: jnp.asarray(np.stack(xs)), *[u["policy"] for u in updates])
    return AdapterBank(A, B, *reft, policy=policy)


def _write(bank: AdapterBank, slot, upd: dict) -> AdapterBank:
    def put(x, v):
        return x.at[:, slot].set(jnp.asarray(v, x.dtype))
    R, W, b, sub = bank.reft_R, bank.reft_W, bank.reft_b, bank.reft_subtract
    if R is not None:
        R, W, b = put(R, upd["reft_R"]), put(W, upd["reft_W"]), put(b, upd["reft_b"])
        sub = sub.at[slot].set(jnp.asarray(upd["reft_subtract"], sub.dtype))
    return AdapterBank({t: put(a, upd["lora_A"][t]) for t, a in bank.lora_A.items()},
                       {t: put(x, upd["lora_B"][t]) for t, x in bank.lora_B.items()}, R, W, b, sub,
                       policy=bank.policy.write(slot, upd["policy"]))


@functools.lru_cache(maxsize=None)
def _plain_writer(donate: bool):
    return jax.jit(_write, donate_argnums=0 if donate else ())


def slot_writer(out_shardings=None, donate: bool = True):
    """The jitted device write of one slot update into a bank: `writer(bank, slot, update) -> bank`.
    With `donate` the old bank's buffers are reused (the caller must drop its reference); with
    `out_shardings` (a sharded bank's NamedSharding tree) the new bank keeps that placement."""
    if out_shardings is None:
        return _plain_writer(bool(donate))
    return jax.jit(_write, donate_argnums=0 if donate else (), out_shardings=out_shardings)


def write_slot(bank: AdapterBank, slot: int, update: dict, writer=None) -> AdapterBank:
    """`bank` with `slot` holding `update` (from `slot_update`), written on the device by `writer`
    (default: the donating `slot_writer()`, so `bank` must not be used afterwards)."""
    if not 0 < slot < bank.n_slots:
        raise ValueError(f"slot {slot} out of range 1..{bank.n_slots - 1} (slot 0 is the base model)")
    return (writer or slot_writer())(bank, np.int32(slot), update)     # a host scalar: no device op


def set_slot(bank: AdapterBank, slot: int, weights: LoraWeights | ReftWeights | None) -> AdapterBank:
    """Returns a bank with `slot` holding `weights` (None clears the slot to base); `bank` is kept."""
    return write_slot(bank, slot, slot_update(BankLayout.of(bank), weights), slot_writer(donate=False))


def build_bank(cfg: ModelConfig, adapters: Sequence[LoraWeights | ReftWeights], capacity: int | None = None,
               dtype=jnp.float32) -> AdapterBank:
    """Bank with adapters[i] in slot i + 1; `capacity` = number of adapter slots (default len(adapters)).

    Assembled in host memory and transferred once (set_slot per adapter would copy the bank N times).
    """
    capacity = len(adapters) if capacity is None else capacity
    if capacity < len(adapters):
        raise ValueError(f"capacity {capacity} < {len(adapters)} adapters")
    layout = BankLayout.fitting(cfg, adapters)
    empty = slot_update(layout, None)
    return stack_slots([empty] + [slot_update(layout, w) for w in adapters] + [empty] * (capacity - len(adapters)),
                       dtype=dtype)
