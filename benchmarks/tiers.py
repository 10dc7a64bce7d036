"""Adapter tiers at scale (issue 12.4): 10,000 PEFT LoRA folders on disk, 16 device slots, 64 concurrent
requests on random adapters, served through the registry's adapter_dir tiering (disk -> host LRU -> device).

    python -m benchmarks.tiers make-adapters --out /work/bench_data/adapters_10k --n 10000   # ~2 min, ~4.6 GB
    python -m benchmarks.tiers run --adapter-dir /work/bench_data/adapters_10k [--repeats 3] [--json F]

Variants, timed round-robin (each repeat draws fresh random picks, the same picks for every variant
of that repeat that draws from the same pool):
  base                     no adapters
  PreFT 10k dir            mode prefill, each request a random one of the 10,000 folders (found by name
                           in --adapter-dir; mostly cold: read from disk on the loader threads)
  PreFT 16                 mode prefill, each request one of 16 folders (resident after the warm-up)
  all-token 10k dir        mode all (slot pinned for the whole request), the same 10,000-folder picks
  all-token 16             mode all, one of 16 folders
All use the same bank size (--slots device slots), max_num_seqs = --requests.

Then single-request TTFT on an idle PreFT 10k engine, interleaved: cold (never loaded: disk + upload
+ prefill), warm (in the host cache, not on the device: upload + prefill), hot (resident on a device
slot: prefill only).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import numpy as np

from benchmarks.common import header, load_runner, log, random_prompts, round_robin, serve, spread, stats, write_json


def make_adapters(out: pathlib.Path, n: int, rank: int, targets: tuple[str, ...], seed: int = 0) -> None:
    """n PEFT LoRA folders lora_0 ... lora_{n-1} (distinct random weights), written by save_peft_lora."""
    from preft_jax.adapters.config import LoraConfig, LoraWeights
    from preft_jax.adapters.peft_io import PEFT_CONFIG_NAME, save_peft_lora
    from preft_jax.loading import load_model
    cfg = load_model(None)[0]
    dims, L = cfg.projection_dims(), cfg.n_layers
    conf = LoraConfig(rank=rank, alpha=float(2 * rank), targets=targets)
    rng = np.random.default_rng(seed)
    t0, written = time.perf_counter(), 0
    for i in range(n):
        folder = out / f"lora_{i}"
        if (folder / PEFT_CONFIG_NAME).is_file():
            continue
        A = {t: (rng.standard_normal((L, dims[t][0], rank)) / np.sqrt(dims[t][0])).astype(np.float32) for t in targets}
        B = {t: (0.02 * rng.standard_normal((L, rank, dims[t][1]))).astype(np.float32) for t in targets}
        save_peft_lora(folder, LoraWeights(conf, A, B), cfg, base_model_name_or_path="SmolLM2-135M-Instruct")
        written += 1
        if written % 1000 == 0:
            log(f"  {i + 1}/{n} ({time.perf_counter() - t0:.0f} s)")
    log(f"{n} adapters in {out} ({written} written in {time.perf_counter() - t0:.0f} s; rank {rank}, "
        f"targets {'/'.join(targets)})")


def engine(runner, mode, adapter_dir, args):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    reg = AdapterRegistry(runner.cfg, args.slots if adapter_dir else 0, lora_targets=tuple(args.targets),
                          lora_rank=args.rank, reft_rank=1, mode=mode, dtype=runner.dtype, adapter_dir=adapter_dir,
                          host_cache_bytes=args.host_cache_mib << 20)
    R = args.requests
    return Engine(runner, reg, EngineConfig(
        max_num_seqs=R, max_model_len=args.prompt_len + args.max_tokens, mode=mode, max_prefill_seqs=args.prefill_seqs,
        max_num_batched_tokens=R + args.prefill_seqs * args.prompt_len, enable_prefix_cache=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-adapters")
    mk.add_argument("--out", required=True)
    mk.add_argument("--n", type=int, default=10000)
    for p in (mk, run := sub.add_parser("run")):
        p.add_argument("--rank", type=int, default=1)
        p.add_argument("--targets", nargs="+", default=["q", "k", "v", "o"])
    run.add_argument("--adapter-dir", required=True)
    run.add_argument("--model", default=None)
    run.add_argument("--n-adapters", type=int, default=10000, help="folders lora_0.. to draw from")
    run.add_argument("--few", type=int, default=16, help="adapters in the small-pool variants")
    run.add_argument("--slots", type=int, default=16, help="device adapter slots (bank size)")
    run.add_argument("--requests", type=int, default=64, help="concurrent requests (= max_num_seqs)")
    run.add_argument("--prompt-len", type=int, default=16)
    run.add_argument("--max-tokens", type=int, default=32)
    run.add_argument("--prefill-seqs", type=int, default=16)
    run.add_argument("--host-cache-mib", type=int, default=256)
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--ttft-samples", type=int, default=8)
    run.add_argument("--variants", nargs="+", default=["base", "PreFT 10k dir", "PreFT 16", "all-token 10k dir",
                                                       "all-token 16"])
    run.add_argument("--json")
    args = ap.parse_args(argv)
    if args.cmd == "make-adapters":
        make_adapters(pathlib.Path(args.out), args.n, args.rank, tuple(args.targets))
        return 0

    t_all = time.perf_counter()
    runner = load_runner(args.model)
    d = args.adapter_dir
    n_avail = args.n_adapters
    if not os.path.isdir(os.path.join(d, f"lora_{n_avail - 1}")):
        sys.exit(f"{d} lacks lora_{n_avail - 1}: run make-adapters first")
    log(header(runner, f"{args.requests} requests x {args.prompt_len} prompt tokens -> {args.max_tokens} tokens, "
                       f"{args.slots} device slots, LoRA r={args.rank} {'/'.join(args.targets)}, "
                       f"{n_avail} folders in {d}, host cache {args.host_cache_mib} MiB"))
    V = runner.cfg.vocab_size
    pools = {"base": 0, "PreFT 10k dir": n_avail, "PreFT 16": args.few, "all-token 10k dir": n_avail,
             "all-token 16": args.few}
    modes = {"base": "prefill", "PreFT 10k dir": "prefill", "PreFT 16": "prefill", "all-token 10k dir": "all",
             "all-token 16": "all"}
    # the first 100 folders are kept for the warm-up and the TTFT probes; the large pool draws from the rest
    engines = {}
    for name in args.variants:
        t0 = time.perf_counter()
        engines[name] = engine(runner, modes[name], None if name == "base" else d, args)
        engines[name].warmup()
        few = [f"lora_{i}" for i in range(args.few)] if pools[name] else [None]
        serve(engines[name], random_prompts(args.requests, args.prompt_len, V, 99),
              [few[i % len(few)] for i in range(args.requests)], 2)
        log(f"# {name}: compiled + warmed up in {time.perf_counter() - t0:.0f} s")

    def picks(pool, rep):
        if pool == 0:
            return [None] * args.requests
        rng = np.random.default_rng(2000 + rep)
        if pool == n_avail:
            return [f"lora_{int(i)}" for i in rng.integers(100, n_avail, args.requests)]
        return [f"lora_{int(i)}" for i in rng.integers(0, pool, args.requests)]

    def case(name):
        def fn(rep):
            eng = engines[name]
            st0 = dict(vars(eng.registry.stats)) if eng.registry.capacity else {}
            s = serve(eng, random_prompts(args.requests, args.prompt_len, V, rep), picks(pools[name], rep),
                      args.max_tokens)
            st = {k: v - st0.get(k, 0) for k, v in vars(eng.registry.stats).items()
                  if isinstance(v, (int, float))} if st0 else {}
            return {"tok_per_s": s.tok_per_s, "wall_s": s.wall, "ttft_med_s": stats(s.ttft)[0],
                    "max_running": s.max_running, **{k: st[k] for k in ("host_misses", "device_misses") if k in st}}
        return fn

    runs = round_robin({n: case(n) for n in args.variants}, args.repeats, log)

    # single-request TTFT by tier on the PreFT 10k engine, idle between probes
    ttft = {"cold": [], "warm": [], "hot": []}
    if "PreFT 10k dir" in engines:
        eng = engines["PreFT 10k dir"]
        reg = eng.registry
        prompt = random_prompts(1, args.prompt_len, V, 7)
        for i in range(args.ttft_samples):
            cold, warm = f"lora_{50 + i}", f"lora_{75 + i}"          # never used before this point
            ttft["cold"].append(serve(eng, prompt, [cold], 1).ttft[0])
            reg.prepare(warm).result()                                 # host tier only
            ttft["warm"].append(serve(eng, prompt, [warm], 1).ttft[0])
            ttft["hot"].append(serve(eng, prompt, [warm], 1).ttft[0])  # just uploaded: resident
            log(f"ttft probe {i}: cold {ttft['cold'][-1] * 1e3:.1f} ms, warm {ttft['warm'][-1] * 1e3:.1f} ms, "
                f"hot {ttft['hot'][-1] * 1e3:.1f} ms")
        nums = {k: v for k, v in vars(reg.stats).items() if isinstance(v, (int, float))}
        log(f"# registry stats: {nums}; occupancy {reg.occupancy()}")

    log(f"\n| variant | tok/s median (min-max) | vs PreFT 16 | median TTFT s | peak running |")
    log("|---|---:|---:|---:|---:|")
    ref = stats(r["tok_per_s"] for r in runs["PreFT 16"])[0] if "PreFT 16" in runs else float("nan")
    for name, rs in runs.items():
        tps = [r["tok_per_s"] for r in rs]
        log(f"| {name} | {spread(tps)} | {stats(tps)[0] / ref:.2f}x | {spread([r['ttft_med_s'] for r in rs], '{:.2f}')} "
            f"| {max(r['max_running'] for r in rs)} |")
    if ttft["cold"]:
        log("\n| adapter tier at arrival | single-request TTFT ms median (min-max) |\n|---|---:|")
        for k, v in ttft.items():
            log(f"| {k} | {spread([x * 1e3 for x in v])} |")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"args": vars(args), "runs": runs, "ttft": ttft})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
