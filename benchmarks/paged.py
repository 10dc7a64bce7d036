"""Paged KV cache vs fixed-slot reservation at equal KV memory (issue 11.5b), round-robin in one run.

    python -m benchmarks.paged [--kv-tokens 4096] [--max-model-len 512] [--requests 64] [--repeats 3] [--json F]

Both variants get the same KV pool (--kv-tokens tokens of K and V, every layer) and serve the same
mixed-length requests (prompt and output lengths uniform in --prompt-range / --output-range; all
submitted at once, greedy, no early stop, prefix cache off):

  fixed-slot   the old engine's reservation, emulated with the paged engine: block_size = max_model_len,
               so every admitted sequence takes one block of max_model_len tokens for its whole life,
               and max_num_seqs = kv_tokens // max_model_len (the slots that memory holds).
               Decode attends over the whole reserved block, as a static per-slot cache does.
  paged R=n    block_size 16: a sequence holds only the blocks its tokens fill; admission goes on while
               blocks last, up to n decode rows (preemption by recompute if the pool runs out).

Reported per variant: tok/s, peak and mean running sequences, median TTFT, preemptions.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import header, load_runner, log, round_robin, serve, spread, stats, write_json


def make_engine(runner, *, block_size, rows, args):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    return Engine(runner, AdapterRegistry(runner.cfg, 0), EngineConfig(
        max_num_seqs=rows, max_model_len=args.max_model_len, max_prefill_seqs=args.prefill_seqs,
        max_num_batched_tokens=rows + args.prefill_tokens, block_size=block_size,
        kv_cache_tokens=args.kv_tokens, enable_prefix_cache=False))


def workload(args, vocab, seed):
    rng = np.random.default_rng(seed)
    plens = rng.integers(args.prompt_range[0], args.prompt_range[1] + 1, args.requests)
    outs = rng.integers(args.output_range[0], args.output_range[1] + 1, args.requests)
    return [rng.integers(0, vocab, int(n)).tolist() for n in plens], [int(m) for m in outs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="'tiny' or a path; default SmolLM2-135M")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-range", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--output-range", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--paged-rows", type=int, nargs="+", default=[32, 64], help="max_num_seqs of the paged variants")
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-tokens", type=int, default=256, help="prefill tokens per step (plus one per row)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.prompt_range[1] + args.output_range[1] > args.max_model_len:
        ap.error("the longest prompt + output must fit --max-model-len")
    t_all = time.perf_counter()
    runner = load_runner(args.model)
    from preft_jax.paged_kv import PagedKVCache
    bpt = PagedKVCache.bytes_per_token(runner.cfg, runner.dtype)
    fixed_rows = args.kv_tokens // args.max_model_len
    log(header(runner, f"KV pool {args.kv_tokens} tokens = {args.kv_tokens * bpt / 2**20:.0f} MiB for every variant, "
                       f"max_model_len {args.max_model_len}, {args.requests} requests, prompts "
                       f"{args.prompt_range[0]}-{args.prompt_range[1]} tokens, outputs "
                       f"{args.output_range[0]}-{args.output_range[1]} tokens"))
    variants = {f"fixed-slot ({fixed_rows} slots)": dict(block_size=args.max_model_len, rows=fixed_rows)}
    variants.update({f"paged R={r}": dict(block_size=16, rows=r) for r in args.paged_rows})
    engines = {}
    for name, kw in variants.items():
        t0 = time.perf_counter()
        eng = engines[name] = make_engine(runner, args=args, **kw)
        eng.warmup()
        log(f"# {name}: {eng.pool.capacity} blocks of {kw['block_size']} tokens, max_num_seqs {kw['rows']}; "
            f"compiled in {time.perf_counter() - t0:.0f} s")

    def case(name):
        def fn(rep):
            eng = engines[name]
            prompts, outs = workload(args, runner.cfg.vocab_size, rep)
            pre0 = eng.scheduler.preemptions
            s = serve(eng, prompts, [None] * len(prompts), outs)
            assert eng.pool.num_available == eng.pool.capacity
            return {"tok_per_s": s.tok_per_s, "wall_s": s.wall, "peak_running": s.max_running,
                    "mean_running": s.mean_running, "ttft_med_s": stats(s.ttft)[0],
                    "preemptions": eng.scheduler.preemptions - pre0}
        return fn

    runs = round_robin({n: case(n) for n in variants}, args.repeats, log)
    fixed = next(iter(runs))
    ref = stats(r["tok_per_s"] for r in runs[fixed])[0]
    log("\n| variant | KV blocks x tokens | max_num_seqs | peak running | mean running | tok/s median (min-max) "
        "| vs fixed-slot | median TTFT s | preemptions |")
    log("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rs in runs.items():
        eng, tps = engines[name], [r["tok_per_s"] for r in rs]
        log(f"| {name} | {eng.pool.capacity} x {eng.config.block_size} | {eng.config.max_num_seqs} "
            f"| {max(r['peak_running'] for r in rs)} | {stats(r['mean_running'] for r in rs)[0]:.1f} "
            f"| {spread(tps)} | {stats(tps)[0] / ref:.2f}x | {spread([r['ttft_med_s'] for r in rs], '{:.2f}')} "
            f"| {sum(r['preemptions'] for r in rs)} |")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
