"""The paged engine's jitted step: one forward over R rows of C tokens through the paged KV cache,
then one sampled token per row, so the host sees only token ids (one transfer per step).

    out, cache = paged_step(graphdef, state, tokens, batch, cache, bank, adapter_ids,
                            prompt_lengths, temperature, top_p, top_k, key, next_tokens=None, native=None,
                            adapter_starts=None, logprobs=False, prompt_logprobs=False, return_logits=False)

`out` is the sampled token ids int32 [R] when no extra is asked for (the hot path: nothing else is
computed or returned), else a dict of device arrays:

    tokens                          int32 [R]
    logprob, top_values, top_ids    [R], [R, K], [R, K]   (logprobs=True; K = MAX_TOP_LOGPROBS)
    prompt_logprob, prompt_top_values, prompt_top_ids
                                    [R, C], [R, C, K], [R, C, K]: at chunk position j, the log-prob
                                    of `next_tokens[r, j]` (prompt_logprobs=True)
    logits                          float32 [R, V] at each row's last valid token (return_logits=True)

Log-probabilities are the model's: log_softmax of the raw logits (before temperature, top-p and
top-k), computed on the device; only K values per token reach the host.

`key` is one key, or `(key_data uint32 [R, 2], counters int32 [R])`: a key per row, its request's
own key folded with the index of the token being sampled (seeded requests are reproducible whatever
shares their batch).

`paged_decode_steps` runs N decode steps in one call (a device-side loop feeding each step's
tokens to the next; no host sync between them).

Decode is C == 1 (adapter gather layout); prefill chunks are C > 1 (grouped layout). Adapters act
per token by the same position policy as everywhere (`policy.token_adapter_index` with absolute
positions; `adapter_starts` int32 [R] gives activated (aLoRA) rows their activation start), so a
prompt prefilled in chunks is adapted exactly like a whole prompt, and generated tokens of a PreFT
request run on base weights (their positions are >= the prompt length). `bank=None` compiles
the plain base model. `native` (a `preft_jax.native_decode.NativeWeights`: float32, one CPU device)
runs a decode call without a bank as one native CPU call (layers, LM head, greedy argmax); every
other call (prefill chunks, adapted decode) ignores it and runs on XLA.
"""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from flax import nnx

from preft_jax import native_decode
from preft_jax.adapters.policy import token_adapter_index
from preft_jax.paged_kv import PagedBatch, PagedKVCache
from preft_jax.sampling import MAX_TOP_LOGPROBS, row_keys, sample, token_logprobs


def _hidden(graphdef, state, tokens, batch, cache, bank, adapter_ids, prompt_lengths, adapter_starts=None):
    model = nnx.merge(graphdef, state)
    ctx = None
    if bank is not None:
        slots = token_adapter_index(bank, adapter_ids, batch.positions, prompt_lengths, adapter_starts)
        ctx = model.adapter_context(slots, bank, row_slots=adapter_ids)      # a row is one request
    h, cache = model.forward_paged(tokens, batch, cache, bank, ctx)
    return model, h, cache


def paged_forward(graphdef, state, tokens, batch: PagedBatch, cache: PagedKVCache, bank=None, adapter_ids=None,
                  prompt_lengths=None, adapter_starts=None):
    """(logits [R, V] float32 at each row's last valid token, cache)."""
    model, h, cache = _hidden(graphdef, state, tokens, batch, cache, bank, adapter_ids, prompt_lengths,
                              adapter_starts=adapter_starts)
    R = tokens.shape[0]
    last = h[jnp.arange(R), jnp.maximum(batch.chunk_lens - 1, 0)]
    return model.logits(last), cache


PROMPT_LOGIT_ELEMENTS = 1 << 23       # float32 logits computed at once for prompt log-probs (32 MiB)


def prompt_logprob_positions(R: int, C: int, V: int) -> int:
    """Chunk positions whose [R, V] logits `_prompt_logprobs` computes together: as many as keep
    their logits under PROMPT_LOGIT_ELEMENTS, so the LM head is read C / that many times per chunk
    (once per position, it was the cost of echo + logprobs: a 500-token prompt 10x its plain prefill)."""
    return max(1, min(C, PROMPT_LOGIT_ELEMENTS // max(1, R * V)))


def _prompt_logprobs(model, h, next_tokens):
    """Per chunk position: log-prob of the next token and the top K, `prompt_logprob_positions`
    positions per LM-head matmul (the [R, C, V] logits are never materialized at once)."""
    R, C = next_tokens.shape
    def one(args):
        hj, tj = args                                        # [R, d], [R]
        return token_logprobs(model.logits(hj), tj, MAX_TOP_LOGPROBS)
    lp, vals, ids = jax.lax.map(one, (jnp.swapaxes(h, 0, 1), jnp.swapaxes(next_tokens, 0, 1)),
                                batch_size=prompt_logprob_positions(R, C, model.cfg.vocab_size))
    return jnp.swapaxes(lp, 0, 1), jnp.swapaxes(vals, 0, 1), jnp.swapaxes(ids, 0, 1)


def _paged_step(graphdef, state, tokens, batch: PagedBatch, cache: PagedKVCache, bank, adapter_ids, prompt_lengths,
               temperature, top_p, top_k, key, next_tokens=None, native=None, adapter_starts=None, *,
               logprobs: bool = False,
               prompt_logprobs: bool = False, return_logits: bool = False):
    if native is not None and bank is None and tokens.shape[1] == 1:   # a base-weights decode call: all native
        model = nnx.merge(graphdef, state)
        logits, greedy, cache = native_decode.decode_logits(model, native, tokens, batch, cache)
    else:
        model, h, cache = _hidden(graphdef, state, tokens, batch, cache, bank, adapter_ids, prompt_lengths,
                                  adapter_starts)
        R = tokens.shape[0]
        logits, greedy = model.logits(h[jnp.arange(R), jnp.maximum(batch.chunk_lens - 1, 0)]), None
    if isinstance(key, tuple):
        key = row_keys(*key)
    nxt = sample(logits, key, temperature, top_p, top_k, greedy)
    if not (logprobs or prompt_logprobs or return_logits):
        return nxt, cache
    out = {"tokens": nxt}
    if logprobs:
        out["logprob"], out["top_values"], out["top_ids"] = token_logprobs(logits, nxt)
    if prompt_logprobs:
        out["prompt_logprob"], out["prompt_top_values"], out["prompt_top_ids"] = _prompt_logprobs(model, h,
                                                                                                  next_tokens)
    if return_logits:
        out["logits"] = logits
    return out, cache


_STATIC = ("logprobs", "prompt_logprobs", "return_logits")
paged_step = jax.jit(_paged_step, static_argnums=0, static_argnames=_STATIC, donate_argnames=("cache",))


def decode_advance(batch: PagedBatch, block_size: int, num_blocks: int, steps) -> PagedBatch:
    """The decode batch (C == 1) `steps` tokens later: context lengths + steps and the write index of
    each row's new position looked up in its block table (dropped - pool size num_blocks * block_size
    - for padding rows and for positions past the table). Block tables are unchanged: they must
    already name the blocks of every position the steps reach."""
    nb = batch.block_tables.shape[1]
    pos = batch.context_lens + steps
    idx = pos // block_size
    blk = jnp.take_along_axis(batch.block_tables, jnp.clip(idx, 0, nb - 1)[:, None], axis=1)[:, 0]
    valid = (batch.chunk_lens > 0) & (idx < nb)
    widx = jnp.where(valid, blk * block_size + pos % block_size, num_blocks * block_size)
    return PagedBatch(batch.block_tables, pos, batch.chunk_lens, widx[:, None].astype(jnp.int32), batch.attention)


def _paged_decode_steps(graphdef, state, tokens, batch: PagedBatch, cache: PagedKVCache, bank, adapter_ids,
                        prompt_lengths, temperature, top_p, top_k, key, adapter_starts=None, native=None, *,
                        num_steps: int):
    def one(carry, i):
        tok, cache = carry
        b = decode_advance(batch, cache.block_size, cache.num_blocks, i)
        step_key = (key[0], key[1] + i) if isinstance(key, tuple) else jax.random.fold_in(key, i)
        nxt, cache = _paged_step(graphdef, state, tok, b, cache, bank, adapter_ids, prompt_lengths,
                                 temperature, top_p, top_k, step_key, native=native, adapter_starts=adapter_starts)
        return (nxt[:, None], cache), nxt

    (_, cache), toks = jax.lax.scan(one, (tokens, cache), jnp.arange(num_steps, dtype=jnp.int32))
    return jnp.swapaxes(toks, 0, 1), cache


paged_decode_steps = jax.jit(_paged_decode_steps, static_argnums=0, static_argnames=("num_steps",),
                             donate_argnames=("cache",))
paged_decode_steps.__doc__ = """`num_steps` decode steps in one call, with no host round trip between them:

    tokens, cache = paged_decode_steps(graphdef, state, tokens, batch, cache, bank, adapter_ids,
                                       prompt_lengths, temperature, top_p, top_k, key,
                                       adapter_starts=None, native=None, num_steps=N)

tokens int32 [R, 1] and `batch` (C == 1) describe the first step as for `paged_step`; step i
(0-based) feeds step i - 1's sampled tokens, at positions context_lens + i, its K/V written where
the block tables place that position (`decode_advance`; batch.write_index is recomputed that way,
so the caller allocates blocks for all N positions first). `key` is one key (step i draws with fold_in(key, i)) or (key_data [R, 2],
counters [R]) (step i uses counters + i: the same draws as N `paged_step` calls with the counters
advanced). Returns (tokens int32 [R, N], cache); the pool is donated and updated in place. Rows
keep decoding after a stop token (the host truncates: no device-side stop check), so N should be
small (the engine's scheduler steps). Greedy or sampled, adapters as in `paged_step` (a bank and
adapter_starts in the all-token baseline; None for PreFT and base decode). `native`: each step
without a bank runs as the native CPU decode step (as in `paged_step`)."""


def sharded_paged_step(mesh: jax.sharding.Mesh, cache_shardings: PagedKVCache):
    """`paged_step` for a mesh, with explicit out_shardings: the sampled tokens (and any logprob
    outputs) replicated and the donated cache in `cache_shardings` (its declared sharding,
    `preft_jax.sharding.cache_shardings`). The inputs (weights, cache, bank) arrive placed by their
    declared axes. Call it under `jax.set_mesh(mesh)` so the model's activation constraints apply.
    One jitted function (and compile cache) per (mesh, cache sharding)."""
    return _sharded_paged_step(mesh, cache_shardings.k.spec, cache_shardings.v.spec)


def step_out_shardings(mesh, k_spec, v_spec) -> dict:
    """jit's out_shardings of a step on `mesh`: outputs replicated, the pool in its declared sharding."""
    if mesh is None:
        return {}
    named = functools.partial(jax.sharding.NamedSharding, mesh)
    return {"out_shardings": (named(jax.sharding.PartitionSpec()), PagedKVCache(named(k_spec), named(v_spec)))}


@functools.lru_cache(maxsize=16)
def _sharded_paged_step(mesh, k_spec, v_spec):
    return jax.jit(_paged_step, static_argnums=0, static_argnames=_STATIC, donate_argnames=("cache",),
                   **step_out_shardings(mesh, k_spec, v_spec))


def bind_state(fn, graphdef, state_tree=None):
    """fn(graphdef, state, ...) with the model's graph bound in, called as f(state, ...); with
    `state_tree` (the treedef of the model's nnx State) `state` is its leaves (a tuple of arrays,
    `jax.tree_util.tree_leaves(state)`). Either saves host time at every dispatch of a jitted
    step: a static graphdef argument is hashed each time (~20 us for the tiny model, more with
    depth), and an nnx State is flattened by Python callbacks (~20 us for the tiny model's 11
    leaves; a tuple of arrays is flattened in C++). The signature is fn's without `graphdef`, so
    jit's argument names (donation, statics) keep working."""
    if state_tree is None:
        return functools.partial(fn, graphdef)

    def bound(state, *args, **kwargs):
        return fn(graphdef, jax.tree_util.tree_unflatten(state_tree, state), *args, **kwargs)

    bound.__signature__ = inspect.signature(functools.partial(fn, graphdef))
    bound.__name__ = bound.__qualname__ = fn.__name__
    return bound


def bind_paged_step(graphdef, mesh: jax.sharding.Mesh | None = None, cache_shardings: PagedKVCache | None = None,
                    state_tree=None):
    """`paged_step` (with a mesh: `sharded_paged_step`) with the model's graph bound in, called as
    f(state, tokens, batch, cache, ...), `state` being the State's leaves when `state_tree` is given
    (`bind_state`: less host time per dispatch). One jitted function (and compile cache) per
    (graph, state structure, mesh, cache sharding)."""
    if mesh is None:
        return _bound_paged_step(graphdef, state_tree, None, None, None)
    return _bound_paged_step(graphdef, state_tree, mesh, cache_shardings.k.spec, cache_shardings.v.spec)


@functools.lru_cache(maxsize=16)
def _bound_paged_step(graphdef, state_tree, mesh, k_spec, v_spec):
    return jax.jit(bind_state(_paged_step, graphdef, state_tree), static_argnames=_STATIC, donate_argnames=("cache",),
                   **step_out_shardings(mesh, k_spec, v_spec))


@functools.partial(jax.jit, static_argnames=("logprobs",))
def sample_rows(logits, rows, temperature, top_p, top_k, key_data, counters, *, logprobs: bool = False):
    """Samples S tokens from rows `rows` [S] of `logits` [R, V] (several samples may share a row:
    the n completions of one prompt draw their first tokens from its one prefill). Returns tokens
    [S], or a dict like `paged_step`'s with logprobs."""
    picked = logits[rows]
    nxt = sample(picked, row_keys(key_data, counters), temperature, top_p, top_k)
    if not logprobs:
        return nxt
    lp, vals, ids = token_logprobs(picked, nxt)
    return {"tokens": nxt, "logprob": lp, "top_values": vals, "top_ids": ids}


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_blocks(cache: PagedKVCache, src, dst) -> PagedKVCache:
    """K/V blocks src[i] -> dst[i] (every layer and head): copy-on-write of a shared partial block."""
    return PagedKVCache(k=cache.k.at[:, :, dst].set(cache.k[:, :, src]),
                        v=cache.v.at[:, :, dst].set(cache.v[:, :, src]))


paged_logits = jax.jit(paged_forward, static_argnums=0, donate_argnames=("cache",))
paged_logits.__doc__ = "paged_forward, jitted (cache donated): (logits [R, V], cache) - tests and logprobs."
