"""Measure how a bfloat16 frozen base changes an SFT loss curve against float32 (same data, seed, steps).

    python -m experiments.precision_check --steps 20 --adapter lora --rank 8 [--model PATH] [--out runs/precision.json]

Prints (and writes) both curves and the per-step |difference| (max, mean, at the end). The adapter
and the optimizer state are float32 in both runs; only the base weights and activations change.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax.numpy as jnp
import numpy as np

from train.config import AdapterSpec, OptimizerConfig
from train.sft import SFTConfig, SFTTrainer


def main(argv=None):
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model
    from preft_jax.model import Llama
    from train.data import load_split, split_path, tokenize_dataset, write_dataset

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--adapter", default="lora", choices=("lora", "reft"))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--data", default="runs/precision_data")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    if not split_path(a.data, "train").is_file():
        write_dataset(a.data, 128, 8, 0)
    cfg, params, tok = load_model(a.model)
    data = tokenize_dataset(tok, load_split(a.data, "train"), max_len=a.seq_len)
    tc = SFTConfig(adapter=AdapterSpec(kind=a.adapter, rank=a.rank), steps=a.steps, batch_size=a.batch_size,
                   seq_len=a.seq_len, log_every=5, optimizer=OptimizerConfig(lr=a.lr, warmup_steps=2))
    curves, seconds = {}, {}
    for name in ("float32", "bfloat16"):
        runner = ModelRunner(Llama.from_params(cfg, params, dtype=jnp.dtype(name)))
        t0 = time.time()
        _, hist = SFTTrainer(cfg, runner.graphdef, runner.state, tc).fit(data, pad_id=tok.pad_token_id or 0)
        curves[name], seconds[name] = [h["loss"] for h in hist], time.time() - t0
    f32, bf16 = np.array(curves["float32"]), np.array(curves["bfloat16"])
    diff = np.abs(bf16 - f32)
    result = {"config": tc.to_json(), "model": a.model or "SmolLM2-135M-Instruct (embedded)", "curves": curves,
              "abs_diff_max": float(diff.max()), "abs_diff_mean": float(diff.mean()),
              "rel_diff_max": float((diff / np.abs(f32)).max()), "final": [float(f32[-1]), float(bf16[-1])],
              "seconds": seconds}
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
