"""Cold vs warm start-up of `python -m preft_jax "<prompt>"` (or the server), round-robin, as a markdown table.

Variants (each run is a fresh process):
  no-cache  `--no-cache`: dequantize + compile every time (the behaviour before the caches)
  cold      empty cache directory: dequantize + compile, then write both caches
  warm      cache directory filled by a previous run: read weights, load compiled programs

Runs are interleaved (no-cache, cold, warm, no-cache, ...) so machine load affects all variants
alike; wall-clock and CPU (user+sys) seconds are reported as median [min-max]. The cache lives in a
temporary directory (PREFT_JAX_CACHE_DIR), so the user's own cache is never touched.

    python scripts/bench_startup.py --runs 5
    python scripts/bench_startup.py --runs 3 --server     # `python -m serve server`: time to /health
                                                           # and to the first chat completion

The server is timed with JAX's persistent compilation cache switched on through JAX_* environment
variables (what `preft_jax.cache.enable_compilation_cache()` sets), in case serve does not call it.
"""
from __future__ import annotations

import argparse
import os
import json
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_server(prompt: str, env: dict, use_cache: bool) -> tuple[float, float, str]:
    """(seconds to a 200 from /health, seconds to the first chat completion's answer, answer)."""
    port = _free_port()
    if use_cache:
        env = {**env, "JAX_COMPILATION_CACHE_DIR": os.path.join(env["PREFT_JAX_CACHE_DIR"], "jax"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
    else:
        env = {**env, "PREFT_JAX_NO_CACHE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "serve", "server", "--port", str(port), "--log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        ready = time.perf_counter() - t0
        body = json.dumps({"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        return ready, time.perf_counter() - t0, answer.strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per variant")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--server", action="store_true", help="time `python -m serve server` instead of the CLI")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="which variants to time (default: all)")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more CLI arguments")
    args = ap.parse_args(argv)

    cmd = [sys.executable, "-m", "preft_jax", args.prompt, "--quiet", *args.extra]
    work = tempfile.mkdtemp(prefix="preft_bench_")
    warm_dir, cold_dir = os.path.join(work, "warm"), os.path.join(work, "cold")
    base_env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    base_env.pop("PREFT_JAX_NO_CACHE", None)
    results = {v: ([], []) for v in args.variants}
    outputs = set()
    try:
        if args.server:
            _run_server(args.prompt, {**base_env, "PREFT_JAX_CACHE_DIR": warm_dir}, True)
        else:
            _run(cmd, {**base_env, "PREFT_JAX_CACHE_DIR": warm_dir})      # fill the warm cache
        for _ in range(args.runs):
            for v in args.variants:
                env = dict(base_env)
                if v == "no-cache":
                    run_cmd = cmd + ["--no-cache"]
                    env["PREFT_JAX_CACHE_DIR"] = cold_dir                 # never written
                elif v == "cold":
                    shutil.rmtree(cold_dir, ignore_errors=True)
                    run_cmd, env["PREFT_JAX_CACHE_DIR"] = cmd, cold_dir
                else:
                    run_cmd, env["PREFT_JAX_CACHE_DIR"] = cmd, warm_dir
                if args.server:
                    a, b, out = _run_server(args.prompt, env, v != "no-cache")
                else:
                    a, b, out = _run(run_cmd, env)
                results[v][0].append(a)
                results[v][1].append(b)
                outputs.add(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    load = os.getloadavg()
    what = "`python -m serve server`" if args.server else f"`python -m preft_jax \"{args.prompt}\"`"
    print(f"{what}, {args.runs} runs per variant, {os.cpu_count()} CPUs, "
          f"load average at end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    if args.server:
        print("| variant | s to /health 200, median [min-max] | s to first chat answer, median [min-max] |")
    else:
        print("| variant | wall s, median [min-max] | CPU s (user+sys), median [min-max] |")
    print("|---|---|---|")
    for v in args.variants:
        print(f"| {v} | {_fmt(results[v][0])} | {_fmt(results[v][1])} |")
    if len(outputs) != 1:
        print(f"\nWARNING: the variants printed different answers: {outputs}")
    else:
        print(f"\nanswer (all runs): {outputs.pop()!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
