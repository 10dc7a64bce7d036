"""Activated LoRA (aLoRA) vs all-token LoRA on a shared conversation (issue 26), round-robin in one run.

    python -m benchmarks.alora [--model PATH|tiny] [--conversation 1024] [--adapters 16] [--max-tokens 32]
                               [--repeats 3] [--json F]

A --conversation-token base conversation is served first (the base model, one generated token: its
KV blocks are now in the prefix cache). Then --adapters requests, one per adapter, each the
conversation + that adapter's own 4-token invocation sequence, generate --max-tokens greedy tokens,
all submitted at once. Variants (same LoRA weights, rank --rank on q/k/v/o, random non-zero):

* aLoRA: each adapter activated from its invocation (`PositionPolicy.activated`), the engine in
  PreFT mode ("prefill"; an activated adapter keeps its own policy). Every conversation block
  before the invocation is a base block: a prefix-cache hit, whatever the adapter, so each request
  prefills only its invocation; its generated tokens use the adapter.
* all-token LoRA: the same adapters acting on every token (engine mode "all"): nothing the base
  conversation computed can be reused, every request prefills the whole conversation.

Per variant and repeat (a fresh random conversation each repeat, so nothing carries over): TTFT
median and p90 of the burst, tok/s of the burst (generated tokens / wall), and prefix blocks hit /
missed by the burst. Median (min-max) over the repeats.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import header, load_runner, log, pct, round_robin, serve, spread, stats, write_json

TARGETS = ("q", "k", "v", "o")
INVOCATION_LEN = 4


def adapters(cfg, n: int, rank: int, seed: int = 0):
    """n random LoRA weights (benchmarks.prefix's; policy set by the caller) and n distinct invocations."""
    from benchmarks.prefix import adapters as random_loras
    weights = random_loras(cfg, n, rank, None, seed)
    rng = np.random.default_rng(seed + 1)
    invocations = set()
    while len(invocations) < n:
        invocations.add(tuple(int(t) for t in rng.integers(0, cfg.vocab_size, INVOCATION_LEN)))
    return weights, sorted(invocations)


def with_policy(w, policy):
    import dataclasses
    return dataclasses.replace(w, config=dataclasses.replace(w.config, policy=policy))


def make_engine(runner, weights, mode: str, args):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    n = len(weights)
    reg = AdapterRegistry(runner.cfg, n, lora_targets=TARGETS, lora_rank=args.rank, reft_rank=1, dtype=runner.dtype,
                          max_invocation_tokens=INVOCATION_LEN)
    for i, w in enumerate(weights):
        reg.load(f"a{i}", w)
    max_len = args.conversation + INVOCATION_LEN + args.max_tokens
    return Engine(runner, reg, EngineConfig(
        mode=mode, max_num_seqs=n, max_model_len=max_len, max_prefill_seqs=args.prefill_seqs,
        max_num_batched_tokens=n + args.prefill_tokens, block_size=args.block_size,
        kv_cache_tokens=(n + 1) * max_len, enable_prefix_cache=True, request_timeout=None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="'tiny' or a path; default SmolLM2-135M")
    ap.add_argument("--conversation", type=int, default=1024, help="tokens of the shared base conversation")
    ap.add_argument("--adapters", type=int, default=16, help="adapters = requests of the burst")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefill-seqs", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prefill tokens per step (plus one per row)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    from preft_jax.adapters.policy import PositionPolicy
    runner = load_runner(args.model)
    cfg = runner.cfg
    n = args.adapters
    log(header(runner, f"{args.conversation}-token base conversation, then {n} requests on {n} adapters "
                       f"(LoRA r={args.rank} q/k/v/o), each + its {INVOCATION_LEN}-token invocation -> "
                       f"{args.max_tokens} tokens"))
    weights, invocations = adapters(cfg, n, args.rank)
    variants = {
        "aLoRA (activated)": ("prefill", [with_policy(w, PositionPolicy.activated(inv))
                                          for w, inv in zip(weights, invocations)]),
        "all-token LoRA": ("all", [with_policy(w, PositionPolicy(mode="all")) for w in weights]),
    }
    names = [f"a{i}" for i in range(n)]

    def conversation(seed):
        return np.random.default_rng(seed).integers(0, cfg.vocab_size, args.conversation).tolist()

    engines = {}

    def case(label):
        def fn(rep):
            eng = engines[label]
            conv = conversation(rep)
            t0 = time.perf_counter()
            serve(eng, [conv], [None], 1)                         # the base conversation: cached blocks
            conv_s = time.perf_counter() - t0
            h0, m0 = eng.pool.stats.hits, eng.pool.stats.misses
            s = serve(eng, [conv + list(inv) for inv in invocations], names, args.max_tokens)
            return {"tok_per_s": s.tok_per_s, "wall_s": s.wall, "ttft_med_s": stats(s.ttft)[0],
                    "ttft_p90_s": pct(s.ttft, 90), "block_hits": eng.pool.stats.hits - h0,
                    "block_misses": eng.pool.stats.misses - m0, "conversation_s": conv_s}
        return fn

    for label, (mode, ws) in variants.items():
        t0 = time.perf_counter()
        engines[label] = make_engine(runner, ws, mode, args)
        # a prefill and a decode first: a fresh pool is uncommitted, and the programs a committed one
        # meets (after any decode call) compile again
        serve(engines[label], [conversation(9_999)[:64]], [None], 2)
        case(label)(10_000)                                       # compiles the shapes; uploads the adapters
        log(f"# {label}: engine mode {mode!r}, compiled + warmed up in {time.perf_counter() - t0:.0f} s")

    runs = round_robin({k: case(k) for k in engines}, args.repeats, log)
    base = stats(r["ttft_med_s"] for r in runs["all-token LoRA"])[0]
    log(f"\n| variant | burst TTFT median ms | TTFT p90 ms | all-token TTFT / this | burst tok/s | "
        f"prefix blocks hit / missed per burst | base conversation s |")
    log("|---|---:|---:|---:|---:|---:|---:|")
    for k, rs in runs.items():
        ttft = [r["ttft_med_s"] for r in rs]
        log(f"| {k} | {spread([x * 1e3 for x in ttft], '{:.0f}')} "
            f"| {spread([r['ttft_p90_s'] * 1e3 for r in rs], '{:.0f}')} "
            f"| {base / stats(ttft)[0]:.1f}x | {spread([r['tok_per_s'] for r in rs])} "
            f"| {stats(r['block_hits'] for r in rs)[0]:.0f} / {stats(r['block_misses'] for r in rs)[0]:.0f} "
            f"| {spread([r['conversation_s'] for r in rs], '{:.2f}')} |")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
