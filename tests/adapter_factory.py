"""Random non-zero adapters for tests."""
from __future__ import annotations

import numpy as np

from preft_jax.adapters.config import LoraConfig, LoraWeights, PositionPolicy, ReftConfig, ReftWeights


def random_lora(cfg, seed, rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
                layers=None, policy=PositionPolicy(), scale=0.3):
    rng = np.random.default_rng(seed)
    conf = LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets), layers=layers, policy=policy)
    dims = cfg.projection_dims()
    keep = np.zeros(cfg.n_layers, np.float32)
    keep[list(range(cfg.n_layers) if layers is None else layers)] = 1
    A = {t: (scale * rng.standard_normal((cfg.n_layers, dims[t][0], rank)) * keep[:, None, None]).astype(np.float32)
         for t in targets}
    B = {t: (scale * rng.standard_normal((cfg.n_layers, rank, dims[t][1])) * keep[:, None, None]).astype(np.float32)
         for t in targets}
    return LoraWeights(conf, A, B)


def random_reft(cfg, seed, rank=4, layers=(0, 2), kind="loreft", policy=PositionPolicy(), scale=0.5):
    rng = np.random.default_rng(seed)
    conf = ReftConfig(rank=rank, layers=tuple(layers), kind=kind, policy=policy)
    R = np.zeros((cfg.n_layers, rank, cfg.d_model), np.float32)
    W = np.zeros_like(R)
    b = np.zeros((cfg.n_layers, rank), np.float32)
    for layer in layers:
        q, _ = np.linalg.qr(rng.standard_normal((cfg.d_model, rank)))
        R[layer] = q.T if kind == "loreft" else scale * rng.standard_normal((rank, cfg.d_model))
        W[layer] = scale * rng.standard_normal((rank, cfg.d_model))
        b[layer] = scale * rng.standard_normal(rank)
    return ReftWeights(conf, R, W, b)
