"""The native CPU decode step vs XLA's, side by side: ms per decode call of the engine's own step.

    python -m benchmarks.native_decode [--model tiny] [--rows 1 8 32 64] [--repeats 5] [--calls 8]
    python -m benchmarks.native_decode --model tiny --rows 64 --prompt-len 1024    # attention-bound

For each `--rows` value, two engines (`EngineConfig.cpu_decode` "native" and "xla"; base weights,
greedy) serve that many requests of `--prompt-len` (16) random prompt tokens -> 32 tokens once,
recording their step calls (benchmarks.bare_loop's Recorder); one recorded decode call of each (the
11th: every row decoding, ~10 tokens past the prompt) is then replayed `--calls` times back to back on its own KV pool
(donated and fed back), the two variants alternating `--repeats` times. Printed: median (min-max) ms
per call and native / XLA speed (XLA ms / native ms: > 1 when native is faster), and how many of the
served requests' 32 greedy tokens were equal on the two paths. The engine's
`cpu_decode="auto"` takes the native step wherever it can serve; this is what that choice is worth on
this CPU (the header names it and whether it has AVX-512: decode.cc's GEMM tile differs).
"""
from __future__ import annotations

import argparse
import functools
import sys
import time

import jax

from benchmarks.common import (cpu_model, load_runner, log, positive_int, random_prompts, round_robin, serve, spread,
                               stats)


def recorded_decode(runner, rows: int, mode: str, prompt_len: int = 16):
    """(engine, one recorded decode call of its step, a fresh KV pool, the served requests' tokens) for
    cpu_decode=`mode`."""
    from benchmarks import bare_loop as bl
    from serve.step_runner import DecodeCall
    args = argparse.Namespace(requests=rows, prompt_len=prompt_len, max_tokens=32, n_adapters=8, cpu_decode=mode)
    eng, picks = bl.served_engine(runner, None, 4, args, 1)
    if mode == "native" and eng.step_runner.native is None:
        sys.exit("the native decode step is unavailable here (see the log line above)")
    rec = bl.Recorder(eng)
    served = serve(eng, random_prompts(rows, prompt_len, runner.cfg.vocab_size, 5), picks, 32)
    calls = [c for c in rec.staged() if isinstance(c, DecodeCall)]
    return eng, calls[min(10, len(calls) - 1)], eng.step_runner.new_cache(), served.outputs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="'tiny', a GGUF/HF path, or the embedded SmolLM2-135M (default)")
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--prompt-len", type=positive_int, default=16, help="prompt tokens per request (the replayed "
                    "call attends to ~10 more)")
    ap.add_argument("--calls", type=positive_int, default=8, help="decode calls per timed repeat")
    args = ap.parse_args(argv)
    runner = load_runner(args.model)
    cfg = runner.cfg
    log(f"# {jax.devices()[0].platform}, {cpu_model()}; model layers={cfg.n_layers} d={cfg.d_model} "
        f"vocab={cfg.vocab_size}, float32; prompts of {args.prompt_len} tokens; {args.calls} calls per repeat, "
        f"{args.repeats} repeats round-robin")
    log("| rows | native ms per call | XLA ms per call | native / XLA speed (median, per-repeat range) |")
    log("|---:|---:|---:|---:|")
    for rows in args.rows:
        cases = {m: list(recorded_decode(runner, rows, m, args.prompt_len)) for m in ("native", "xla")}
        same = sum(a == b for a, b in zip(cases["native"].pop(), cases["xla"].pop()))

        def timed(_rep, case):
            eng, call, cache = case
            out, cache = eng.step_runner.run_on(call, cache)            # untimed: this pool's first call
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                out, cache = eng.step_runner.run_on(call, cache)
            jax.block_until_ready(out)
            dt = time.perf_counter() - t0
            case[2] = cache
            return {"tok_per_s": rows * args.calls / dt, "ms": dt / args.calls * 1e3}

        runs = round_robin({m: functools.partial(timed, case=c) for m, c in cases.items()}, args.repeats,
                           lambda _line: None)
        times = {m: [r["ms"] for r in v] for m, v in runs.items()}
        med, lo, hi = stats(x / n for n, x in zip(times["native"], times["xla"]))
        log(f"| {rows} | {spread(times['native'], '{:.2f}')} | {spread(times['xla'], '{:.2f}')} | "
            f"{med:.2f}x ({lo:.2f}-{hi:.2f}x) |")
        log(f"# {rows} rows: greedy outputs equal, native vs XLA: {same} of {rows} requests")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
