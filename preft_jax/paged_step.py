"""The paged engine's jitted step: one forward over R rows of C tokens through the paged KV cache,
then one sampled token per row, so the host sees only token ids (one transfer per step).

    next_tokens, cache = paged_step(graphdef, state, tokens, batch, cache, bank, adapter_ids,
                                    prompt_lengths, temperature, top_p, top_k, key)

Decode is C == 1 (adapter gather layout); prefill chunks are C > 1 (grouped layout). Adapters act
per token by the same position policy as everywhere (`token_adapter_index` with absolute positions),
so a prompt prefilled in chunks is adapted exactly like a whole prompt, and generated tokens of a
PreFT request run on base weights (their positions are >= the prompt length). `bank=None` compiles
the plain base model.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from preft_jax.adapters.positions import token_adapter_index
from preft_jax.paged_kv import PagedBatch, PagedKVCache
from preft_jax.sampling import sample


def paged_forward(graphdef, state, tokens, batch: PagedBatch, cache: PagedKVCache, bank=None, adapter_ids=None,
                  prompt_lengths=None):
    """(logits [R, V] float32 at each row's last valid token, cache)."""
    model = nnx.merge(graphdef, state)
    ctx = None
    if bank is not None:
        slots = token_adapter_index(bank, adapter_ids, batch.positions, prompt_lengths)
        ctx = model.adapter_context(slots, bank)
    h, cache = model.forward_paged(tokens, batch, cache, bank, ctx)
    R = tokens.shape[0]
    last = h[jnp.arange(R), jnp.maximum(batch.chunk_lens - 1, 0)]
    return model.logits(last), cache


def _paged_step(graphdef, state, tokens, batch: PagedBatch, cache: PagedKVCache, bank, adapter_ids, prompt_lengths,
                temperature, top_p, top_k, key):
    logits, cache = paged_forward(graphdef, state, tokens, batch, cache, bank, adapter_ids, prompt_lengths)
    return sample(logits, key, temperature, top_p, top_k), cache


paged_step = jax.jit(_paged_step, static_argnums=0, donate_argnames=("cache",))


def sharded_paged_step(mesh: jax.sharding.Mesh, cache_shardings: PagedKVCache):
    """`paged_step` for a mesh, with explicit out_shardings: the sampled tokens replicated and the
    donated cache in `cache_shardings` (its declared sharding, `preft_jax.sharding.cache_shardings`).
    The inputs (weights, cache, bank) arrive placed by their declared axes. Call it under
    `jax.set_mesh(mesh)` so the model's activation constraints apply. One jitted function (and
    compile cache) per (mesh, cache sharding)."""
    return _sharded_paged_step(mesh, cache_shardings.k.spec, cache_shardings.v.spec)


@functools.lru_cache(maxsize=16)
def _sharded_paged_step(mesh, k_spec, v_spec):
    named = functools.partial(jax.sharding.NamedSharding, mesh)
    return jax.jit(_paged_step, static_argnums=0, donate_argnames=("cache",),
                   out_shardings=(named(jax.sharding.PartitionSpec()), PagedKVCache(named(k_spec), named(v_spec))))


paged_logits = jax.jit(paged_forward, static_argnums=0, donate_argnames=("cache",))
paged_logits.__doc__ = "paged_forward, jitted (cache donated): (logits [R, V], cache) - tests and logprobs."
