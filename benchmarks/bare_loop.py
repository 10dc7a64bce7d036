"""Engine overhead (issue 12.2): engine tok/s vs a bare loop of the jitted step at the same shapes.

    python -m benchmarks.bare_loop [--bench-dir /work/bench_data] [--repeats 5] [--json F]
    python -m benchmarks.bare_loop --model tiny --rows 64       # host overhead per step, tiny model

Workload: 32 requests (`--rows`: the decode rows, one per request) x 16 random prompt tokens -> 32
greedy tokens, all submitted at once (the vLLM-peer workload, benchmarks/peer.py), `--bursts` (8)
rounds of it back to back per repeat. Each engine run records every jitted step call the engine makes (`StepRunner.add_call_hook`: each call object,
its arguments already on the device). The bare loop then replays exactly those calls back to back
(`StepRunner.run_on`) - the same shapes, the same number of calls, inputs already on the device,
one final `block_until_ready` - with no scheduler, no block tables built, no token handling: the
device time the engine cannot go below. Ratio = engine tok/s / bare
tok/s (same tokens), per repeat, recorded and replayed in the same repeat.

Variants (round-robin): base and PreFT-LoRA (8 PEFT LoRA folders, rank 16 q/k/v/o, mode prefill),
each with num_scheduler_steps 4 (the default: pipelined decode calls) and 1, and with
decode_steps_per_call 4 (`--fused`: four decode steps fused in each pipelined call). PreFT-LoRA runs
when its adapter folders exist (`--adapter-dir`, default <bench-dir>/adapters/r16_qkvo for the
default model; none for `--model`). "host us per call" = (engine wall - bare wall) / device calls (all bursts):
the engine's host work per step that the device did not hide. "host CPU us per call": the host
thread's CPU time (`time.thread_time`) per device call, engine and bare loop (its dispatches
only): all the host's work, hidden or not - on a CPU "device" the host shares the cores with the
computation, so hidden work still slows it. `--host-probe` adds two bare loops per repeat with a
host beside them that reads each call's output and then sleeps, or computes, for the engine's
host-only time per call: "bare with host asleep / bare" is what that much host work costs a device
that does not share the host's cores (an accelerator: ~1.00 when the pipelining hides it), "bare
with host busy / bare" what it costs this CPU, whose cores the device shares.

Burst edges (a second table; medians over a variant's timed bursts), where no device call is in
flight: "submit" (the burst's requests submitted) and "submit -> first call" (the step that
schedules them, builds the prefill call and dispatches it), timed in the engine runs; "last tokens
-> done" (the last call's tokens handed out and every request finished), timed in the host-only
replay, where each output is there at once. "edges / bare" is their sum over the bare loop's time
per burst: the share of the engine's gap they explain.

Burst pairs (a third table, `--pairs`, 200 by default): after the repeats, each variant's engine
serves one burst and the bare loop replays that burst's calls at once, the variants alternating
burst by burst. Per variant: engine / bare over all the pairs (all bare-loop wall over all engine
wall, the same tokens: the engine's slow bursts count in full), the same over each half of the
pairs, and the per-pair ratio's median and quartiles. On a 2-core VM whose speed drifts over
seconds, the repeats' medians of the same code spread 0.78-0.91x over twelve runs; 200 pairs
(~10 s per variant on the tiny model) gave 0.82-0.84x in three runs within a minute (the machine's
own drift over tens of minutes still moves them a few points: compare variants within one run).

CPU binding (`--cpu-binding`, serve/cpu_binding.py; off by default, as in the engine): `on` gives
this script's thread, which steps every engine and runs every bare loop, a core of its own and the
runtime's threads the others; both loops run under the same placement. A fourth table
(`--binding-pairs`, 100 by default, after the engines above are shut down) prices it side by side:
one more engine of the first variant, its bursts served and replayed with this thread bound and
unbound, alternating burst by burst; "engine speed bound / unbound" is its unbound engine wall over
its bound engine wall.

The last line is the first variant's (base, the first `--steps` value: 4 by default) engine / bare
ratio over its burst pairs (with `--pairs 0`: the median of the repeats), its last number.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import jax
import numpy as np

from benchmarks.common import (header, load_runner, log, positive_int, random_prompts, round_robin, serve, spread,
                               stats, write_json)


def make_engine(runner, adapter_dir, steps, args, fused: int = 1):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    reg = AdapterRegistry(runner.cfg, args.n_adapters if adapter_dir else 0, lora_targets=("q", "k", "v", "o"),
                          lora_rank=16, reft_rank=1, dtype=runner.dtype, adapter_dir=adapter_dir)
    R = args.requests
    return Engine(runner, reg, EngineConfig(
        max_num_seqs=R, max_model_len=args.prompt_len + args.max_tokens, max_prefill_seqs=R,
        max_num_batched_tokens=R + R * args.prompt_len, enable_prefix_cache=False, num_scheduler_steps=steps,
        cpu_decode=getattr(args, "cpu_decode", "auto"), decode_steps_per_call=fused,
        cpu_binding=getattr(args, "cpu_binding", "off")))


def served_engine(runner, adapter_dir, steps, args, fused: int = 1):
    """(engine, adapter picks): a warmed-up `make_engine` and each request's adapter (a seeded random one
    of lora_0 .. lora_{n_adapters-1}; None without adapter_dir), after one short untimed batch that makes
    the picked adapters resident (a slot write donates the bank an earlier recorded call holds)."""
    eng = make_engine(runner, adapter_dir, steps, args, fused)
    eng.warmup()
    rng = np.random.default_rng(1008)
    picks = [f"lora_{int(rng.integers(0, args.n_adapters))}" if adapter_dir else None for _ in range(args.requests)]
    serve(eng, random_prompts(args.requests, args.prompt_len, runner.cfg.vocab_size, 99), picks, 2)
    return eng, picks


class Recorder:
    """Keeps every step call of an engine (`StepRunner.add_call_hook`): the `StepCall`s, their
    arguments on the device (tokens from an earlier call are that call's output), and with
    `keep_outputs` each call's output (tests; `host_only`)."""

    def __init__(self, engine, keep_outputs: bool = False):
        self.engine, self.calls = engine, []
        self.keep_outputs, self.outputs = keep_outputs, []
        self.stamps = []                      # time.perf_counter() as each call was made
        self.remove = engine.step_runner.add_call_hook(self)       # stops recording

    def __call__(self, call, run):
        self.stamps.append(time.perf_counter())
        self.calls.append(call)
        out = run(call)
        if self.keep_outputs:                                   # tests: what the engine got from each call
            self.outputs.append(out)
        return out

    def staged(self):
        """The recorded calls with every argument on the device (a call's host arrays moved there:
        the bare loop pays no transfer), and a fresh start."""
        from serve.step_runner import DecodeCall
        out, self.calls, self.stamps = self.calls, [], []
        out = [dataclasses.replace(c, packed=jax.device_put(c.packed)) if isinstance(c, DecodeCall) else
               dataclasses.replace(c, **{f: jax.device_put(getattr(c, f)) for f in
                                         ("tokens", "batch", "adapter_ids", "prompt_lens", "sampling", "next_tokens",
                                          "adapter_starts")})
               for c in out]
        jax.block_until_ready([c.arrays() for c in out])
        return out


def replay(engine, call, cache):
    """One recorded call through the engine's jitted step on `cache`: (output, cache)."""
    return engine.step_runner.run_on(call, cache)


def bare_loop(engine, staged, outputs: list | None = None, host: tuple[str, float] | None = None) -> float:
    """Seconds to run the staged calls back to back through the engine's jitted step on a fresh KV
    pool (each call's output appended to `outputs` when given). `host` ("asleep" | "busy", seconds):
    a host beside the loop - after each call is dispatched the previous call's output is read (as
    the engine reads it, `to_host`) and the host then sleeps, or computes (a Python loop holding a
    core, as the engine's own work does), that long before the next dispatch."""
    from serve.step_runner import to_host
    cache = engine.step_runner.new_cache()
    jax.block_until_ready(cache.k)
    t0 = time.perf_counter()
    nxt = prev = None
    for call in staged:
        nxt, cache = replay(engine, call, cache)
        if outputs is not None:
            outputs.append(nxt)
        if host is not None and prev is not None:
            to_host(prev)
            _hold(*host)
        prev = nxt
    jax.block_until_ready((nxt, cache))
    return time.perf_counter() - t0


def _hold(mode: str, seconds: float) -> None:
    """The host's time beside the device: asleep (no core used) or busy (a core used, the GIL held)."""
    if mode == "asleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def host_only(engine, calls, outputs, serve_all, stamps: list | None = None) -> float:
    """Host CPU seconds (`time.thread_time`) of `serve_all()` with every device call of the engine
    answered by the recorded output of the same call (`calls`, `outputs`: a `Recorder` of a run of
    the same `serve_all()`): the engine's own work, no device computation beside it (`stamps`: each
    call's time.perf_counter() appended). Raises when the
    engine makes another sequence of calls than the recorded one (then the figure would be another
    workload's)."""
    it, wrong = iter(zip(calls, outputs)), []
    shape = lambda c: (type(c).__name__, c.rows, c.width, getattr(c, "steps", 1))    # noqa: E731

    def answer(call, run):                      # never runs the call: its recorded output stands in
        want, out = next(it, (None, None))
        if want is None or shape(call) != shape(want):
            wrong.append(f"host_only: the engine made another call than the recorded one: {shape(call)} "
                         f"(kind, rows, width, steps), recorded {None if want is None else shape(want)}")
            raise RuntimeError(wrong[-1])         # the engine fails the call's requests; reported below
        if stamps is not None:
            stamps.append(time.perf_counter())
        return out

    remove = engine.step_runner.add_call_hook(answer)
    try:
        c0 = time.thread_time()
        serve_all()
        cpu = time.thread_time() - c0
    except Exception as e:
        if wrong:
            raise RuntimeError(wrong[0]) from e
        raise
    finally:
        remove()
    if wrong:
        raise RuntimeError(wrong[0])
    if next(it, None) is not None:
        raise RuntimeError("host_only: the engine made fewer calls than the recorded run")
    return cpu


def paired_bursts(engines: dict, pairs: int, prompts, max_tokens: int, before: dict | None = None) -> dict:
    """Each variant's engine (`engines`: name -> (engine, its Recorder, adapter picks)) against its
    own replay, burst by burst: `pairs` times, for every variant in turn (the order reversed every
    other pair), one burst served (`prompts(i)`) and then its recorded calls replayed at once by the
    bare loop (`before`: name -> a callable run first, untimed). A machine whose speed drifts over
    seconds moves both sides of a pair alike. Returns name -> {"engine_s", "bare_s", "tokens"}: one
    entry per pair."""
    out = {name: {"engine_s": [], "bare_s": [], "tokens": []} for name in engines}
    for _, rec, _ in engines.values():
        rec.keep_outputs, rec.outputs = False, []
        rec.staged()                                            # drop what earlier runs recorded
    names = list(engines)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            eng, rec, picks = engines[name]
            if before:
                before[name]()
            s = serve(eng, prompts(i), picks, max_tokens)
            bare = bare_loop(eng, rec.staged())
            for k, v in (("engine_s", s.wall), ("bare_s", bare), ("tokens", s.tokens)):
                out[name][k].append(v)
    return out


def binding_pairs(runner, args, pairs: int, prompts) -> dict:
    """The CPU binding's worth, side by side: one more engine of the first variant (base, the first
    `--steps`, no fusing) with `cpu_binding="off"`, its bursts served and replayed (`paired_bursts`)
    alternately with this thread bound (`ThreadBinding`: a core of its own, the runtime's threads on
    the others) and unbound. Call it with no other binding held (the other engines shut down)."""
    from serve.cpu_binding import ThreadBinding
    eng, picks = served_engine(runner, None, args.steps[0], argparse.Namespace(**{**vars(args), "cpu_binding": "off"}))
    rec, binding = Recorder(eng), ThreadBinding()
    try:
        return paired_bursts({"bound": (eng, rec, picks), "unbound": (eng, rec, picks)}, pairs, prompts,
                             args.max_tokens, {"bound": binding.bind, "unbound": binding.release})
    finally:
        binding.release()


def paired_ratio(p: dict, part: slice = slice(None)) -> float:
    """Engine tok/s over bare-loop tok/s across the pairs `part`: all their tokens over all their wall
    time, each side (the engine's slow bursts count in full, as they do for a client)."""
    return sum(p["bare_s"][part]) / sum(p["engine_s"][part])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-dir", default="/work/bench_data")
    ap.add_argument("--model", default=None, help="'tiny', a GGUF/HF path, or the embedded SmolLM2-135M")
    ap.add_argument("--adapter-dir", default=None,
                    help="PEFT folders lora_0 .. lora_{N-1} (default <bench-dir>/adapters/r16_qkvo without --model)")
    ap.add_argument("--n-adapters", type=int, default=8)
    ap.add_argument("--requests", "--rows", dest="requests", type=positive_int, default=32,
                    help="requests, all submitted at once (= decode rows, max_num_seqs)")
    ap.add_argument("--prompt-len", type=positive_int, default=16)
    ap.add_argument("--max-tokens", type=positive_int, default=32)
    ap.add_argument("--steps", type=positive_int, nargs="+", default=[4, 1], help="num_scheduler_steps values")
    ap.add_argument("--fused", type=positive_int, nargs="+", default=[1, 4],
                    help="decode_steps_per_call values (fused multi-step calls; > 1 only with --steps > 1)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--bursts", type=positive_int, default=8,
                    help="workload rounds per repeat, served back to back (and replayed): a longer window "
                         "than one ~40 ms round on the tiny model, whose spread on this machine was 0.5-1.2x")
    ap.add_argument("--cpu-decode", default="auto", choices=("auto", "native", "xla"),
                    help="EngineConfig.cpu_decode: the CPU base decode path (both loops run the same one)")
    ap.add_argument("--cpu-binding", default="off", choices=("off", "on"),
                    help="EngineConfig.cpu_binding of the engines: 'on' binds this script's thread, which steps the "
                         "engines and runs the bare loops, to a core of its own and the runtime's threads to the "
                         "others; 'off' (the engine's default): the OS places them")
    ap.add_argument("--host-probe", action="store_true",
                    help="also time the bare loop with a host beside it that reads each call's output and then "
                         "sleeps ('asleep') or computes ('busy') for the engine's host-only time per call of that "
                         "repeat: asleep/bare is what that host work costs where it does not share the device's "
                         "cores (an accelerator), busy/bare what it costs a CPU device sharing them")
    ap.add_argument("--pairs", type=int, default=200,
                    help="burst pairs per variant after the round-robin repeats: one burst served and its calls "
                         "replayed at once, variants alternating burst by burst (paired_bursts); the last line's "
                         "ratio is theirs. 0: no pairs, the last line gives the median of the repeats")
    ap.add_argument("--binding-pairs", type=int, default=100,
                    help="burst pairs of a fourth table, last: the first variant's engine with this thread bound "
                         "and unbound, alternating burst by burst (binding_pairs; 0: not run)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for flag in ("pairs", "binding_pairs"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    t_all = time.perf_counter()
    adir = args.adapter_dir or (None if args.model else str(pathlib.Path(args.bench_dir) / "adapters" / "r16_qkvo"))
    if adir is not None and not (pathlib.Path(adir) / f"lora_{args.n_adapters - 1}").is_dir():
        if args.adapter_dir:
            sys.exit(f"{adir}: no folder lora_{args.n_adapters - 1}")
        log(f"# {adir}: no adapters (benchmarks/vllm_peer/prepare.py --out {args.bench_dir} --ranks 16 "
            f"--n-adapters {args.n_adapters} --targets q k v o); base only")
        adir = None
    runner = load_runner(args.model)
    log(header(runner, f"{args.requests} requests x {args.prompt_len} -> {args.max_tokens} tokens"))
    V = runner.cfg.vocab_size
    cases, calls, engines = {}, {}, {}
    for label, with_ad in (("base", False), ("PreFT-LoRA", True))[:2 if adir else 1]:
        for steps, fused in [(st, k) for k in args.fused for st in args.steps if st > 1 or k == 1]:
            name = f"{label} steps={steps}" + (f" fused={fused}" if fused > 1 else "")
            eng, picks = served_engine(runner, adir if with_ad else None, steps, args, fused)
            if not engines:
                log(f"# cpu binding {args.cpu_binding}: this thread {eng.health()['cpu_binding']}")
            rec = Recorder(eng, keep_outputs=True)
            engines[name] = (eng, rec, picks)
            held = {}

            def run_engine(rep, eng=eng, rec=rec, held=held, picks=picks, name=name):
                tokens = wall = 0
                prompts = [random_prompts(args.requests, args.prompt_len, V, rep * args.bursts + b)
                           for b in range(args.bursts)]
                front = []                                       # (submit, submit -> first call) per burst
                cpu0 = time.thread_time()
                for p in prompts:
                    n0 = len(rec.stamps)
                    s = serve(eng, p, picks, args.max_tokens)
                    tokens, wall = tokens + s.tokens, wall + s.wall
                    front.append((s.submit_s, rec.stamps[n0] - s.started - s.submit_s))
                cpu = time.thread_time() - cpu0                  # the host thread's CPU time: all its work,
                calls_ = list(rec.calls)                         # overlapped with the device or not
                outputs, rec.outputs = rec.outputs, []
                held["staged"], held["tokens"] = rec.staged(), tokens
                calls[name] = len(held["staged"]) // args.bursts
                jax.block_until_ready(outputs)
                served, stamps, ends = [], [], []                # ends: calls answered by each burst's end

                def serve_all(served=served, stamps=stamps, ends=ends, prompts=prompts):
                    for p in prompts:
                        served.append(serve(eng, p, picks, args.max_tokens))
                        ends.append(len(stamps))

                alone = host_only(eng, calls_, outputs, serve_all, stamps)
                back = [s.started + s.wall - stamps[n - 1] for s, n in zip(served, ends)]
                held["host_s"] = alone / len(held["staged"])      # the engine's host-only work per call
                return {"tok_per_s": tokens / wall, "wall_s": wall, "calls": len(held["staged"]), "cpu_s": cpu,
                        "host_only_s": alone, "front_s": front, "back_s": back}

            def run_bare(rep, eng=eng, held=held):
                bare_loop(eng, held["staged"][:2])                   # untimed: touch the shapes once
                cpu0 = time.thread_time()
                dt = bare_loop(eng, held["staged"])
                out = {"tok_per_s": held["tokens"] / dt, "wall_s": dt, "cpu_s": time.thread_time() - cpu0}
                if args.host_probe:
                    for mode in ("asleep", "busy")[::1 if rep % 2 else -1]:     # alternated between repeats
                        out[f"host_{mode}_s"] = bare_loop(eng, held["staged"], host=(mode, held["host_s"]))
                return out

            cases[name] = run_engine
            cases[f"{name} (bare loop)"] = run_bare
    runs = round_robin(cases, args.repeats, log)
    probe = " bare with host asleep / bare | bare with host busy / bare |" if args.host_probe else ""
    log("\n| variant | device calls | engine tok/s | bare loop tok/s | engine / bare median | per-repeat min-max "
        "| host us per call | host CPU us per call, engine / bare | host-only us per call |" + probe)
    log("|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (2 if args.host_probe else 0))
    ratios = {}
    for name in [k for k in runs if not k.endswith("(bare loop)")]:
        e, b = runs[name], runs[f"{name} (bare loop)"]
        per = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(e, b)]
        host = [(x["wall_s"] - y["wall_s"]) / x["calls"] * 1e6 for x, y in zip(e, b)]
        cpu_e, cpu_b = (stats([r["cpu_s"] / x["calls"] * 1e6 for r, x in zip(v, e)])[0] for v in (e, b))
        alone = [r["host_only_s"] / r["calls"] * 1e6 for r in e]
        ratios[name] = stats(per)[0]
        probe = "".join(f" {spread([y['wall_s'] / y[f'host_{m}_s'] for y in b], '{:.2f}')} |"
                        for m in ("asleep", "busy")) if args.host_probe else ""
        log(f"| {name} | {calls[name]} | {spread([r['tok_per_s'] for r in e])} | {spread([r['tok_per_s'] for r in b])} "
            f"| {ratios[name]:.2f}x | {min(per):.2f}-{max(per):.2f}x | {spread(host, '{:.0f}')} | {cpu_e:.0f} / {cpu_b:.0f} "
            f"| {spread(alone, '{:.0f}')} |{probe}")

    def ms(seconds) -> str:
        """Seconds as milliseconds: median (min-max)."""
        return spread([x * 1e3 for x in seconds], "{:.2f}")

    log("\n| variant | submit ms | submit -> first call ms | last tokens -> done ms (host-only) | edges ms "
        "| bare loop ms per burst | edges / bare |")
    log("|---|---:|---:|---:|---:|---:|---:|")
    for name in ratios:
        e, b = runs[name], runs[f"{name} (bare loop)"]
        sub, first = zip(*[x for r in e for x in r["front_s"]])
        back = [x for r in e for x in r["back_s"]]
        edges = statistics.median(sub) + statistics.median(first) + statistics.median(back)
        bare = statistics.median([r["wall_s"] / args.bursts for r in b])
        log(f"| {name} | {ms(sub)} | {ms(first)} | {ms(back)} | {edges * 1e3:.2f} | {bare * 1e3:.2f} | {edges / bare:.3f} |")
    paired = {}
    if args.pairs > 0:
        seed0 = (args.repeats + 1) * args.bursts
        paired = paired_bursts(engines, args.pairs, lambda i: random_prompts(args.requests, args.prompt_len, V,
                                                                             seed0 + i), args.max_tokens)
        log("\n| variant | burst pairs | engine / bare, paired (all tokens / all wall) | first half / second half "
            "| per-pair ratio median (25th-75th percentile) | engine ms per burst | bare loop ms per burst |")
        log("|---|---:|---:|---:|---:|---:|---:|")
        for name, p in paired.items():
            half = args.pairs // 2
            per = np.asarray(p["bare_s"]) / np.asarray(p["engine_s"])
            q1, q2, q3 = np.percentile(per, [25, 50, 75])
            halves = (f"{paired_ratio(p, slice(None, half)):.3f}x / {paired_ratio(p, slice(half, None)):.3f}x"
                      if half else "-")                                  # one pair: no halves
            log(f"| {name} | {args.pairs} | {paired_ratio(p):.3f}x | {halves} | {q2:.3f}x ({q1:.3f}-{q3:.3f}) "
                f"| {ms(p['engine_s'])} | {ms(p['bare_s'])} |")
    bound = {}
    if args.binding_pairs > 0:
        for eng, _, _ in engines.values():
            eng.shutdown()                                      # their bindings released
        seed0 = (args.repeats + 1) * args.bursts + args.pairs
        bound = binding_pairs(runner, args, args.binding_pairs,
                              lambda i: random_prompts(args.requests, args.prompt_len, V, seed0 + i))
        b, u = bound["bound"], bound["unbound"]
        half = args.binding_pairs // 2
        speed = lambda part: sum(u["engine_s"][part]) / sum(b["engine_s"][part])      # noqa: E731
        log(f"\n| base steps={args.steps[0]}, this thread | burst pairs | engine ms per burst | bare loop ms per burst | engine / bare |")
        log("|---|---:|---:|---:|---:|")
        for name, p in bound.items():
            log(f"| {name} | {args.binding_pairs} | {ms(p['engine_s'])} | {ms(p['bare_s'])} | {paired_ratio(p):.3f}x |")
        log(f"# cpu binding: engine speed bound / unbound {speed(slice(None)):.3f}x"
            + (f" (halves {speed(slice(None, half)):.3f}x / {speed(slice(half, None)):.3f}x)" if half else "")
            + f"; bare loop bound / unbound {sum(u['bare_s']) / sum(b['bare_s']):.3f}x")
    log(f"# minimal calls for this workload: 1 prefill + {args.max_tokens - 1} decode = {args.max_tokens}")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s; {args.repeats} round-robin repeats, medians (min-max)")
    write_json(args.json, {"args": vars(args), "runs": runs, "calls": calls, "ratios": ratios, "paired": paired,
                           "binding": bound})
    first = next(iter(ratios))
    if paired:
        log(f"# engine / bare loop, {first}, {args.requests} rows ({args.pairs} burst pairs, all tokens / all wall; "
            f"the median of the {args.repeats} repeats: {ratios[first]:.2f}x): {paired_ratio(paired[first]):.2f}x")
    else:
        log(f"# engine / bare loop, {first}, {args.requests} rows (median of {args.repeats}): {ratios[first]:.2f}x")
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
