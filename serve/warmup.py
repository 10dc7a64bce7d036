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
  compiles any more. A task that fails is retried once, then skipped (one log line each; /health
  reports `warmup_pending` and `warmup_failed`).

Each task is a shape only: it reads the adapter bank and the KV pool from their owners when it runs
(`StepRunner.compile_*`), never earlier, since an adapter upload replaces the bank in between.
"""
from __future__ import annotations

import gc
import logging
import time
from typing import TYPE_CHECKING, Callable

import jax.numpy as jnp

if TYPE_CHECKING:
    from serve.step_runner import StepRunner

Task = tuple[str, Callable[[], None]]

log = logging.getLogger("serve.warmup")


def freeze_heap(gen0_threshold: int = 0) -> float:
    """After warm-up: collect once, then move every object alive now (modules, weights' Python
    objects, compiled programs: ~400k objects in a tiny-model server) out of the garbage
    collector's generations (`gc.freeze`, as vLLM does after startup). A full collection otherwise
    walks them all (~0.2 s on this 2-core machine: `python -m benchmarks.bare_loop` showed it as a
    0.26 s run among 0.05 s ones) while every stream waits; after it, ~0.02 ms. Objects frozen
    are never collected as cycles until `thaw_heap`.

    `gen0_threshold` (> 0): the young generation's threshold from now on (Python's default 700).
    A young collection runs when the container objects allocated and not yet freed pass it; a
    serving engine keeps every token's event (a tuple and a list) alive until its consumer reads
    it, so at 700 a 64-row batch triggered one every ~5 decode calls (~0.2 ms each on this
    machine, and every 10th a ~1 ms older-generation pass: ~2% of a burst's wall) for objects
    that are freed by reference counting anyway. Returns the seconds the collection took."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    if gen0_threshold > 0:
        global _thresholds
        if _thresholds is None:
            _thresholds = gc.get_threshold()
        gc.set_threshold(gen0_threshold, *_thresholds[1:])
    dt = time.perf_counter() - t0
    log.debug("gc: %d startup objects frozen (collect %.3f s), thresholds %s", gc.get_freeze_count(), dt,
              gc.get_threshold())
    return dt


_thresholds: tuple | None = None      # the collector's thresholds before `freeze_heap` changed them


def thaw_heap() -> None:
    """Undoes `freeze_heap` (at engine shutdown: an engine's own cycles become collectable again,
    at the collector's thresholds from before)."""
    global _thresholds
    gc.unfreeze()
    if _thresholds is not None:
        gc.set_threshold(*_thresholds)
        _thresholds = None


def warmup_tasks(runner: "StepRunner") -> list[Task]:
    """(label, run) per program to compile, cheapest first: the one-row prefill and the shortest
    decode before the large buckets, so a background warm-up covers a lone first request early.
    Each run calls the runner's own step on padding rows (every K/V write is dropped)."""
    c = runner.config
    V = runner.model.cfg.vocab_size
    lp_variants = [(False, False), (True, False), (True, True)] if c.warmup_logprobs else [(False, False)]
    logits = {}              # prefill rows -> logits as the step returns them (placement included)

    def prefill(P, C, nb, lp, plp):
        def run():
            logits[P] = runner.compile_prefill(P, C, nb, lp, plp)
        return run

    def decode(nb, lp, adapted, steps=1):
        return lambda: runner.compile_decode(nb, lp, adapted, steps)

    def fork(S, P, lp):
        return lambda: runner.compile_forks(S, logits[P] if P in logits else jnp.zeros((P, V), jnp.float32), lp)

    prefills = [(f"prefill {P} rows, chunk {C} tokens, context {nb} blocks" + (" (logprobs)" if lp else ""),
                 prefill(P, C, nb, lp, plp))
                for P, C, nb in runner.prefill_buckets() for lp, plp in lp_variants]
    # decode without the bank (base and PreFT rows) and, with adapter slots, with it (rows whose
    # generated tokens use their adapter: mode "all", activated adapters); the engine's usual one first
    variants = [False] + [True] * (runner.registry.bank is not None)
    if c.mode == "all":
        variants.reverse()
    decodes = [(f"decode (context {nb} blocks)" + (" (logprobs)" if lp else "") + (" (adapted)" if adapted else ""),
                decode(nb, lp, adapted))
               for adapted in variants for nb in runner.block_buckets for lp, _ in lp_variants[:2]]
    k = c.decode_steps_per_call                    # fused calls (never with log-probabilities)
    if k > 1:
        decodes += [(f"decode x{k} steps (context {nb} blocks)" + (" (adapted)" if adapted else ""),
                     decode(nb, False, adapted, k)) for adapted in variants for nb in runner.block_buckets]
    # the smallest prefill and decode first (what a lone first request needs), then the rest in order
    tasks: list[Task] = [prefills[0], decodes[0], *prefills[1:], *decodes[1:]]
    for S in runner.fork_buckets:                  # n > 1: first tokens from one prefill's logits
        for lp, _ in lp_variants[:2]:
            for P in runner.prefill_row_buckets:
                tasks.append((f"fork {S} samples from {P} prefill rows" + (" (logprobs)" if lp else ""),
                              fork(S, P, lp)))
    tasks.append(("block copies", runner.compile_copies))
    return tasks
