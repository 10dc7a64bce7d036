"""Random weights for the tiny demo/test model (`--model tiny`), deterministic from a seed.

Scaled so that greedy decoding is not degenerate (no constant token) on random prompts.
"""
from __future__ import annotations

import numpy as np

from preft_jax.config import ModelConfig


def tiny_params(cfg: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    L, d, f = cfg.n_layers, cfg.d_model, cfg.ffn_dim
    dims = cfg.projection_dims()

    def dense(shape, fan_in):
        return (rng.standard_normal(shape) * fan_in ** -0.5).astype(np.float32)

    params = {"embed": (rng.standard_normal((cfg.vocab_size, d)) * 0.5).astype(np.float32),
              "final_norm": np.ones(d, np.float32), "attn_norm": np.ones((L, d), np.float32),
              "mlp_norm": np.ones((L, d), np.float32)}
    for name, target in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"), ("w_gate", "gate"), ("w_up", "up"),
                         ("w_down", "down")):
        d_in, d_out = dims[target]
        params[name] = dense((L, d_in, d_out), d_in)
    if not cfg.tie_embeddings:
        params["lm_head"] = dense((d, cfg.vocab_size), d)
    return params
