"""Per-row sampling: greedy (temperature 0), temperature, top-p, top-k. All arrays, jit-friendly."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 = off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _number(self.temperature, "temperature")
        _number(self.top_p, "top_p")
        _integer(self.top_k, "top_k")
        _integer(self.max_new_tokens, "max_new_tokens")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for t in self.stop_token_ids:
            _integer(t, "stop_token_ids entry", minimum=-1)


INT32_MAX = 2 ** 31 - 1


def _number(v, name: str) -> None:
    """A finite real number (bool excluded): the engine keeps it as float32."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(v).__name__}")
    if not math.isfinite(v) or abs(v) > 3.0e38:
        raise ValueError(f"{name} must be a finite number, got {v}")


def _integer(v, name: str, minimum: int = 0) -> None:
    """An integer in [minimum, 2^31 - 1] (the engine keeps it as int32)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {type(v).__name__}")
    if not minimum <= int(v) <= INT32_MAX:
        raise ValueError(f"{name} must be in [{minimum}, {INT32_MAX}], got {v}")


def sample(logits, key, temperature, top_p, top_k=None):
    """logits: [B, V] float32; temperature, top_p: [B]; top_k: int [B] or None -> tokens int32 [B]."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.maximum(temperature, 1e-6)[:, None]
    scaled = logits / t
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = cum_before < top_p[:, None]                     # always keeps the top token
    if top_k is not None:
        ranks = jnp.arange(logits.shape[-1])[None, :]
        keep_sorted = keep_sorted & ((top_k[:, None] <= 0) | (ranks < top_k[:, None]))
    # threshold = smallest kept logit per row
    threshold = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)
    return jnp.where(temperature <= 0.0, greedy, sampled)
