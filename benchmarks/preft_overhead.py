"""Where PreFT's end-to-end cost over the base model goes (issue 25.4): base vs PreFT-LoRA vs
PreFT-ReFT on the engine, N adapters round-robin, broken down into prefill device time, decode
device time, host time and adapter slot writes.

    python -m benchmarks.preft_overhead [--model tiny] [--adapters 64] [--requests 64] [--repeats 5]

Workload (the device check's serving table, scripts/device_check.py): `--requests` requests x
`--prompt-len` random prompt tokens -> `--max-tokens` greedy tokens, all submitted at once,
`--requests` decode rows, 8 prefill rows per step, prefix cache off; request i uses adapter i mod N.
Variants (round-robin, repeat after repeat, same prompts):

  base                 no adapter bank at all
  PreFT-LoRA           N random LoRAs (r16 q/k/v/o) in a static bank, every adapter resident
  PreFT-ReFT           N random LoReFTs (r8, 4 layers) in a static bank
  PreFT-LoRA, S slots  the same LoRA weights registered on the host, `--slots` device slots
                       (< N): each admission that misses writes its adapter into a bank slot
                       (the bank's one slot writer) on the engine thread, as a server does

Each timed engine run records its jitted calls (`bare_loop.Recorder`); its prefill calls and its
decode calls are then replayed separately, back to back on a fresh pool (inputs on the device,
one final wait): the prefill and decode device times. Host = engine wall - both (the host work the
device did not hide: scheduling, arrays, token handling, slot writes). PreFT decode is the base
decode by construction (`decode calls with a bank` must be 0 in mode "prefill"), so PreFT's
difference to base should sit in the prefill column; anything in the host column is overhead the
engine adds. Medians over the repeats, min-max in parentheses; numbers on a shared CPU are noisy.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Callable

import numpy as np

from benchmarks.bare_loop import Recorder, bare_loop
from benchmarks.common import header, load_runner, log, random_prompts, round_robin, serve, spread, stats, write_json

LORA_TARGETS, LORA_RANK, REFT_RANK, REFT_LAYERS = ("q", "k", "v", "o"), 16, 8, (4, 12, 20, 28)


def lora_weights(bank, slot: int):
    """The LoRA of one slot of a static bank, as host weights (for the registry's disk/host tier)."""
    from preft_jax.adapters.config import LoraConfig, LoraWeights
    conf = LoraConfig(rank=LORA_RANK, alpha=float(LORA_RANK), targets=LORA_TARGETS)
    return LoraWeights(conf, {t: np.asarray(a[:, slot]) for t, a in bank.lora_A.items()},
                       {t: np.asarray(b[:, slot]) for t, b in bank.lora_B.items()})


def make_engine(runner, registry, args):
    from serve.engine import Engine, EngineConfig
    R, P = args.requests, 8
    return Engine(runner, registry, EngineConfig(
        max_num_seqs=R, max_model_len=args.prompt_len + args.max_tokens, max_prefill_seqs=P,
        max_num_batched_tokens=R + P * args.prompt_len, enable_prefix_cache=False, cpu_decode=args.cpu_decode))


def variants(runner, args) -> dict:
    """label -> (engine, adapter of each request)."""
    from experiments.serve_benchmark import random_bank
    from serve.registry import AdapterRegistry
    cfg, n = runner.cfg, args.adapters
    names = [f"a{i}" for i in range(n)]
    picks = [names[i % n] for i in range(args.requests)]
    lora = random_bank(cfg, n, "lora", LORA_TARGETS, LORA_RANK, REFT_LAYERS, 1, runner.dtype)
    reft = random_bank(cfg, n, "reft", LORA_TARGETS, REFT_RANK, REFT_LAYERS, 2, runner.dtype)
    out = {"base": (make_engine(runner, AdapterRegistry(cfg, 0), args), [None] * args.requests),
           "PreFT-LoRA": (make_engine(runner, AdapterRegistry.from_bank(cfg, lora, names), args), picks),
           "PreFT-ReFT": (make_engine(runner, AdapterRegistry.from_bank(cfg, reft, names), args), picks)}
    if 0 < args.slots < n:
        reg = AdapterRegistry(cfg, args.slots, lora_targets=LORA_TARGETS, lora_rank=LORA_RANK, dtype=runner.dtype)
        for i, name in enumerate(names):
            reg.load(name, lora_weights(lora, i + 1))
        out[f"PreFT-LoRA, {args.slots} slots"] = (make_engine(runner, reg, args), picks)
    return out


def split_calls(engine, rec, wall: float) -> dict:
    """The calls `rec` recorded over one engine run of `wall` seconds, its prefill calls and its
    decode calls replayed separately (each back to back on a fresh pool, inputs on the device):
    the prefill and decode device times, and host = wall - both."""
    calls = rec.staged()
    bank = engine.registry.bank          # a slot write donated the bank earlier calls held: replay on today's
    prefill = [dataclasses.replace(c, bank=bank) if c.bank is not None else c for c in calls if c.chunk > 1]
    decode = [c for c in calls if c.chunk == 1]
    bare_loop(engine, prefill[:1] + decode[:1])                 # untimed: touch the shapes
    t_prefill, t_decode = bare_loop(engine, prefill), bare_loop(engine, decode)
    return {"wall_s": wall, "prefill_s": t_prefill, "decode_s": t_decode, "host_s": wall - t_prefill - t_decode,
            "prefill_calls": len(prefill), "decode_calls": len(decode),
            "decode_calls_with_bank": sum(c.bank is not None for c in decode)}


def breakdown(engine, run: Callable[[], float]) -> dict:
    """`split_calls` of one more `run()` (serves a workload on `engine`, returns its wall seconds),
    its calls recorded for that run only (scripts/device_check.py: after a serving table's timed
    runs, on the same engines, so nothing compiles again)."""
    rec = Recorder(engine)
    try:
        wall = run()
    finally:
        rec.remove()
    return split_calls(engine, rec, wall)


def timed_run(engine, rec, picks, prompts, args) -> dict:
    """One engine run, then its recorded prefill and decode calls replayed separately."""
    stats0 = engine.registry.stats.device_misses
    s = serve(engine, prompts, picks, args.max_tokens)
    return {"tok_per_s": s.tok_per_s, **split_calls(engine, rec, s.wall),
            "slot_writes": engine.registry.stats.device_misses - stats0}


def breakdown_lines(parts: dict[str, dict]) -> list[str]:
    """A markdown table of `breakdown`s (label -> parts; "base" first) and each PreFT variant's
    difference to base by component."""
    ms = lambda x: f"{x * 1e3:.1f}"                 # noqa: E731
    out = ["| variant | wall ms | prefill device ms | decode device ms | host ms | prefill / decode calls "
           "| decode calls with a bank |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k, p in parts.items():
        out.append(f"| {k} | {ms(p['wall_s'])} | {ms(p['prefill_s'])} | {ms(p['decode_s'])} | {ms(p['host_s'])} "
                   f"| {p['prefill_calls']} / {p['decode_calls']} | {p['decode_calls_with_bank']} |")
    base = parts.get("base")
    if base is not None:
        out.append("")
        for k, p in parts.items():
            if k != "base":
                d = {f: (p[f] - base[f]) * 1e3 for f in ("wall_s", "prefill_s", "decode_s", "host_s")}
                out.append(f"- {k} - base: wall {d['wall_s']:+.1f} ms = prefill {d['prefill_s']:+.1f} "
                           f"+ decode {d['decode_s']:+.1f} + host {d['host_s']:+.1f}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny', a GGUF/HF path, or the embedded SmolLM2-135M")
    ap.add_argument("--adapters", type=int, default=64, help="N adapters, used round-robin")
    ap.add_argument("--slots", type=int, default=16, help="device slots of the host-tier variant (0: leave it out)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cpu-decode", default="auto", choices=("auto", "native", "xla"))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    runner = load_runner(args.model)
    log(header(runner, f"{args.requests} requests x {args.prompt_len} -> {args.max_tokens} tokens, "
                       f"N={args.adapters} adapters round-robin"))
    V = runner.cfg.vocab_size
    cases = {}
    for label, (eng, picks) in variants(runner, args).items():
        serve(eng, random_prompts(args.requests, args.prompt_len, V, 7), picks, args.max_tokens)   # compiles
        rec = Recorder(eng)
        cases[label] = (lambda rep, eng=eng, rec=rec, picks=picks:
                        timed_run(eng, rec, picks, random_prompts(args.requests, args.prompt_len, V, rep), args))
    runs = round_robin(cases, args.repeats, log)
    med = {k: {f: stats([r[f] for r in v])[0] for f in v[0] if f != "load1"} for k, v in runs.items()}
    log("\n| variant | tok/s | / base | wall ms | prefill device ms | decode device ms | host ms "
        "| prefill / decode calls | decode calls with a bank | slot writes |")
    log("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ms = lambda rs, f: spread([r[f] * 1e3 for r in rs])          # noqa: E731
    base = runs["base"]
    for k, rs in runs.items():
        ratio = [r["tok_per_s"] / b["tok_per_s"] for r, b in zip(rs, base)]
        m = med[k]
        log(f"| {k} | {spread([r['tok_per_s'] for r in rs], '{:.0f}')} | {stats(ratio)[0]:.2f}x "
            f"({min(ratio):.2f}-{max(ratio):.2f}) | {ms(rs, 'wall_s')} | {ms(rs, 'prefill_s')} | {ms(rs, 'decode_s')} "
            f"| {ms(rs, 'host_s')} | {m['prefill_calls']:.0f} / {m['decode_calls']:.0f} "
            f"| {m['decode_calls_with_bank']:.0f} | {m['slot_writes']:.0f} |")
    log("\nPreFT - base, by component (median of per-repeat differences, ms; + = PreFT slower):")
    for k, rs in runs.items():
        if k == "base":
            continue
        d = {f: stats([(r[f] - b[f]) * 1e3 for r, b in zip(rs, base)])[0]
             for f in ("wall_s", "prefill_s", "decode_s", "host_s")}
        log(f"  {k}: wall {d['wall_s']:+.1f} = prefill {d['prefill_s']:+.1f} + decode {d['decode_s']:+.1f} "
            f"+ host {d['host_s']:+.1f}")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s; {args.repeats} round-robin repeats")
    write_json(args.json, {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
