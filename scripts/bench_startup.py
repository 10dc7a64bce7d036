"""Cold vs warm start-up of `python -m preft_jax "<prompt>"`, round-robin, as a markdown table.

Variants (each run is a fresh process):
  no-cache  `--no-cache`: dequantize + compile every time (the behaviour before the caches)
  cold      empty cache directory: dequantize + compile, then write both caches
  warm      cache directory filled by a previous run: read weights, load compiled programs

Runs are interleaved (no-cache, cold, warm, no-cache, ...) so machine load affects all variants
alike; wall-clock and CPU (user+sys) seconds are reported as median [min-max]. The cache lives in a
temporary directory (PREFT_JAX_CACHE_DIR), so the user's own cache is never touched.

    python scripts/bench_startup.py --runs 5
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("no-cache", "cold", "warm")


def _run(cmd: list[str], env: dict) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.stdout.strip()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per variant")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more CLI arguments")
    args = ap.parse_args(argv)

    cmd = [sys.executable, "-m", "preft_jax", args.prompt, "--quiet", *args.extra]
    work = tempfile.mkdtemp(prefix="preft_bench_")
    warm_dir, cold_dir = os.path.join(work, "warm"), os.path.join(work, "cold")
    base_env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    base_env.pop("PREFT_JAX_NO_CACHE", None)
    results = {v: ([], []) for v in VARIANTS}
    outputs = set()
    try:
        _run(cmd, {**base_env, "PREFT_JAX_CACHE_DIR": warm_dir})          # fill the warm cache
        for _ in range(args.runs):
            for v in VARIANTS:
                env = dict(base_env)
                if v == "no-cache":
                    run_cmd = cmd + ["--no-cache"]
                    env["PREFT_JAX_CACHE_DIR"] = cold_dir                 # never written
                elif v == "cold":
                    shutil.rmtree(cold_dir, ignore_errors=True)
                    run_cmd, env["PREFT_JAX_CACHE_DIR"] = cmd, cold_dir
                else:
                    run_cmd, env["PREFT_JAX_CACHE_DIR"] = cmd, warm_dir
                wall, cpu, out = _run(run_cmd, env)
                results[v][0].append(wall)
                results[v][1].append(cpu)
                outputs.add(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    load = os.getloadavg()
    print(f"`python -m preft_jax \"{args.prompt}\"`, {args.runs} runs per variant, {os.cpu_count()} CPUs, "
          f"load average at end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("| variant | wall s, median [min-max] | CPU s (user+sys), median [min-max] |")
    print("|---|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {_fmt(results[v][0])} | {_fmt(results[v][1])} |")
    if len(outputs) != 1:
        print(f"\nWARNING: the variants printed different answers: {outputs}")
    else:
        print(f"\nanswer (all runs): {outputs.pop()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
