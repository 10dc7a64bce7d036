"""Prefix cache on a shared system prompt across adapters (issue 11.5c), on vs off, round-robin in one run.

    python -m benchmarks.prefix [--requests 64] [--system-len 256] [--repeats 3] [--json F]

64 LoRA adapters (rank 16, q/k/v/o, random non-zero) whose position policy is last_k = --last-k: each
adapts only the last k prompt tokens, so a prompt's leading 256-token system prompt runs on the base
weights and its KV blocks are the same whatever the adapter (the prefix cache keys them without the
adapter: `kv_blocks.block_hashes`). Each request = the shared system prompt + --user-len fresh random
tokens, one adapter per request (request i -> adapter i), --max-tokens greedy tokens, no early stop.
Repeat r draws new user tokens (same system prompt), so only the system prompt can hit.

Variants: prefix cache on / off (same engine config otherwise; PreFT mode, --slots device slots).
Burst: all requests submitted at once (tok/s, TTFT median and p90). Then single requests on the idle
engine (TTFT of one request alone), interleaved on/off.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import header, load_runner, log, pct, round_robin, serve, spread, stats, write_json


def adapters(cfg, n, rank, last_k, seed=0):
    from preft_jax.adapters.config import LoraConfig, LoraWeights
    from preft_jax.adapters.policy import PositionPolicy
    targets = ("q", "k", "v", "o")
    dims, L = cfg.projection_dims(), cfg.n_layers
    conf = LoraConfig(rank=rank, alpha=float(2 * rank), targets=targets, policy=PositionPolicy(last_k=last_k))
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        A = {t: (rng.standard_normal((L, dims[t][0], rank)) / np.sqrt(dims[t][0])).astype(np.float32) for t in targets}
        B = {t: (0.02 * rng.standard_normal((L, rank, dims[t][1]))).astype(np.float32) for t in targets}
        out.append(LoraWeights(conf, A, B))
    return out


def make_engine(runner, weights, prefix_cache, args):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    reg = AdapterRegistry(runner.cfg, args.slots, lora_targets=("q", "k", "v", "o"), lora_rank=args.rank,
                          reft_rank=1, dtype=runner.dtype)
    for i, w in enumerate(weights):
        reg.load(f"a{i}", w)
    R = args.requests
    return Engine(runner, reg, EngineConfig(
        max_num_seqs=R, max_model_len=args.system_len + args.user_len + args.max_tokens,
        max_prefill_seqs=args.prefill_seqs, max_num_batched_tokens=R + args.prefill_tokens,
        enable_prefix_cache=prefix_cache))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="'tiny' or a path; default SmolLM2-135M")
    ap.add_argument("--requests", type=int, default=64, help="requests = adapters (request i uses adapter i)")
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=16)
    ap.add_argument("--last-k", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=16, help="device adapter slots")
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=512, help="prefill tokens per step (plus one per row)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--singles", type=int, default=6, help="single-request TTFT samples per variant")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    runner = load_runner(args.model)
    cfg = runner.cfg
    log(header(runner, f"{args.requests} requests = {args.requests} LoRA adapters (r={args.rank} q/k/v/o, "
                       f"last_k={args.last_k}), system prompt {args.system_len} + user {args.user_len} tokens -> "
                       f"{args.max_tokens} tokens, {args.slots} device slots"))
    weights = adapters(cfg, args.requests, args.rank, args.last_k)
    system = np.random.default_rng(12345).integers(0, cfg.vocab_size, args.system_len).tolist()
    names = [f"a{i}" for i in range(args.requests)]

    def prompts(seed, n=args.requests):
        rng = np.random.default_rng(seed)
        return [system + rng.integers(0, cfg.vocab_size, args.user_len).tolist() for _ in range(n)]

    engines = {}
    for label, on in (("prefix cache on", True), ("prefix cache off", False)):
        t0 = time.perf_counter()
        eng = engines[label] = make_engine(runner, weights, on, args)
        eng.warmup()
        serve(eng, prompts(999), names, 2)                    # uploads adapters; on: caches the system prompt
        log(f"# {label}: compiled + warmed up in {time.perf_counter() - t0:.0f} s")

    def case(label):
        def fn(rep):
            eng = engines[label]
            h0, m0 = eng.pool.stats.hits, eng.pool.stats.misses
            s = serve(eng, prompts(rep), names, args.max_tokens)
            return {"tok_per_s": s.tok_per_s, "wall_s": s.wall, "ttft_med_s": stats(s.ttft)[0],
                    "ttft_p90_s": pct(s.ttft, 90), "block_hits": eng.pool.stats.hits - h0,
                    "block_misses": eng.pool.stats.misses - m0}
        return fn

    runs = round_robin({k: case(k) for k in engines}, args.repeats, log)
    singles = {k: [] for k in engines}
    for i in range(args.singles):
        for label, eng in engines.items():
            p = prompts(5000 + i, 1)
            singles[label].append(serve(eng, p, [names[(7 * i) % len(names)]], args.max_tokens).ttft[0])
        log(f"single {i}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in singles.items()))

    off = stats(r["tok_per_s"] for r in runs["prefix cache off"])[0]
    log("\n| variant | burst tok/s median (min-max) | vs off | burst TTFT median s | burst TTFT p90 s "
        "| single-request TTFT ms | prefix block hits / misses per burst |")
    log("|---|---:|---:|---:|---:|---:|---:|")
    for k, rs in runs.items():
        tps = [r["tok_per_s"] for r in rs]
        log(f"| {k} | {spread(tps)} | {stats(tps)[0] / off:.2f}x | {spread([r['ttft_med_s'] for r in rs], '{:.2f}')} "
            f"| {spread([r['ttft_p90_s'] for r in rs], '{:.2f}')} | {spread([x * 1e3 for x in singles[k]], '{:.0f}')} "
            f"| {stats(r['block_hits'] for r in rs)[0]:.0f} / {stats(r['block_misses'] for r in rs)[0]:.0f} |")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"args": vars(args), "runs": runs, "singles": singles})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
