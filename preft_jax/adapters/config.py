"""Adapter configurations (frozen) and the canonical in-memory adapter weights.

Canonical LoRA weights use the "x @ W" orientation and are stacked over *all* model layers:
    A[target]: [n_layers, d_in, rank], B[target]: [n_layers, rank, d_out]
Layers an adapter does not touch hold zeros. `alpha / rank` (or alpha / sqrt(rank) with rsLoRA) is
NOT folded into B here; `LoraConfig.scale` gives it.

Canonical ReFT weights are stacked over all layers too:
    R: [n_layers, rank, d_model], W: [n_layers, rank, d_model], b: [n_layers, rank]
Layers without an intervention hold R == 0 (which makes both DiReFT and LoReFT the identity).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from preft_jax.adapters.policy import PositionPolicy  # the policy lives in policy.py; kept importable here

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
REFT_KINDS = ("loreft", "direft")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...] = ("q", "v")
    layers: tuple[int, ...] | None = None   # None = every layer
    use_rslora: bool = False
    policy: PositionPolicy = PositionPolicy()

    def __post_init__(self):
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {LORA_TARGETS}, got {self.targets}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class ReftConfig:
    rank: int
    layers: tuple[int, ...]
    kind: str = "loreft"
    policy: PositionPolicy = PositionPolicy()

    def __post_init__(self):
        if self.kind not in REFT_KINDS:
            raise ValueError(f"ReFT kind must be one of {REFT_KINDS}, got {self.kind!r}")
        if self.rank <= 0 or not self.layers:
            raise ValueError("ReFT needs rank > 0 and at least one layer")


@dataclasses.dataclass
class LoraWeights:
    config: LoraConfig
    A: dict[str, np.ndarray]   # target -> [n_layers, d_in, rank]
    B: dict[str, np.ndarray]   # target -> [n_layers, rank, d_out]


@dataclasses.dataclass
class ReftWeights:
    config: ReftConfig
    R: np.ndarray   # [n_layers, rank, d_model]
    W: np.ndarray   # [n_layers, rank, d_model]
    b: np.ndarray   # [n_layers, rank]
