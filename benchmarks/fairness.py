"""Fairness under one expensive request: does a small request behind a big one still answer quickly?

    python -m benchmarks.fairness                     # the embedded SmolLM2-135M, issue 23's scenarios
    python -m benchmarks.fairness --model tiny --prompts 8 --repeats 2     # a quick look

Scenarios (each timed round-robin with the others, `--repeats` times, median (min-max)):
* `echo 1 prompt`: one prompt of `--prompt-len` ids, `echo` + 20 prompt logprobs, max_tokens 1,
  against the same prompt without logprobs (the cost of prompt logprobs per token);
* `big + small`: a big request (`--prompts` prompts of `--prompt-len` ids, echo + 20 prompt logprobs,
  max_tokens 1) is submitted; after its first engine step a small request (a 2-token answer to a
  short prompt) is submitted. Reported: the big request's wall time, the small request's latency
  (submit to last token) behind it, and the small request alone on an idle engine;
* `many seqs + small`: the same with a big request of `--prompts` x n=2 sequences of 32 tokens.

The engine is stepped in this process (`Engine.step`), as its background loop does.
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import NO_STOP, header, load_runner, log, random_prompts, round_robin, spread, write_json
from preft_jax.sampling import SamplingParams


def build_engine(runner, args):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.prompt_len + 64,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_seqs=4)
    return Engine(runner, AdapterRegistry(runner.cfg, 0), cfg)


def run_until(engine, handles) -> float:
    t0 = time.perf_counter()
    while any(not h.finished for h in handles):
        engine.step()
    for h in handles:
        if h.error is not None:
            raise h.error
    return time.perf_counter() - t0


def small_request(engine, vocab: int):
    return engine.submit(random_prompts(1, 8, vocab, 99)[0], None,
                         SamplingParams(max_new_tokens=2, stop_token_ids=NO_STOP))


def big_with_small(engine, big_prompts, sampling, n: int, vocab: int) -> dict:
    t0 = time.perf_counter()
    big = []
    for p in big_prompts:
        big += engine.submit_n(p, None, sampling, n, group="big")
    engine.step()
    small = small_request(engine, vocab)
    t_small = time.perf_counter()
    steps0 = engine.steps
    while not small.finished:
        engine.step()
    small_s, small_steps = time.perf_counter() - t_small, engine.steps - steps0
    big_done_before = all(h.finished for h in big)
    run_until(engine, big)
    return {"big_s": time.perf_counter() - t0, "small_s": small_s, "small_steps": small_steps,
            "big_first": float(big_done_before)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fairness", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="'tiny', a .gguf / HF folder path, or None: the embedded SmolLM2-135M")
    ap.add_argument("--prompts", type=int, default=16, help="prompts in the big request")
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runner = load_runner(args.model)
    vocab = runner.cfg.vocab_size
    engine = build_engine(runner, args)
    log(header(runner, f"big request {args.prompts} x {args.prompt_len} ids; step budget "
                       f"{args.max_num_batched_tokens} tokens"))
    fresh = iter(range(10 ** 6))          # a new prompt per run: the prefix cache would serve a repeat

    def one():
        return random_prompts(1, args.prompt_len, vocab, 1000 + next(fresh))[0]

    bigs = random_prompts(args.prompts, args.prompt_len, vocab, 2)
    shorts = random_prompts(args.prompts, 16, vocab, 3)     # shorter than a full block: never prefix-cached
    echo = SamplingParams(max_new_tokens=1, stop_token_ids=NO_STOP, prompt_logprobs=20)
    plain = SamplingParams(max_new_tokens=1, stop_token_ids=NO_STOP)
    many = SamplingParams(max_new_tokens=32, stop_token_ids=NO_STOP, temperature=0.7)

    def timed(fn):
        def case(_rep):
            t0 = time.perf_counter()
            out = fn() or {}
            return {"wall_s": time.perf_counter() - t0, **out}
        return case

    cases = {
        "1 prompt, no logprobs": timed(lambda: run_until(engine, [engine.submit(one(), None, plain)]) and None),
        "1 prompt, echo+logprobs 20": timed(lambda: run_until(engine, [engine.submit(one(), None, echo)]) and None),
        "small alone": timed(lambda: run_until(engine, [small_request(engine, vocab)]) and None),
        "big echo + small": timed(lambda: big_with_small(engine, bigs, echo, 1, vocab)),
        "many seqs (n=2) + small": timed(lambda: big_with_small(engine, shorts, many, 2, vocab)),
    }
    for name, fn in cases.items():          # compile every shape once, untimed
        fn(-1)
    runs = round_robin(cases, args.repeats, log=log)
    log("")
    log("| scenario | wall s | small request s (behind) | small request steps | big finished first |")
    log("|---|---:|---:|---:|---:|")
    for name, rs in runs.items():
        small = spread([r["small_s"] for r in rs], "{:.2f}") if "small_s" in rs[0] else "-"
        steps = spread([r["small_steps"] for r in rs], "{:.0f}") if "small_steps" in rs[0] else "-"
        first = f"{sum(r['big_first'] for r in rs):.0f}/{len(rs)}" if "big_first" in rs[0] else "-"
        log(f"| {name} | {spread([r['wall_s'] for r in rs], '{:.2f}')} | {small} | {steps} | {first} |")
    med = {k: sorted(r["wall_s"] for r in v)[len(v) // 2] for k, v in runs.items()}
    log(f"# echo+logprobs / plain for one {args.prompt_len}-token prompt: "
        f"{med['1 prompt, echo+logprobs 20'] / med['1 prompt, no logprobs']:.2f}x")
    write_json(args.json, runs)
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
