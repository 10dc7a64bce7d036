"""`ModelRunner` and the fixed-row prefill/decode path: RL rollouts, `python -m preft_jax`, tests.

`ModelRunner` holds the split model (and its mesh) for everyone, the serving engine included; the
engine's own step is preft_jax/paged_step.py (paged KV cache, continuous batching), which shares the
sampler (preft_jax/sampling.py) and the per-token adapter masking (preft_jax/adapters/policy.py)
with the functions here, not these functions. `ModelRunner.generate` runs a batch of prompts to
completion over a preallocated `KVCache` (one row per sequence); `sequence_logits` /
`sequence_hidden` are the teacher-forced training forward.

Pure jitted step functions take `(graphdef, state)` of a split `Llama` (split once, in
`ModelRunner`) and the adapter bank as arguments, so new adapter weights never recompile. Each
step builds its `AdapterContext` once (token -> slot layout; grouped for prefill and teacher
forcing, per-token gather for decode) and every layer uses it.

* `prefill_step`: adapted prefill of a right-padded prompt batch into cache rows; returns the
  logits of each prompt's last token (which samples the first output token).
* `decode_step`: one token per cache row. With `bank=None` it is the plain base model: the
  prefill-only (PreFT) decode. With a bank, rows whose adapter acts on generated tokens (all-token
  and activated policies) use it; PreFT rows still decode on base.
* `sequence_logits`: teacher-forced logits for training, with the same per-token adapter
  masking as prefill + decode (prompt tokens adapted, response tokens base in prefill mode).

Which token uses which adapter is `preft_jax.adapters.policy.token_adapter_index`; activated (aLoRA)
adapters also need each row's activation start, `adapter_starts` int32 [B] (`policy.activation_starts`
finds it in the prompt; `ModelRunner.generate` does so itself).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preft_jax import quantize
from preft_jax import sharding as shd
from preft_jax.adapters import policy
from preft_jax.adapters.bank import AdapterBank
from preft_jax.kv_cache import KVCache
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams, sample


def _positions(batch, length):
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))


def _token_idx(bank, adapter_ids, positions, prompt_lengths, adapter_starts=None):
    if bank is None:
        return None
    return policy.token_adapter_index(bank, adapter_ids, positions, prompt_lengths, adapter_starts)


def sequence_hidden(graphdef, state, tokens, prompt_lengths, bank=None, adapter_ids=None, adapter_starts=None,
                    remat: bool | str = False):
    """Teacher-forced final hidden states [B, T, d] (pre final norm). Not jitted: trainers wrap it.
    remat: each layer is recomputed in the backward pass (training memory: one layer's activations;
    a REMAT_POLICIES name keeps some projections' outputs, preft_jax.config.remat_policy)."""
    model = nnx.merge(graphdef, state)
    idx = _token_idx(bank, adapter_ids, _positions(*tokens.shape), prompt_lengths, adapter_starts)
    h, _ = model.forward_chunk(tokens, bank, model.adapter_context(idx, bank, row_slots=adapter_ids), remat=remat)
    return h


def sequence_logits(graphdef, state, tokens, prompt_lengths, bank=None, adapter_ids=None, adapter_starts=None):
    """Teacher-forced logits [B, T, V] float32; logits[:, t] predicts tokens[:, t + 1]."""
    model = nnx.merge(graphdef, state)
    return model.logits(sequence_hidden(graphdef, state, tokens, prompt_lengths, bank, adapter_ids, adapter_starts))


@functools.partial(jax.jit, static_argnums=0, donate_argnames=("cache",))
def prefill_step(graphdef, state, tokens, prompt_lengths, slot_ids, cache: KVCache,
                 bank: AdapterBank | None = None, adapter_ids=None, adapter_starts=None):
    """tokens: int [B, T] right-padded; writes K/V into cache[slot_ids]. -> (last logits [B, V], cache)."""
    model = nnx.merge(graphdef, state)
    idx = _token_idx(bank, adapter_ids, _positions(*tokens.shape), prompt_lengths, adapter_starts)
    h, cache = model.forward_chunk(tokens, bank, model.adapter_context(idx, bank, row_slots=adapter_ids), cache,
                                   slot_ids)
    last = h[jnp.arange(tokens.shape[0]), prompt_lengths - 1]
    return model.logits(last), cache


def _decode(graphdef, state, tokens, positions, cache, bank, adapter_ids, prompt_lengths, adapter_starts=None):
    model = nnx.merge(graphdef, state)
    idx = _token_idx(bank, adapter_ids, positions[:, None], prompt_lengths, adapter_starts)    # [n, 1]
    return model.decode(tokens, positions, cache, bank, model.adapter_context(idx, bank))


decode_step = jax.jit(_decode, static_argnums=0, donate_argnames=("cache",))
# the first token's draw, compiled once per shape: `sample` called eagerly traces its lax.cond
# branches anew on every call (a compile each time, and memory maps that add up to a crash after ~650)
_sample_first = jax.jit(sample)
decode_step.__doc__ = """tokens, positions: int [n_slots] -> (logits [n_slots, V], cache). bank=None: base decode."""


@functools.partial(jax.jit, static_argnums=(0, 12))
def _decode_loop(graphdef, state, cache, first_tokens, prompt_lengths, bank, adapter_ids, key,
                 temperature, top_p, top_k, stop_ids, max_new_tokens, adapter_starts=None):
    """Fused decode of up to max_new_tokens (first token given) with early exit when all rows stop."""
    B = first_tokens.shape[0]
    out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first_tokens)
    done = jnp.isin(first_tokens, stop_ids)

    def cond(s):
        i, _, _, done, _, _ = s
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(s):
        i, tok, cache, done, key, out = s
        key, sub = jax.random.split(key)
        logits, cache = _decode(graphdef, state, tok, prompt_lengths + i - 1, cache, bank, adapter_ids,
                                prompt_lengths, adapter_starts)
        nxt = sample(logits, sub, temperature, top_p, top_k)
        nxt = jnp.where(done, 0, nxt)
        out = out.at[:, i].set(nxt)
        return i + 1, nxt, cache, done | jnp.isin(nxt, stop_ids), key, out

    s = (jnp.int32(1), first_tokens, cache, done, key, out)
    _, _, _, _, _, out = jax.lax.while_loop(cond, body, s)
    return out


@dataclasses.dataclass
class Generation:
    tokens: list[int]          # generated ids, stop token excluded
    finish_reason: str         # "stop" or "length"
    stop_token: int | None = None   # the stop id sampled ("stop"): which of several it was


def bucket_length(n: int, minimum: int = 16) -> int:
    """Prompt lengths are padded to powers of two (>= minimum) to bound recompilation."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class ModelRunner:
    """A split model (graphdef + state, split once) with the jitted prefill/decode core.

    `mesh` (optional, axes ("data", "fsdp", "tensor"), see preft_jax.sharding): the weights are
    placed by their declared logical axes, caches and banks handed to the steps are placed the same
    way, and the steps run under `jax.set_mesh(mesh)`, so the model's activation constraints apply
    and the returned caches keep their declared shardings."""

    def __init__(self, model: Llama, mesh: jax.sharding.Mesh | None = None):
        self.cfg = model.cfg
        self.dtype = model.dtype
        self.adapter_backend = model.adapter_backend
        self.chunk_attention = model.chunk_attention               # forward_chunk's (preft_jax.chunk_attention)
        self.quantization = quantize.model_quantization(model)    # "int8" | "int4" | None
        self.graphdef, self.state = nnx.split(model)
        self.mesh = None
        if mesh is not None:
            self.mesh = mesh
            self.state = shd.shard_model_state(self.state, mesh, self.cfg)

    def with_mesh(self, mesh: jax.sharding.Mesh | None) -> "ModelRunner":
        """This runner with its weights placed on `mesh` (self when it is the runner's mesh already)."""
        if mesh is self.mesh or (mesh is not None and mesh == self.mesh):
            return self
        new = object.__new__(ModelRunner)
        new.__dict__.update(self.__dict__)
        new.mesh = mesh
        new.state = (jax.device_put(self.state, jax.devices()[0]) if mesh is None
                     else shd.shard_model_state(self.state, mesh, self.cfg))
        return new

    def mesh_context(self):
        """`jax.set_mesh(self.mesh)` (activation sharding constraints on), or nothing without a mesh."""
        return shd.use_mesh(self.mesh)

    def place_cache(self, cache):
        """A KV cache (KVCache or PagedKVCache) placed by its declared axes (unchanged without a mesh)."""
        return cache if self.mesh is None else jax.device_put(cache, shd.cache_shardings(cache, self.mesh, self.cfg))

    def place_bank(self, bank):
        """An AdapterBank placed by its declared axes (unchanged without a mesh or bank)."""
        if bank is None or self.mesh is None:
            return bank
        return jax.device_put(bank, shd.bank_shardings(bank, self.mesh, self.cfg))

    def prefill(self, tokens, prompt_lengths, slot_ids, cache, bank=None, adapter_ids=None, adapter_starts=None):
        with self.mesh_context():
            return prefill_step(self.graphdef, self.state, tokens, prompt_lengths, slot_ids, cache, bank,
                                adapter_ids, adapter_starts)

    def decode(self, tokens, positions, cache, bank=None, adapter_ids=None, prompt_lengths=None,
               adapter_starts=None):
        with self.mesh_context():
            return decode_step(self.graphdef, self.state, tokens, positions, cache, bank, adapter_ids,
                               prompt_lengths, adapter_starts)

    def check_fits(self, prompt_len: int, max_new_tokens: int, cache_len: int | None = None):
        limit = self.cfg.max_seq_len if cache_len is None else min(cache_len, self.cfg.max_seq_len)
        if prompt_len < 1:
            raise ValueError("prompt is empty")
        if prompt_len + max_new_tokens > limit:
            raise ValueError(f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"context length {limit}")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(),
                 bank: AdapterBank | None = None, adapter_ids: Sequence[int] | None = None,
                 key: jax.Array | None = None, decode_with_adapters: bool | None = None,
                 group: int = 1) -> list[Generation]:
        """Batched generation: adapted prefill, then fused decode.

        Decode gets the bank only if some request's adapter acts on generated tokens (all-token or
        activated policy; or when `decode_with_adapters` forces it); otherwise it runs the base model
        alone (PreFT). An activated (aLoRA) adapter acts from the last occurrence of its invocation
        sequence in the prompt; a prompt without it raises `policy.MissingInvocationError`.
        `group` > 1 samples every prompt `group` times (RL rollouts): each prompt is prefilled
        once and its cache rows and last logits are repeated; the result is group-major (row
        b * group + j is sample j of prompt b) and equals generating the repeated prompt list.
        """
        if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
            raise ValueError(f"group must be an integer >= 1, got {group!r}")
        B = len(prompts)
        lengths = [len(p) for p in prompts]
        for n in lengths:
            self.check_fits(n, sampling.max_new_tokens)
        T = min(bucket_length(max(lengths)), self.cfg.max_seq_len)
        cache_len = min(T + sampling.max_new_tokens, self.cfg.max_seq_len)
        tokens = np.zeros((B, T), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        if bank is not None:
            adapter_ids = np.zeros(B, np.int32) if adapter_ids is None else np.asarray(adapter_ids, np.int32)
            if adapter_ids.shape != (B,) or adapter_ids.min() < 0 or adapter_ids.max() >= bank.n_slots:
                raise ValueError(f"adapter_ids must be {B} slot indices in [0, {bank.n_slots})")
            adapter_ids = jnp.asarray(adapter_ids)
        elif adapter_ids is not None and np.any(np.asarray(adapter_ids) != 0):
            raise ValueError("adapter_ids given without an adapter bank")
        else:
            adapter_ids = None
        starts = None
        if bank is not None:
            starts = policy.activation_starts(bank, adapter_ids, prompts)
            starts = None if starts is None else jnp.asarray(starts)
        if decode_with_adapters is None:
            decode_with_adapters = bank is not None and policy.decode_uses_adapters(bank, adapter_ids)
        plen = jnp.asarray(lengths, jnp.int32)
        cache = self.place_cache(KVCache.create(self.cfg, B, cache_len, self.dtype))
        bank = self.place_bank(bank)
        logits, cache = self.prefill(jnp.asarray(tokens), plen, jnp.arange(B, dtype=jnp.int32), cache,
                                     bank, adapter_ids, starts)
        if group > 1:
            logits, cache, plen = _repeat_rows(logits, cache, plen, group)
            adapter_ids = None if adapter_ids is None else jnp.repeat(adapter_ids, group)
            starts = None if starts is None else jnp.repeat(starts, group)
            B *= group
        key = jax.random.key(0) if key is None else key
        key, sub = jax.random.split(key)
        temp = jnp.full((B,), sampling.temperature, jnp.float32)
        top_p = jnp.full((B,), sampling.top_p, jnp.float32)
        top_k = jnp.full((B,), sampling.top_k, jnp.int32)
        first = _sample_first(logits, sub, temp, top_p, top_k)
        stop = tuple(sampling.stop_token_ids) or tuple(self.cfg.eos_token_ids) or (-1,)
        dbank = bank if decode_with_adapters else None
        with self.mesh_context():
            out = _decode_loop(self.graphdef, self.state, cache, first, plen, dbank,
                               adapter_ids if dbank is not None else None, key, temp, top_p, top_k,
                               jnp.asarray(stop, jnp.int32), sampling.max_new_tokens,
                               starts if dbank is not None else None)
        return [_trim(row, stop) for row in np.asarray(out)]


@functools.partial(jax.jit, static_argnums=3)
def _repeat_rows(logits, cache: KVCache, prompt_lengths, group: int):
    """Each prompt's last logits, cache rows and length `group` times (group-major)."""
    rep = lambda x, axis: jnp.repeat(x, group, axis=axis, total_repeat_length=x.shape[axis] * group)
    return rep(logits, 0), KVCache(rep(cache.k, 1), rep(cache.v, 1)), rep(prompt_lengths, 0)


def _trim(row: np.ndarray, stop: Sequence[int]) -> Generation:
    for i, t in enumerate(row.tolist()):
        if t in stop:
            return Generation(row[:i].tolist(), "stop", t)
    return Generation(row.tolist(), "length")
