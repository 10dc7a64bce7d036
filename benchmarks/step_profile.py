"""Where one engine step's time goes (issue 11.5a): per-call device times of the vLLM-peer workload
and an XLA:CPU op profile of its decode step.

    python -m benchmarks.step_profile [--repeats 3] [--trace-steps 5] [--top 15] [--model tiny]
                                      [--adapter-dir /work/bench_data/adapters/r16_qkvo --n-adapters 8]

The base engine serves the peer workload once (32 requests x 16 random prompt tokens -> 32 greedy
tokens, benchmarks/peer.py) while `bare_loop.Recorder` keeps every jitted step call. Then:

1. Per-call times: the recorded calls are replayed through `paged_step`, each one timed to
   completion (block_until_ready), `--repeats` times: the prefill call and the decode calls'
   median, and their sum (the workload's device time with nothing overlapped). With
   `--adapter-dir` (PEFT folders lora_0 .. lora_{N-1}, benchmarks/vllm_peer/prepare.py) a PreFT
   engine serves the same prompts too, each request on a random one of the N adapters (peer.py's
   engine), and both engines' calls are replayed round-robin, repeat after repeat.
2. Op profile: one mid-run decode call is run `--trace-steps` times under `jax.profiler.trace`; the
   trace's complete events are grouped by op name without its numeric suffix (`ynn_fusion.12` ->
   `ynn_fusion`) and printed as thread-milliseconds per step. XLA:CPU runs ops on two threads, so a
   column can add up to more than the step's wall time ("ThunkExecutor::Execute (wait for
   completion)" is the wall time of the step on the calling thread).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

import jax
import numpy as np

from benchmarks.bare_loop import Recorder, replay, served_engine
from benchmarks.common import header, load_runner, log, random_prompts, serve

_SUFFIX = re.compile(r"[.\d]+$")


def op_table(events, steps: int) -> dict[str, tuple[float, float]]:
    """Chrome-trace events -> {op name without numeric suffix: (thread-ms per step, calls per step)},
    largest first. Only complete events ("ph" == "X") on threads count; Python frames ("$...") are
    dropped."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("name", "").startswith("$"):
            continue
        name = _SUFFIX.sub("", e["name"])
        total[name] += float(e.get("dur", 0.0))
        count[name] += 1
    return {k: (v / steps / 1e3, count[k] / steps) for k, v in total.most_common()}


def _timed(engine, staged) -> list[float]:
    """Seconds of each staged call, each run to completion, on a fresh KV pool."""
    cache = engine.step_runner.new_cache()
    jax.block_until_ready(cache.k)
    times = []
    for call in staged:
        t0 = time.perf_counter()
        nxt, cache = replay(engine, call, cache)
        jax.block_until_ready(nxt)
        times.append(time.perf_counter() - t0)
    return times


def _trace(engine, call, steps: int) -> dict[str, tuple[float, float]]:
    cache = engine.step_runner.new_cache()
    for _ in range(2):
        nxt, cache = replay(engine, call, cache)
    jax.block_until_ready(nxt)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                nxt, cache = replay(engine, call, cache)
            jax.block_until_ready(nxt)
        files = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)
        if not files:
            raise RuntimeError("jax.profiler wrote no perfetto trace")
        data = json.load(gzip.open(files[0]))
    return op_table(data["traceEvents"] if isinstance(data, dict) else data, steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="'tiny', a GGUF/HF path, or the embedded SmolLM2-135M")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=5, help="decode calls traced (0: no op profile)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--adapter-dir", default=None, help="PEFT folders lora_0 .. lora_{N-1}: also time a PreFT engine")
    ap.add_argument("--n-adapters", type=int, default=8)
    args = ap.parse_args(argv)
    runner = load_runner(args.model)
    V = runner.cfg.vocab_size
    log(header(runner, f"{args.requests} requests x {args.prompt_len} -> {args.max_tokens} tokens"))
    recorded = {}
    variants = {"base": None, **({"PreFT-LoRA": args.adapter_dir} if args.adapter_dir else {})}
    for label, adir in variants.items():
        engine, picks = served_engine(runner, adir, 1, args)
        rec = Recorder(engine)
        served = serve(engine, random_prompts(args.requests, args.prompt_len, V, 0), picks, args.max_tokens)
        recorded[label] = (engine, rec.staged())
        log(f"{label} engine: {served.tok_per_s:.1f} tok/s, {len(recorded[label][1])} calls")
    for engine, staged in recorded.values():
        _timed(engine, staged)                                       # untimed: every shape once
    runs = {k: [] for k in recorded}
    for _ in range(args.repeats):
        for label, (engine, staged) in recorded.items():
            runs[label].append(_timed(engine, staged))
    runs = {k: np.array(v) * 1e3 for k, v in runs.items()}
    staged = recorded["base"][1]
    cols = list(runs)
    log("\n| per-call device time, median ms (min-max over repeats) | " + " | ".join(cols) + " |")
    log("|---|" + "---:|" * len(cols))
    cell = lambda xs: f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})"
    log(f"| prefill ({staged[0].rows} rows x {staged[0].chunk}) | "
        + " | ".join(cell(runs[k][:, 0]) for k in cols) + " |")
    log(f"| decode step ({staged[-1].rows} rows), median of {len(staged) - 1} | "
        + " | ".join(cell([statistics.median(r[1:]) for r in runs[k]]) for k in cols) + " |")
    log(f"| all {len(staged)} calls | " + " | ".join(cell(runs[k].sum(1)) for k in cols) + " |")
    if len(cols) > 1:
        ratio = runs[cols[1]][:, 0] / runs["base"][:, 0]
        log(f"# prefill {cols[1]} / base: {statistics.median(ratio):.2f}x "
            f"({ratio.min():.2f}-{ratio.max():.2f}x per repeat)")
    engine = recorded["base"][0]
    if args.trace_steps > 0:
        table = _trace(engine, staged[len(staged) // 2], args.trace_steps)
        log(f"\n| op (decode step, {args.trace_steps} traced) | thread-ms per step | calls per step |")
        log("|---|---:|---:|")
        for name, (ms, n) in list(table.items())[:args.top]:
            log(f"| {name} | {ms:.2f} | {n:g} |")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
