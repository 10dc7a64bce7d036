"""Serving throughput: base vs PreFT-LoRA vs PreFT-ReFT vs all-token LoRA, 1..512 adapters, one run.

    python -m experiments.serve_benchmark [--model tiny|PATH] [--adapters 1,8,64,512] [--slots 16]
                              [--backend auto|jnp|xla|pallas] [--dtype float32|bfloat16] [--no-hf]

Every variant serves the same requests (same prompts, greedy, fixed max tokens, no early stop)
through the continuous-batching Engine (its public `generate`); each request picks a random adapter
among N (the same picks for every variant at that N). Throughput = generated tokens / wall time of
the whole batch (prefill included). Each engine is warmed up (compiled) first; then the variants of
one N are timed round-robin `repeats` times (so load on the machine hits them alike) and the median
is reported; the base model is timed once per N group, and its median over the groups is the base.
Ratios are against all-token LoRA at the same N, and against the base.

Variants:
  base            no adapters at all (bank=None in prefill and decode)
  all-token LoRA  the multi-LoRA baseline: every prompt and generated token gathers its request's
                  LoRA (BGMV at decode)
  PreFT-LoRA      the same LoRA bank, applied to prompt tokens only; decode is the base model
  PreFT-ReFT      a LoReFT bank (a few layers), prompt tokens only; decode is the base model

`Workload`, `random_bank`, `Variant` and `run_serving` are reused by scripts/device_check.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters.bank import AdapterBank
from preft_jax.adapters.policy import PolicyTable, PositionPolicy
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.progress import progress, set_quiet
from preft_jax.sampling import SamplingParams
from serve.engine import Engine, EngineConfig, GenerationRequest
from serve.registry import AdapterRegistry

NO_STOP = (-1,)


@dataclasses.dataclass(frozen=True)
class Workload:
    slots: int = 16                        # decode slots (concurrent requests)
    requests: int = 32
    prefill_batch: int = 8
    prompt_len: int = 16
    max_tokens: int = 32
    repeats: int = 3
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o")
    lora_rank: int = 16
    reft_rank: int = 8
    reft_layers: tuple[int, ...] = (4, 12, 20, 28)

    def __post_init__(self):
        if min(self.slots, self.requests, self.prefill_batch, self.prompt_len, self.max_tokens, self.repeats) < 1:
            raise ValueError("workload sizes must be >= 1")


def random_bank(cfg, n, family, targets, rank, reft_layers, seed=0, dtype=jnp.float32) -> AdapterBank:
    """A bank of n random adapters (slot 0 base, prefill policy), drawn on the device in `dtype`."""
    L, dims, s = cfg.n_layers, cfg.projection_dims(), n + 1
    keys = iter(jax.random.split(jax.random.key(seed), 3 + 2 * len(targets)))
    rand = lambda *shape: 0.02 * jax.random.normal(next(keys), shape, dtype)
    policy = PolicyTable.encode([PositionPolicy()] * s)
    if family == "lora":
        A = {t: rand(L, s, dims[t][0], rank) for t in targets}
        B = {t: rand(L, s, rank, dims[t][1]) for t in targets}
        return AdapterBank(A, B, None, None, None, None, policy)
    layer_mask = np.zeros((L, 1, 1, 1), np.float32)
    layer_mask[[i for i in reft_layers if i < L]] = 1
    R = rand(L, s, rank, cfg.d_model) * jnp.asarray(layer_mask, dtype)
    return AdapterBank({}, {}, R, rand(L, s, rank, cfg.d_model), rand(L, s, rank), jnp.ones((s,), dtype), policy)


def bank_bytes(bank) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(bank) if x.ndim >= 2)


class Variant:
    """One engine (mode + bank) serving the benchmark's requests."""

    def __init__(self, label, runner, bank, mode, n_adapters, prompts, work: Workload):
        self.label, self.prompts, self.work = label, prompts, work
        names = [str(i) for i in range(1, n_adapters + 1)]
        reg = (AdapterRegistry(runner.cfg, capacity=0) if bank is None
               else AdapterRegistry.from_bank(runner.cfg, bank, names, mode="prefill"))   # engine sets its mode
        self.engine = Engine(runner, reg, EngineConfig(
            max_num_seqs=work.slots, max_model_len=work.prompt_len + work.max_tokens, mode=mode,
            max_prefill_seqs=work.prefill_batch, max_num_batched_tokens=work.slots + work.prefill_batch * work.prompt_len,
            enable_prefix_cache=False))         # every run prefills its prompts in full, like the first
        rng = np.random.default_rng(1000 + n_adapters)
        self.chosen = [None if bank is None else names[int(rng.integers(0, n_adapters))] for _ in prompts]
        self.rates: list[float] = []

    def _serve(self, prompts, chosen, max_tokens) -> tuple[int, float]:
        sp = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=NO_STOP)
        reqs = [GenerationRequest(p, name, sp) for p, name in zip(prompts, chosen)]
        t0 = time.perf_counter()
        results = self.engine.generate(reqs)
        dt = time.perf_counter() - t0
        return sum(len(r.tokens) for r in results), dt

    def warmup(self):
        """One untimed run of the whole workload: it compiles exactly the prefill and decode shapes
        the timed runs use (the schedule is deterministic), not every bucket `Engine.warmup` covers,
        which on a 24-layer model on a GPU is minutes of compiles per engine."""
        self._serve(self.prompts, self.chosen, self.work.max_tokens)

    def serve_all(self) -> float:
        """One run of the whole workload: its wall seconds (`run` records it in `rates`)."""
        tokens, dt = self._serve(self.prompts, self.chosen, self.work.max_tokens)
        assert tokens == len(self.prompts) * self.work.max_tokens
        return dt

    def run(self) -> float:
        dt = self.serve_all()
        self.rates.append(len(self.prompts) * self.work.max_tokens / dt)
        return self.rates[-1]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def spread(self) -> str:
        return f"{self.median:8.1f} tok/s (min {min(self.rates):.1f}, max {max(self.rates):.1f})"


def run_serving(runner: ModelRunner, work: Workload, adapter_counts: Sequence[int], *, seed: int = 0,
                log: Callable[[str], None] = print, deadline: float | None = None,
                after: Callable[[int, Variant, dict], None] | None = None):
    """Times base + the three adapter variants for each N. Returns (base Variant, [(N, {label: Variant})]).

    With `deadline` (a time.perf_counter() value), N groups that would start after it are skipped.
    `after(N, base, {label: Variant})` runs after each N group's timed runs, its engines still up
    (scripts/device_check.py breaks PreFT's cost down there)."""
    cfg = runner.cfg
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, work.prompt_len).tolist() for _ in range(work.requests)]
    base = Variant("base", runner, None, "prefill", 0, prompts, work)
    base.warmup()
    rows = []
    for n in progress(adapter_counts, "adapter counts", total=len(adapter_counts), unit="N"):
        if deadline is not None and time.perf_counter() > deadline:
            log(f"  N={n}: skipped (time budget)")
            continue
        lora = random_bank(cfg, n, "lora", work.lora_targets, work.lora_rank, work.reft_layers, n, runner.dtype)
        reft = random_bank(cfg, n, "reft", work.lora_targets, work.reft_rank, work.reft_layers, n + 1, runner.dtype)
        log(f"N={n}: LoRA bank {bank_bytes(lora) / 2**20:.1f} MiB, ReFT bank {bank_bytes(reft) / 2**20:.1f} MiB "
            f"({jnp.dtype(runner.dtype).name}; the LoRA bank is shared by all-token and PreFT)")
        variants = [Variant("all-token LoRA", runner, lora, "all", n, prompts, work),
                    Variant("PreFT-LoRA", runner, lora, "prefill", n, prompts, work),
                    Variant("PreFT-ReFT", runner, reft, "prefill", n, prompts, work)]
        for v in variants:
            v.warmup()
        for r in range(work.repeats):
            for v in variants:
                v.run()
            if r == work.repeats // 2:
                base.run()                       # once per N, between the variants' runs
        log(f"  N={n:4d} {'base':15s} {base.rates[-1]:8.1f} tok/s")
        for v in variants:
            log(f"  N={n:4d} {v.label:15s} {v.spread()}")
        rows.append((n, {v.label: v for v in variants}))
        if after is not None:
            after(n, base, rows[-1][1])
        for v in variants:                       # free the engines' caches and the banks
            v.engine = None
        del variants, lora, reft
    return base, rows


def table(base: Variant, rows) -> list[str]:
    """The markdown result table (medians; ratios vs all-token LoRA and vs base)."""
    b = base.median if base.rates else float("nan")
    out = ["| adapters N | base tok/s | all-token LoRA tok/s | PreFT-LoRA tok/s | PreFT-ReFT tok/s "
           "| PreFT-LoRA / all-token | PreFT-ReFT / all-token | PreFT-LoRA / base | all-token / base |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, res in rows:
        allt, pl, pr = (res[k].median for k in ("all-token LoRA", "PreFT-LoRA", "PreFT-ReFT"))
        out.append(f"| {n} | {b:.1f} | {allt:.1f} | {pl:.1f} | {pr:.1f} | {pl / allt:.2f}x | {pr / allt:.2f}x "
                   f"| {pl / b:.2f}x | {allt / b:.2f}x |")
    return out


def hf_peft_peer(args, prompts, n_adapters):
    """transformers + peft mixed-adapter generate (adapter_names=...) on the same GGUF, torch CPU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from preft_jax.loading.default_model import default_model_path
    path = default_model_path() if args.model is None else __import__("pathlib").Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tmods = [f"{t}_proj" for t in args.lora_targets.split(",")]
    conf = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules=tmods, init_lora_weights=False)
    model = get_peft_model(model, conf, adapter_name="a0")
    for i in range(1, n_adapters):
        model.add_adapter(f"a{i}", conf)
    model.eval()
    rng = np.random.default_rng(1)
    batch = prompts[:args.slots]
    names = [f"a{int(rng.integers(0, n_adapters))}" for _ in batch]
    ids = torch.tensor(batch)

    def once(max_new):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                                 max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        return (out.shape[1] - ids.shape[1]) * len(batch) / (time.perf_counter() - t0)

    once(2)
    return statistics.median(once(args.max_tokens) for _ in range(args.hf_repeats)), len(batch)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="'tiny' (random tiny model) or a GGUF/HF path; default SmolLM2-135M")
    ap.add_argument("--adapters", default="1,8,64,512", help="comma-separated numbers of adapters N")
    ap.add_argument("--slots", type=int, default=16, help="decode slots (concurrent requests)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-targets", default="q,k,v,o")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--reft-rank", type=int, default=8)
    ap.add_argument("--reft-layers", default="4,12,20,28")
    ap.add_argument("--backend", default="auto", choices=["auto", "jnp", "xla", "pallas"],
                    help="adapter backend (auto: pallas on TPU/GPU where the kernels lower, else xla; jnp on CPU)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="weights, KV cache and adapter banks")
    ap.add_argument("--hf-adapters", type=int, default=4)
    ap.add_argument("--hf-repeats", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF PEFT peer")
    ap.add_argument("--mesh", default=None, metavar="data=D,tensor=T",
                    help="shard the engine over every device (see docs/serving.md, tensor-parallel serving)")
    ap.add_argument("--plot", metavar="PNG", default=None,
                    help="also write throughput vs N per variant (experiments/serve_plots.py)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    set_quiet(args.quiet)
    from preft_jax.sharding import mesh_from_spec
    try:
        mesh = None if args.mesh is None else mesh_from_spec(args.mesh)
    except ValueError as e:
        ap.error(f"--mesh: {e}")
    t_start = time.perf_counter()

    if args.model == "tiny":
        from flax import nnx
        from preft_jax.config import tiny_config
        cfg = tiny_config(max_seq_len=512)
        model = Llama(cfg, rngs=nnx.Rngs(0), dtype=args.dtype, adapter_backend=args.backend)
        args.reft_layers = "0,2"
        args.no_hf = True
    else:
        from preft_jax.loading import load_model
        cfg, params, _ = load_model(args.model)
        model = Llama.from_params(cfg, params, dtype=args.dtype, adapter_backend=args.backend)
    runner = ModelRunner(model, mesh=mesh)
    work = Workload(slots=args.slots, requests=args.requests, prefill_batch=args.prefill_batch,
                    prompt_len=args.prompt_len, max_tokens=args.max_tokens, repeats=args.repeats,
                    lora_targets=tuple(args.lora_targets.split(",")), lora_rank=args.lora_rank,
                    reft_rank=args.reft_rank, reft_layers=tuple(int(x) for x in args.reft_layers.split(",")))
    print(f"# {jax.devices()[0].platform} ({jax.device_count()} device), backend={runner.adapter_backend}, "
          f"dtype={args.dtype}, model layers={cfg.n_layers} d={cfg.d_model}, slots={work.slots}, "
          f"requests={work.requests}, prompt={work.prompt_len}, max_tokens={work.max_tokens}, "
          f"prefill_batch={work.prefill_batch}, repeats={work.repeats}, LoRA {'/'.join(work.lora_targets)} "
          f"r={work.lora_rank}, ReFT r={work.reft_rank} layers={work.reft_layers}", flush=True)
    base, rows = run_serving(runner, work, [int(x) for x in args.adapters.split(",")],
                             log=lambda s: print(s, flush=True))
    hf = None
    if not args.no_hf:
        print("HF transformers + peft peer ...", flush=True)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, cfg.vocab_size, work.prompt_len).tolist() for _ in range(work.requests)]
        hf = hf_peft_peer(args, prompts, args.hf_adapters)

    print(f"\nbase (no adapters): median {base.median:.1f} tok/s over {len(base.rates)} runs (one per N group), "
          f"min {min(base.rates):.1f}, max {max(base.rates):.1f}\n")
    print("\n".join(table(base, rows)))
    if args.plot:
        from experiments.serve_plots import throughput_plot
        throughput_plot(base.median, {n: {k: (v.median, min(v.rates), max(v.rates)) for k, v in res.items()}
                                      for n, res in rows}, args.plot)
    if hf is not None:
        rate, batch = hf
        print(f"\nHF transformers + peft mixed-adapter generate ({args.hf_adapters} LoRA adapters "
              f"{'/'.join(work.lora_targets)} r={work.lora_rank}, batch {batch}, {work.max_tokens} new tokens, "
              f"torch CPU, median of {args.hf_repeats}): {rate:.1f} tok/s")
    print(f"\ntotal benchmark wall time: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
