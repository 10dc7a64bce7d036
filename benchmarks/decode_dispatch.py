"""Host time of one decode dispatch (issue 25.2's budget): what `StepRunner.dispatch_decode` costs the
engine thread per decode step - updating the persistent decode rows, the one transfer of their
buffer and the jitted call's dispatch - with the device idle before each call (so no queueing).

    python -m benchmarks.decode_dispatch [--model tiny] [--rows 64] [--calls 400]

The engine serves `--rows` requests of 16 random prompt tokens until every one decodes, then the same
decode rows are dispatched `--calls` times, each timed from the call to its return (asynchronous
dispatch) and then waited for: a plain call (input tokens from the host) and a pipelined one (input
tokens from the previous call's output, on the device). Printed: median and p10 (the least disturbed
by other load) after 50 untimed calls.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.common import NO_STOP, header, load_runner, log, positive_int


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny', a GGUF/HF path, or the embedded SmolLM2-135M")
    ap.add_argument("--rows", type=positive_int, default=64)
    ap.add_argument("--calls", type=positive_int, default=400)
    args = ap.parse_args(argv)
    from preft_jax.sampling import SamplingParams
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    runner = load_runner(args.model)
    R = args.rows
    eng = Engine(runner, AdapterRegistry(runner.cfg, 0), EngineConfig(
        max_num_seqs=R, max_model_len=64, max_prefill_seqs=R, max_num_batched_tokens=R + 16 * R,
        enable_prefix_cache=False, num_scheduler_steps=1))
    log(header(runner, f"{R} decode rows"))
    rng = np.random.default_rng(0)
    for _ in range(R):
        eng.submit(rng.integers(0, runner.cfg.vocab_size, 16).tolist(), None,
                   SamplingParams(max_new_tokens=40, stop_token_ids=NO_STOP))
    while any(s.status != "decode" for s in eng.scheduler.running) or eng.queued:
        eng.step()
    seqs, dispatch = list(eng.scheduler.running), eng.step_runner.dispatch_decode
    assert all(eng.scheduler.grow(s, s.num_computed + 2) for s in seqs)    # a home for the pipelined position
    for label, pipelined in (("plain", False), ("pipelined", True)):
        prev = dispatch(seqs)
        jax.block_until_ready(prev.out)
        times = []
        for _ in range(args.calls + 50):
            t0 = time.perf_counter()
            cur = dispatch(seqs, after=prev if pipelined else None)
            times.append(time.perf_counter() - t0)
            jax.block_until_ready(cur.out)
            prev = cur
        t = np.asarray(times[50:]) * 1e3
        log(f"{label} decode dispatch, {R} rows: median {statistics.median(t):.3f} ms, p10 {np.percentile(t, 10):.3f} ms")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
