"""Per-row sampling: greedy (temperature 0), temperature, top-p, top-k. All arrays, jit-friendly.

Also per-row random keys (`row_keys`: a request's own key folded with its token index, so a seeded
request's draws never depend on its batch-mates) and log-probabilities (`token_logprobs`: the
model's log-softmax of the raw logits, before temperature / top-p / top-k, as OpenAI reports them).
"""
from __future__ import annotations

import dataclasses
import hashlib
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
    # serving engine (serve/engine.py) only; ModelRunner.generate ignores them:
    seed: int | None = None               # same seed -> same draws (key from the seed and the token index)
    logprobs: int | None = None           # None: off; k in [0, MAX_TOP_LOGPROBS]: sampled token + top k
    prompt_logprobs: int | None = None    # the same for every prompt token after the first

    def __post_init__(self):
        """The one definition of what each sampling field accepts (serve/protocol.py and the engine
        rely on it): raises `SamplingError` naming the field."""
        _number(self.temperature, "temperature")
        _number(self.top_p, "top_p")
        _integer(self.top_k, "top_k")
        _integer(self.max_new_tokens, "max_new_tokens", minimum=1)
        if self.temperature < 0:
            raise SamplingError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingError("top_k", f"must be >= 0, got {self.top_k}")
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for t in self.stop_token_ids:
            _integer(t, "stop_token_ids entry", minimum=-INT32_MAX - 1)     # negative: never matches
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))):
            raise SamplingError("seed", f"must be an integer or None, got {type(self.seed).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _integer(v, name, maximum=MAX_TOP_LOGPROBS)


class SamplingError(ValueError):
    """An invalid sampling field: str(e) is "<field> <requirement>"; `field` names the
    SamplingParams field (an HTTP layer renames it to its own key)."""

    def __init__(self, field: str, requirement: str):
        super().__init__(f"{field} {requirement}")
        self.field, self.requirement = field, requirement


def flag_error(e: SamplingError, flags: dict[str, str]) -> str:
    """A command line's words for a SamplingError: the field as the flag that set it (flags: field ->
    flag, e.g. {"max_new_tokens": "--max-tokens"})."""
    return f"{flags.get(e.field, e.field)} {e.requirement}"


MAX_TOP_LOGPROBS = 20     # top log-probabilities a step can return per token (a static shape)


INT32_MAX = 2 ** 31 - 1


def shown(v) -> str:
    """A value for an error message (an integer of thousands of digits is not echoed back)."""
    return "a huge value" if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10 ** 30 else str(v)


def _number(v, name: str) -> None:
    """A finite real number (bool excluded): the engine keeps it as float32."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingError(name, f"must be a number, got {type(v).__name__}")
    if abs(v) > 3.0e38 or not math.isfinite(v):         # abs first: a huge int is not a float
        raise SamplingError(name, f"must be a finite number, got {shown(v)}")


def _integer(v, name: str, minimum: int = 0, maximum: int = INT32_MAX) -> None:
    """An integer in [minimum, maximum] (at most 2^31 - 1: the engine keeps it as int32)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise SamplingError(name, f"must be an integer, got {type(v).__name__}")
    if not minimum <= int(v) <= maximum:
        raise SamplingError(name, f"must be in [{minimum}, {maximum}], got {shown(v)}")


def seed_key_data(seed: int, index: int = 0) -> np.ndarray:
    """Raw threefry key data (uint32 [2]) for sample `index` of a request with `seed` (any integer)."""
    h = hashlib.blake2b(f"{int(seed)}/{int(index)}".encode(), digest_size=8).digest()
    return np.frombuffer(h, np.uint32).copy()


def row_keys(key_data, counters):
    """Per-row keys: key data uint32 [B, 2] (one request's own key each) folded with each row's
    token index int [B]. Row b's draw depends only on its request's key and its position."""
    return jax.vmap(lambda kd, t: jax.random.fold_in(jax.random.wrap_key_data(kd, impl="threefry2x32"), t))(
        jnp.asarray(key_data, jnp.uint32), jnp.asarray(counters, jnp.int32))


def token_logprobs(logits, tokens, k: int = MAX_TOP_LOGPROBS):
    """(logprob of `tokens` [B], top-k values [B, k], top-k ids int32 [B, k]) of log_softmax(logits):
    the model's distribution before temperature / top-p / top-k."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.asarray(tokens, jnp.int32)[..., None], axis=-1)[..., 0]
    vals, ids = jax.lax.top_k(logp, k)
    return chosen, vals, ids.astype(jnp.int32)


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
    ranks = jnp.arange(desc.shape[-1])[None, :]
    # the top token always stays, also for a top_p that float32 holds as 0 (below ~1e-38)
    keep = ((cum - probs) < top_p[:, None]) | (ranks == 0)
    keep = keep & ((top_k[:, None] <= 0) | (ranks < top_k[:, None]))
    threshold = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1)
    fits = ((top_k > 0) & (top_k <= desc.shape[-1])) | (cum[:, -1] >= top_p)
    return threshold, fits


def sample(logits, key, temperature, top_p, top_k=None, greedy=None):
    """logits: [B, V] float32; temperature, top_p: [B]; top_k: int [B] or None -> tokens int32 [B].
    key: one key for the batch, or a key per row (typed key array [B], see `row_keys`). greedy: int
    [B], argmax(logits) when the caller has it already (the native decode step computes it).

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
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy is None else jnp.asarray(greedy, jnp.int32)
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
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.ndim == 1:      # a key per row
            u = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(key)
        else:
            u = jax.random.uniform(key, (B, 1), jnp.float32)
        u = u * cdf[:, -1:]
        sampled = jnp.argmax(cdf > u, axis=-1).astype(jnp.int32)
        return jnp.where(sampling_rows, sampled, greedy)

    return jax.lax.cond(jnp.any(sampling_rows), draw, lambda: greedy)
