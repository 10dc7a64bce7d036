"""Serving throughput: base vs PreFT-LoRA vs PreFT-ReFT vs all-token LoRA, 1..512 adapters, one run.

    python -m serve.benchmark [--model tiny|PATH] [--adapters 1,8,64,512] [--slots 16] [--no-hf]

Every variant serves the same requests (same prompts, greedy, fixed max tokens, no early stop)
through the continuous-batching Engine; each request picks a random adapter among N (the same
picks for every variant at that N). Throughput = generated tokens / wall time of the whole batch
(prefill included). Each engine is warmed up (compiled) first; then the variants of one N are
timed round-robin --repeats times (so load on the machine hits them alike) and the median is
reported; the base model is timed once per N group, and its median over the groups is the base.
Ratios are against all-token LoRA at the same N, and against the base.

Variants:
  base            no adapters at all (bank=None in prefill and decode)
  all-token LoRA  the multi-LoRA baseline: every prompt and generated token gathers its request's
                  LoRA (BGMV at decode)
  PreFT-LoRA      the same LoRA bank, applied to prompt tokens only; decode is the base model
  PreFT-ReFT      a LoReFT bank (a few layers), prompt tokens only; decode is the base model
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters.bank import AdapterBank, policy_arrays
from preft_jax.adapters.config import PositionPolicy
from preft_jax.generation import ModelRunner
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams
from serve.engine import Engine, EngineConfig
from serve.registry import AdapterRegistry

NO_STOP = (-1,)


def random_bank(cfg, n, family, targets, rank, reft_layers, seed=0) -> AdapterBank:
    """A bank of n random adapters (slot 0 base, prefill policy), built directly (no per-adapter copies)."""
    rng = np.random.default_rng(seed)
    L, dims, s = cfg.n_layers, cfg.projection_dims(), n + 1
    rand = lambda *shape: jnp.asarray(0.02 * rng.standard_normal(shape, np.float32))
    at, fk, lk = (jnp.asarray(x) for x in policy_arrays([PositionPolicy()] * s))
    if family == "lora":
        A = {t: rand(L, s, dims[t][0], rank) for t in targets}
        B = {t: rand(L, s, rank, dims[t][1]) for t in targets}
        return AdapterBank(A, B, None, None, None, None, at, fk, lk)
    layer_mask = np.zeros((L, 1, 1, 1), np.float32)
    layer_mask[list(reft_layers)] = 1
    R = rand(L, s, rank, cfg.d_model) * layer_mask
    return AdapterBank({}, {}, R, rand(L, s, rank, cfg.d_model), rand(L, s, rank), jnp.ones((s,)), at, fk, lk)


def bank_bytes(bank) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(bank) if x.ndim >= 2)


class Variant:
    """One engine (mode + bank) serving the benchmark's requests."""

    def __init__(self, label, runner, bank, mode, n_adapters, prompts, args):
        self.label, self.prompts, self.args = label, prompts, args
        names = [str(i) for i in range(1, n_adapters + 1)]
        reg = (AdapterRegistry(runner.cfg, capacity=0) if bank is None
               else AdapterRegistry.from_bank(runner.cfg, bank, names, mode="prefill"))   # engine sets its mode
        self.engine = Engine(runner, reg, EngineConfig(n_slots=args.slots, max_len=args.prompt_len + args.max_tokens,
                                                       mode=mode, prefill_batch=args.prefill_batch))
        rng = np.random.default_rng(1000 + n_adapters)
        self.chosen = [None if bank is None else names[int(rng.integers(0, n_adapters))] for _ in prompts]
        self.rates: list[float] = []

    def _serve(self, prompts, chosen, max_tokens) -> tuple[int, float]:
        sp = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=NO_STOP)
        reqs = [self.engine.submit(p, name, sp) for p, name in zip(prompts, chosen)]
        t0 = time.perf_counter()
        while self.engine.busy:
            self.engine.step()
        dt = time.perf_counter() - t0
        return sum(len(r.result.tokens) for r in reqs), dt

    def warmup(self):
        """Compiles this engine's prefill and decode (same shapes as the timed runs)."""
        k = self.args.prefill_batch
        self._serve(self.prompts[:k], self.chosen[:k], 2)

    def run(self) -> float:
        tokens, dt = self._serve(self.prompts, self.chosen, self.args.max_tokens)
        assert tokens == len(self.prompts) * self.args.max_tokens
        self.rates.append(tokens / dt)
        return self.rates[-1]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def spread(self) -> str:
        return f"{self.median:8.1f} tok/s (min {min(self.rates):.1f}, max {max(self.rates):.1f})"


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
    ap.add_argument("--backend", default="jnp", choices=["jnp", "pallas"])
    ap.add_argument("--hf-adapters", type=int, default=4)
    ap.add_argument("--hf-repeats", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF PEFT peer")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    if args.model == "tiny":
        from flax import nnx
        from preft_jax.config import tiny_config
        cfg = tiny_config(max_seq_len=512)
        model = Llama(cfg, rngs=nnx.Rngs(0), adapter_backend=args.backend)
        args.reft_layers = "0,2"
        args.no_hf = True
    else:
        from preft_jax.loading import load_model
        cfg, params, _ = load_model(args.model)
        model = Llama.from_params(cfg, params, adapter_backend=args.backend)
    runner = ModelRunner(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.requests)]
    targets = tuple(args.lora_targets.split(","))
    reft_layers = tuple(int(x) for x in args.reft_layers.split(","))
    print(f"# {jax.devices()[0].platform} ({jax.device_count()} device), backend={args.backend}, "
          f"model layers={cfg.n_layers} d={cfg.d_model}, slots={args.slots}, requests={args.requests}, "
          f"prompt={args.prompt_len}, max_tokens={args.max_tokens}, prefill_batch={args.prefill_batch}, "
          f"repeats={args.repeats}, LoRA {'/'.join(targets)} r={args.lora_rank}, "
          f"ReFT r={args.reft_rank} layers={reft_layers}", flush=True)

    base = Variant("base", runner, None, "prefill", 0, prompts, args)
    base.warmup()
    rows = []
    for n in [int(x) for x in args.adapters.split(",")]:
        lora = random_bank(cfg, n, "lora", targets, args.lora_rank, reft_layers, seed=n)
        reft = random_bank(cfg, n, "reft", targets, args.reft_rank, reft_layers, seed=n + 1)
        print(f"N={n}: LoRA bank {bank_bytes(lora) / 2**20:.1f} MiB, ReFT bank {bank_bytes(reft) / 2**20:.1f} MiB "
              f"(float32; the LoRA bank is shared by all-token and PreFT)", flush=True)
        variants = [Variant("all-token LoRA", runner, lora, "all", n, prompts, args),
                    Variant("PreFT-LoRA", runner, lora, "prefill", n, prompts, args),
                    Variant("PreFT-ReFT", runner, reft, "prefill", n, prompts, args)]
        for v in variants:
            v.warmup()
        for r in range(args.repeats):
            for v in variants:
                v.run()
            if r == args.repeats // 2:
                base.run()                       # once per N, between the variants' runs
        print(f"  N={n:4d} {'base':15s} {base.rates[-1]:8.1f} tok/s", flush=True)
        for v in variants:
            print(f"  N={n:4d} {v.label:15s} {v.spread()}", flush=True)
        rows.append((n, {v.label: v.median for v in variants}))
        del variants, lora, reft
    b = base.median
    hf = None
    if not args.no_hf:
        print("HF transformers + peft peer ...", flush=True)
        hf = hf_peft_peer(args, prompts, args.hf_adapters)

    print(f"\nbase (no adapters): median {b:.1f} tok/s over {len(base.rates)} runs (one per N group), "
          f"min {min(base.rates):.1f}, max {max(base.rates):.1f}")
    print("\n| adapters N | base tok/s | all-token LoRA tok/s | PreFT-LoRA tok/s | PreFT-ReFT tok/s "
          "| PreFT-LoRA / all-token | PreFT-ReFT / all-token | PreFT-LoRA / base | all-token / base |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, res in rows:
        allt, pl, pr = res["all-token LoRA"], res["PreFT-LoRA"], res["PreFT-ReFT"]
        print(f"| {n} | {b:.1f} | {allt:.1f} | {pl:.1f} | {pr:.1f} | {pl / allt:.2f}x | {pr / allt:.2f}x "
              f"| {pl / b:.2f}x | {allt / b:.2f}x |")
    if hf is not None:
        rate, batch = hf
        print(f"\nHF transformers + peft mixed-adapter generate ({args.hf_adapters} LoRA adapters "
              f"{'/'.join(targets)} r={args.lora_rank}, batch {batch}, {args.max_tokens} new tokens, torch CPU, "
              f"median of {args.hf_repeats}): {rate:.1f} tok/s")
    print(f"\ntotal benchmark wall time: {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
