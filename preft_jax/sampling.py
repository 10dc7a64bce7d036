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
            _integer(t, "stop_token_ids entry", minimum=-INT32_MAX - 1)     # negative: never matches


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


CANDIDATES = 256     # top-p / top-k thresholds come from the top CANDIDATES logits when the kept set fits


def _threshold_sorted(scaled, top_p, top_k):
    """Per-row smallest kept logit, by a full sort (a nucleus wider than CANDIDATES tokens)."""
    sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
    return _threshold_from(sorted_logits, jax.nn.logsumexp(scaled, axis=-1, keepdims=True), top_p, top_k)[0]


def _threshold_from(desc, lse, top_p, top_k):
    """(threshold, fits): desc = the largest logits per row in descending order; fits says whether
    the kept set (nucleus and top-k) lies inside them."""
    probs = jnp.exp(desc - lse)
    cum = jnp.cumsum(probs, axis=-1)
    keep = (cum - probs) < top_p[:, None]                         # always keeps the top token
    ranks = jnp.arange(desc.shape[-1])[None, :]
    keep = keep & ((top_k[:, None] <= 0) | (ranks < top_k[:, None]))
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1)
    fits = ((top_k > 0) & (top_k <= desc.shape[-1])) | (cum[:, -1] >= top_p)
    return threshold, fits


def sample(logits, key, temperature, top_p, top_k=None):
    """logits: [B, V] float32; temperature, top_p: [B]; top_k: int [B] or None -> tokens int32 [B].

    Per-row: temperature 0 is greedy; else softmax(logits / temperature) restricted to the top_k
    tokens (0 = off) and the top_p nucleus (tokens whose logit ties the smallest kept one are kept
    too). One compiled function with run-time paths for the whole batch: all rows greedy -> argmax
    only; rows that filter -> the threshold from the top CANDIDATES logits (`lax.top_k`), or a full
    sort only when some nucleus is wider than that. The draw is one uniform per row through the
    cumulative distribution (no per-token noise over the vocabulary)."""
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    top_k = jnp.zeros((B,), jnp.int32) if top_k is None else jnp.asarray(top_k, jnp.int32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling_rows = temperature > 0.0

    def draw():
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        filter_rows = sampling_rows & ((top_p < 1.0) | ((top_k > 0) & (top_k < V)))

        def thresholds():
            desc, _ = jax.lax.top_k(scaled, min(V, CANDIDATES))
            lse = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
            th, fits = _threshold_from(desc, lse, top_p, top_k)
            return jax.lax.cond(jnp.all(fits | ~filter_rows), lambda: th,
                                lambda: _threshold_sorted(scaled, top_p, top_k))

        threshold = jax.lax.cond(jnp.any(filter_rows), thresholds, lambda: jnp.full((B,), -jnp.inf))
        threshold = jnp.where(filter_rows, threshold, -jnp.inf)
        masked = jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)
        cdf = jnp.cumsum(jax.nn.softmax(masked, axis=-1), axis=-1)
        u = jax.random.uniform(key, (B, 1), jnp.float32) * cdf[:, -1:]
        sampled = jnp.argmax(cdf > u, axis=-1).astype(jnp.int32)
        return jnp.where(sampling_rows, sampled, greedy)

    return jax.lax.cond(jnp.any(sampling_rows), draw, lambda: greedy)
