"""Compiling the engine's programs before requests need them: every prefill and decode bucket, the
parallel-sampling forks and the block copy (`Engine.warmup_tasks`).

Two ways to run them:
* up front (`Engine.warmup()`, `serve server --warmup full`): nothing is served until every program
  is compiled, so no request ever waits on a compile;
* in the background (`Engine.warm_in_background()`, the server's default): the engine thread runs one
  task whenever it has no request to step, so the server answers /health and serves as soon as the
  weights are loaded. A request that arrives first waits for the one program being compiled at
  that moment (if any), then compiles only the shapes it needs, on demand (from the persistent
  compilation cache on a warm start: well under a second each); once the tasks are done, nothing
  compiles any more. /health reports `warmup_pending`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.paged_kv import PagedBatch
from preft_jax.paged_step import sample_rows

if TYPE_CHECKING:
    from serve.engine import Engine

Task = tuple[str, Callable[[], None]]


def warmup_tasks(engine: "Engine") -> list[Task]:
    """(label, run) per program to compile, cheapest first: the one-row prefill and the shortest
    decode before the large buckets, so a background warm-up covers a lone first request early.
    Each run calls the engine's own step (padding rows; every K/V write is dropped)."""
    from serve.engine import _take_tokens
    c = engine.config
    drop = engine.num_blocks * c.block_size
    bank = engine.registry.bank
    V = engine.runner.cfg.vocab_size
    lp_variants = [(False, False), (True, False), (True, True)] if c.warmup_logprobs else [(False, False)]
    R = c.max_num_seqs
    logits = {}              # prefill rows -> logits as the step returns them (placement included)

    def prefill(P, C, nb, lp, plp):
        def run():
            batch = PagedBatch(jnp.zeros((P, nb), jnp.int32), jnp.zeros(P, jnp.int32), jnp.zeros(P, jnp.int32),
                               jnp.full((P, C), drop, jnp.int32), "gather")
            out = engine._call(np.zeros((P, C), np.int32), batch, bank, np.zeros(P, np.int32), np.ones(P, np.int32),
                               engine._sampling_rows([], P), (lp, plp, True),
                               np.zeros((P, C), np.int32) if plp else None, engine.native)
            logits[P] = jax.block_until_ready(out["logits"])
        return run

    def decode(nb, lp):
        def run():
            batch = PagedBatch(jnp.zeros((R, nb), jnp.int32), jnp.zeros(R, jnp.int32), jnp.zeros(R, jnp.int32),
                               jnp.full((R, 1), drop, jnp.int32), engine.decode_attention)
            out = engine._call_decode(np.zeros((R, 1), np.int32), batch, np.zeros(R, np.int32),
                                      np.ones(R, np.int32), engine._sampling_rows([], R), lp)
            jax.block_until_ready(_take_tokens(out["tokens"] if isinstance(out, dict) else out,
                                               jnp.zeros(R, jnp.int32)))
        return run

    def fork(S, P, lp):
        def run():
            temp, top_p, top_k, key_data, counters = engine._sampling_rows([], S)
            rows = logits[P] if P in logits else jnp.zeros((P, V), jnp.float32)
            jax.block_until_ready(sample_rows(rows, jnp.zeros(S, jnp.int32),
                                              jnp.asarray(temp), jnp.asarray(top_p), jnp.asarray(top_k),
                                              jnp.asarray(key_data), jnp.asarray(counters), logprobs=lp))
        return run

    def copies():
        engine._copy_blocks([])
        jax.block_until_ready(engine.cache.k)

    prefills = [(f"prefill {P} rows, chunk {C} tokens, context {nb} blocks" + (" (logprobs)" if lp else ""),
                 prefill(P, C, nb, lp, plp))
                for P, C, nb in engine.prefill_buckets() for lp, plp in lp_variants]
    decodes = [(f"decode (context {nb} blocks)" + (" (logprobs)" if lp else ""), decode(nb, lp))
               for nb in engine.block_buckets for lp, _ in lp_variants[:2]]
    # the smallest prefill and decode first (what a lone first request needs), then the rest in order
    tasks: list[Task] = [prefills[0], decodes[0], *prefills[1:], *decodes[1:]]
    for S in engine.fork_buckets:                  # n > 1: first tokens from one prefill's logits
        for lp, _ in lp_variants[:2]:
            for P in engine.prefill_row_buckets:
                tasks.append((f"fork {S} samples from {P} prefill rows" + (" (logprobs)" if lp else ""),
                              fork(S, P, lp)))
    tasks.append(("block copies", copies))
    return tasks
