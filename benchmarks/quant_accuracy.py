"""Accuracy of the quantized base (preft_jax.quantize) on SmolLM2-135M against the float32 model.

    python -m benchmarks.quant_accuracy [--prompts 20] [--tokens 32] [--sft-steps 40] [--json F]

1. Greedy agreement on a fixed prompt set (20 chat prompts x 32 new tokens, no early stop):
   * exact-sequence %: the variant's free-running greedy continuation equals float32's,
   * common prefix: mean number of leading tokens equal to float32's before the first difference,
   * token agreement %: teacher-forced top-1 agreement - fed float32's continuation, how often the
     variant's argmax is float32's next token (every position counts once; no drift after a miss),
   * KL: mean KL(float32 || variant) of the next-token distributions at those positions (nats).
   Variants: bfloat16 (a reference for "numerics differ a little"); int8 and int4 as `--quantize`
   builds them from this GGUF (the embedding / tied LM head read straight from the file's Q8_0
   blocks: the float model's exact values); both with the embedding requantized to int8 per
   vocabulary row from float (what an HF-folder model gets), which shows what quantizing the LM
   head costs; and int4 with symmetric (absmax) groups instead of the default asymmetric ones.
2. Short SFT (the train.sft trainer; LoRA rank 8, prefill mode, same seed and data for all):
   eval loss of the float32-base LoRA vs QLoRA on int8 / int4 bases, before and after training.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import log, write_json

PROMPTS = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Name three primary colors.",
    "How do I reverse a list in Python?",
    "Who wrote Romeo and Juliet?",
    "Give me a tip for sleeping better.",
    "What is the boiling point of water in Fahrenheit?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Summarize the plot of Cinderella in two sentences.",
    "What does a CPU do?",
    "List the planets of the solar system.",
    "What is a prime number?",
    "Suggest a name for a pet turtle.",
    "How many minutes are in a day?",
    "What is the difference between weather and climate?",
    "Write a short greeting for a birthday card.",
    "What is the largest ocean on Earth?",
]


def _runner(cfg, params, dtype, quant, gguf):
    """gguf: the file to read Q8_0 / Q4_0 blocks from (None: everything requantized from float).
    quant "int4-symmetric": int4 with absmax groups (qwix's default calibration) - for comparison."""
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from preft_jax.loading.quantized import direct_tensors
    from preft_jax.quantize import PROJECTIONS, QuantConfig, quantize_params
    mode = "int4" if quant == "int4-symmetric" else quant
    direct = direct_tensors(gguf, cfg, mode, list(params)) if gguf is not None and mode else None
    if quant == "int4-symmetric":
        import qwix
        group = QuantConfig("int4").group_for(cfg)
        sym = {n: qwix.quantize(jnp.asarray(params[n]), jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: group})
               for n in PROJECTIONS}
        params = quantize_params(cfg, {**params, **sym}, "int4", dtype, direct=direct)
    elif quant is not None:
        params = quantize_params(cfg, params, quant, dtype, direct=direct)
    return ModelRunner(Llama.from_params(cfg, params, dtype=dtype))


def weight_bytes(state) -> int:
    """Bytes of a model state as stored on the device (int4 packed two per byte, as XLA stores it)."""
    return int(sum(x.size * (0.5 if x.dtype == jnp.int4 else x.dtype.itemsize) for x in jax.tree.leaves(state)))


def _next_token_logprobs(runner, tokens, plens, n):
    """log-softmax [B, n, V] of the next-token distributions at positions plen-1 .. plen+n-2."""
    from preft_jax.generation import sequence_logits

    @jax.jit
    def f(state, tokens, plens):
        logits = sequence_logits(runner.graphdef, state, tokens, plens)
        pos = plens[:, None] - 1 + jnp.arange(n)[None, :]
        picked = jnp.take_along_axis(logits, pos[..., None], axis=1)
        return jax.nn.log_softmax(picked, axis=-1)
    return np.asarray(f(runner.state, tokens, plens))


def agreement(cfg, params, tok, variants, n_prompts, n_tokens, gguf):
    from preft_jax.sampling import SamplingParams
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:n_prompts]]
    sp = SamplingParams(max_new_tokens=n_tokens, stop_token_ids=(-1,))
    ref = _runner(cfg, params, jnp.float32, None, None)
    t0 = time.perf_counter()
    ref_out = [g.tokens for g in ref.generate(prompts, sp)]
    log(f"# float32 reference generated in {time.perf_counter() - t0:.0f} s")
    T = max(len(p) for p in prompts) + n_tokens
    T = -(-T // 16) * 16
    tokens = np.zeros((len(prompts), T), np.int32)
    for i, (p, o) in enumerate(zip(prompts, ref_out)):
        tokens[i, :len(p) + len(o)] = p + o
    plens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    tokens = jnp.asarray(tokens)
    ref_lp = _next_token_logprobs(ref, tokens, plens, n_tokens)
    log(f"# float32 weights {weight_bytes(ref.state) / 2 ** 20:.1f} MiB")
    target = np.asarray(ref_out)
    rows = []
    for label, dtype, quant, direct in variants:
        t0 = time.perf_counter()
        r = _runner(cfg, params, dtype, quant, gguf if direct else None)
        out = [g.tokens for g in r.generate(prompts, sp)]
        lp = _next_token_logprobs(r, tokens, plens, n_tokens).astype(np.float64)
        same = [a == b for a, b in zip(out, ref_out)]
        prefix = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), n_tokens) for a, b in zip(out, ref_out)]
        top1 = (lp.argmax(-1) == target).mean()
        p = np.exp(ref_lp.astype(np.float64))
        kl = (p * (ref_lp - lp)).sum(-1).mean()
        row = {"variant": label, "weight_mb": weight_bytes(r.state) / 2 ** 20,
               "exact_sequence_pct": 100 * np.mean(same), "common_prefix": float(np.mean(prefix)),
               "token_agreement_pct": 100 * float(top1), "kl": float(kl), "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"# {label}: exact {row['exact_sequence_pct']:.0f}%, prefix {row['common_prefix']:.1f}, "
            f"token {row['token_agreement_pct']:.1f}%, KL {row['kl']:.4f} ({row['seconds']:.0f} s)")
    return rows


def sft(cfg, params, tok, variants, steps, seed, gguf, data_dir):
    from train.config import AdapterSpec, OptimizerConfig
    from train.data import LazyTokenized, eval_batches, load_split, write_dataset
    from train.sft import SFTConfig, SFTTrainer
    write_dataset(data_dir, 256, 48, seed)
    train = LazyTokenized(tok, load_split(data_dir, "train"))
    evals = LazyTokenized(tok, load_split(data_dir, "eval"))
    tc = SFTConfig(adapter=AdapterSpec(kind="lora", rank=8, mode="prefill"), steps=steps, batch_size=8,
                   eval_batch_size=16, log_every=0, seed=seed, optimizer=OptimizerConfig(lr=1e-3, warmup_steps=5))
    rows = []
    for label, dtype, quant in variants:
        t0 = time.perf_counter()
        r = _runner(cfg, params, dtype, quant, gguf)
        tr = SFTTrainer(cfg, r.graphdef, r.state, tc)
        batches = eval_batches(evals, tc.eval_batch_size, tok.pad_token_id)
        before = tr.eval_loss(tr.init_state().params, batches)
        state, hist = tr.fit(train, evals, tok.pad_token_id)
        row = {"variant": label, "eval_loss_before": before, "eval_loss_after": hist[-1]["eval_loss"],
               "train_loss_last": hist[-1]["loss"], "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"# SFT {label}: eval loss {before:.4f} -> {row['eval_loss_after']:.4f} ({row['seconds']:.0f} s)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF / HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--sft-steps", type=int, default=40, help="0: skip the SFT part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from preft_jax.loading import load_model
    from preft_jax.loading.quantized import gguf_source
    from preft_jax.quantize import QuantConfig
    t_all = time.perf_counter()
    cfg, params, tok = load_model(args.model)
    gguf = gguf_source(args.model)
    log(f"# model {args.model or 'SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)'}, jax "
        f"{jax.__version__}, {jax.default_backend()}; int4 groups of {QuantConfig('int4').group_for(cfg)}")
    variants = [("bfloat16", jnp.bfloat16, None, False), ("int8", jnp.float32, "int8", True),
                ("int8, embedding requantized per row", jnp.float32, "int8", False),
                ("int4", jnp.float32, "int4", True),
                ("int4, embedding requantized per row", jnp.float32, "int4", False),
                ("int4, symmetric groups", jnp.float32, "int4-symmetric", True)]
    agree = agreement(cfg, params, tok, variants, args.prompts, args.tokens, gguf)
    log(f"\n| vs float32 ({args.prompts} prompts x {args.tokens} greedy tokens) | weights MiB | exact sequence | "
        f"common prefix (tokens) | token agreement (teacher-forced) | KL (nats/token) |\n|---|---:|---:|---:|---:|---:|")
    for r in agree:
        log(f"| {r['variant']} | {r['weight_mb']:.1f} | {r['exact_sequence_pct']:.0f}% | {r['common_prefix']:.1f} | "
            f"{r['token_agreement_pct']:.1f}% | {r['kl']:.4f} |")
    tuned = []
    if args.sft_steps:
        with tempfile.TemporaryDirectory() as d:
            tuned = sft(cfg, params, tok, [("float32 base (LoRA)", jnp.float32, None),
                                           ("int8 base (QLoRA)", jnp.float32, "int8"),
                                           ("int4 base (QLoRA)", jnp.float32, "int4")],
                        args.sft_steps, args.seed, gguf, d)
        ref = tuned[0]
        log(f"\n| SFT {args.sft_steps} steps, LoRA r8 prefill, seed {args.seed} | eval loss before | eval loss after "
            f"| delta vs float32 base |\n|---|---:|---:|---:|")
        for r in tuned:
            log(f"| {r['variant']} | {r['eval_loss_before']:.4f} | {r['eval_loss_after']:.4f} | "
                f"{r['eval_loss_after'] - ref['eval_loss_after']:+.4f} |")
    log(f"# total wall {time.perf_counter() - t_all:.0f} s")
    write_json(args.json, {"args": vars(args), "agreement": agree, "sft": tuned})
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
