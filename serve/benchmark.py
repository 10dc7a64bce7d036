"""Serving throughput: base vs PreFT-LoRA vs PreFT-ReFT vs all-token LoRA, 1..512 adapters, one run.

    python -m serve.benchmark [--model tiny|PATH] [--adapters 1,8,64,512] [--slots 16] [--no-hf]

Every variant serves the same requests (same prompts, greedy, fixed max tokens, no early stop)
through the continuous-batching Engine; each request picks a random adapter among N. Throughput =
generated tokens / wall time (prefill included), median of --repeats runs after a warm-up run that
compiles. Ratios are against all-token LoRA at the same N, measured in this same run.
"""
from __future__ import annotations

import argparse
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


def random_bank(cfg, n, family, mode, targets, rank, reft_layers, seed=0) -> AdapterBank:
    """A bank of n random adapters (slot 0 base), built directly (no per-adapter copies)."""
    rng = np.random.default_rng(seed)
    L, dims, s = cfg.n_layers, cfg.projection_dims(), n + 1
    rand = lambda *shape: jnp.asarray((0.02 * rng.standard_normal(shape, np.float32)))
    at, fk, lk = (jnp.asarray(x) for x in policy_arrays([PositionPolicy(mode=mode)] * s))
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


def run_engine(runner, bank, mode, n_adapters, prompts, args):
    names = [str(i) for i in range(1, n_adapters + 1)]
    reg = AdapterRegistry(runner.cfg, capacity=0) if bank is None else AdapterRegistry.from_bank(runner.cfg, bank, names, mode=mode)
    eng = Engine(runner, reg, EngineConfig(n_slots=args.slots, max_len=args.prompt_len + args.max_tokens + 1,
                                           mode=mode, prefill_batch=args.prefill_batch))
    rng = np.random.default_rng(1)
    chosen = [None if bank is None else names[int(rng.integers(0, n_adapters))] for _ in prompts]
    sp = SamplingParams(max_new_tokens=args.max_tokens, stop_token_ids=(-1,))    # no early stop

    def once():
        reqs = [eng.submit(p, name, sp) for p, name in zip(prompts, chosen)]
        t0 = time.perf_counter()
        while eng.busy:
            eng.step()
        dt = time.perf_counter() - t0
        return sum(len(r.result.tokens) for r in reqs) / dt

    once()                                              # warm-up: compiles prefill + decode
    return statistics.median(once() for _ in range(args.repeats))


def hf_peft_peer(args, prompts, n_adapters):
    """transformers + peft mixed-adapter generate (adapter_names=...) on the same GGUF, torch CPU."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from preft_jax.loading.default_model import default_model_path
    path = default_model_path()
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

    def once():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                                 max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
        return (out.shape[1] - ids.shape[1]) * len(batch) / (time.perf_counter() - t0)

    once()
    return statistics.median(once() for _ in range(args.repeats))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="'tiny' (random tiny model) or a GGUF/HF path; default SmolLM2-135M")
    ap.add_argument("--adapters", default="1,8,64,512")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-targets", default="q,k,v,o")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--reft-rank", type=int, default=8)
    ap.add_argument("--reft-layers", default="4,12,20,28")
    ap.add_argument("--backend", default="jnp", choices=["jnp", "pallas"])
    ap.add_argument("--hf-adapters", type=int, default=4)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF PEFT peer")
    args = ap.parse_args(argv)

    if args.model == "tiny":
        from preft_jax.config import tiny_config
        from flax import nnx
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
    print(f"# {jax.devices()[0].platform}, backend={args.backend}, slots={args.slots}, requests={args.requests}, "
          f"prompt={args.prompt_len}, max_tokens={args.max_tokens}, LoRA {'/'.join(targets)} r={args.lora_rank}, "
          f"ReFT r={args.reft_rank} layers={reft_layers}", flush=True)

    base = run_engine(runner, None, "prefill", 0, prompts, args)
    rows = []
    for n in [int(x) for x in args.adapters.split(",")]:
        res = {}
        for label, family, mode in (("all-token LoRA", "lora", "all"), ("PreFT-LoRA", "lora", "prefill"),
                                    ("PreFT-ReFT", "reft", "prefill")):
            rank = args.lora_rank if family == "lora" else args.reft_rank
            bank = random_bank(cfg, n, family, mode, targets, rank, reft_layers, seed=n)
            res[label] = (run_engine(runner, bank, mode, n, prompts, args), bank_bytes(bank))
            del bank
            print(f"  N={n:4d} {label:15s} {res[label][0]:8.1f} tok/s  bank {res[label][1] / 2**20:8.1f} MiB", flush=True)
        rows.append((n, res))
    hf = None
    if not args.no_hf:
        hf = hf_peft_peer(args, prompts, args.hf_adapters)

    print("\n| adapters N | base tok/s | all-token LoRA tok/s | PreFT-LoRA tok/s | PreFT-ReFT tok/s "
          "| PreFT-LoRA / all-token | PreFT-ReFT / all-token | all-token / base |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, res in rows:
        allt, pl, pr = res["all-token LoRA"][0], res["PreFT-LoRA"][0], res["PreFT-ReFT"][0]
        print(f"| {n} | {base:.1f} | {allt:.1f} | {pl:.1f} | {pr:.1f} | {pl / allt:.2f}x | {pr / allt:.2f}x "
              f"| {allt / base:.2f}x |")
    if hf is not None:
        print(f"\nHF transformers+peft mixed-adapter generate ({args.hf_adapters} adapters, batch {args.slots}, "
              f"torch CPU): {hf:.1f} tok/s  (preft_jax base is {base / hf:.2f}x of it)")


if __name__ == "__main__":
    main()
