"""Preallocated KV cache: one buffer for all layers, indexed [layer, slot, position, kv_head, head_dim]."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from preft_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array   # [n_layers, n_slots, max_len, n_kv_heads, head_dim]
    v: jax.Array

    AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")     # logical axes (preft_jax.sharding)

    def logical_axes(self) -> "KVCache":
        return KVCache(self.AXES, self.AXES)

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @classmethod
    def create(cls, cfg: ModelConfig, n_slots: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        if max_len > cfg.max_seq_len:
            raise ValueError(f"cache length {max_len} exceeds the model's context length {cfg.max_seq_len}")
        shape = (cfg.n_layers, n_slots, max_len, cfg.n_kv_heads, cfg.head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
