"""Make the files vLLM needs for the peer benchmark (runs in preft_jax's own Python env).

    python benchmarks/vllm_peer/prepare.py --out /work/bench [--ranks 8 16] [--n-adapters 32]

writes

    OUT/smollm2_hf/                     the embedded SmolLM2-135M-Instruct GGUF as an HF float32 folder
                                        (config.json, model.safetensors, tokenizer files)
    OUT/adapters/r{rank}/lora_{i}/      PEFT LoRA folders, q/k/v/o/gate/up/down, every layer,
                                        random non-zero weights (seed = 1000 * rank + i)
    OUT/adapters/r{rank}_qkvo/lora_{i}/ the same with --targets q k v o (any subset: r{rank}_{targets})

The adapters are written with preft_jax's own `save_peft_lora`, so preft_jax and vLLM can serve the
very same files. vLLM applies a LoRA to every token, so the `preft_policy.json` sidecar says
mode="all" (preft_jax's all-token baseline); load them with mode="prefill" for PreFT-LoRA.

GGUF -> HF: transformers dequantizes the Q4_1 tensors to float32 (the same weights preft_jax's GGUF
loader produces). Existing outputs are kept unless --force.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def convert_model(out: pathlib.Path, force: bool = False) -> pathlib.Path:
    """GGUF -> HF folder (float32). Returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from preft_jax.loading.default_model import default_model_path

    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        print(f"model: kept {out}")
        return out
    folder, name = os.path.split(str(default_model_path()))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    # transformers refuses save_pretrained on a GGUF-loaded ("quantized") model although its tensors are
    # already dequantized: write the float32 state dict and a config without quantization_config by hand
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_name_or_path", None)
    cfg["architectures"] = [type(model).__name__]   # vLLM picks its model class from this
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok.save_pretrained(out)
    _check_same_logits(model, out)
    print(f"model: wrote {out}")
    return out


def _check_same_logits(gguf_model, folder: pathlib.Path) -> None:
    """The written folder must reload (plain transformers, no GGUF) to the same logits."""
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, gguf_model.config.vocab_size, (2, 12)))
    with torch.no_grad():
        a, b = gguf_model.eval()(ids).logits, reloaded(ids).logits
    err = float((a - b).abs().max())
    if not err <= 1e-4:
        raise RuntimeError(f"converted model at {folder} does not reproduce the GGUF logits (max |diff| {err})")
    print(f"model: reload check ok (max |logit diff| {err:.1e})")


def adapter_subdir(rank: int, targets=TARGETS) -> str:
    """adapters/<this>: r{rank} for all seven targets, else r{rank}_{joined targets} (e.g. r16_qkvo)."""
    return f"r{rank}" if tuple(targets) == TARGETS else f"r{rank}_{''.join(targets)}"


def random_lora_weights(model_config, rank: int, seed: int, alpha: float | None = None, targets=TARGETS):
    """Random non-zero LoRA on every target and layer, PEFT-like scale (A ~ 1/sqrt(d_in), B small)."""
    from preft_jax.adapters.config import LoraConfig, LoraWeights
    from preft_jax.adapters.policy import PositionPolicy

    rng = np.random.default_rng(seed)
    conf = LoraConfig(rank=rank, alpha=float(alpha if alpha is not None else 2 * rank), targets=tuple(targets),
                      policy=PositionPolicy(mode="all"))
    dims = model_config.projection_dims()
    L = model_config.n_layers
    A = {t: (rng.standard_normal((L, dims[t][0], rank)) / np.sqrt(dims[t][0])).astype(np.float32)
         for t in targets}
    B = {t: (0.02 * rng.standard_normal((L, rank, dims[t][1]))).astype(np.float32) for t in targets}
    return LoraWeights(conf, A, B)


def make_adapters(out: pathlib.Path, ranks, n_adapters: int, force: bool = False,
                  targets=TARGETS) -> list[pathlib.Path]:
    from preft_jax.adapters.peft_io import PEFT_CONFIG_NAME, PEFT_WEIGHTS_NAME, save_peft_lora
    from preft_jax.loading.gguf_loader import load_gguf

    model_config = None
    written = []
    for rank in ranks:
        for i in range(n_adapters):
            folder = out / adapter_subdir(rank, targets) / f"lora_{i}"
            written.append(folder)
            if (folder / PEFT_CONFIG_NAME).is_file() and (folder / PEFT_WEIGHTS_NAME).is_file() and not force:
                continue
            if model_config is None:
                model_config = load_gguf(None)[0]
            save_peft_lora(folder, random_lora_weights(model_config, rank, seed=1000 * rank + i, targets=targets),
                           model_config, base_model_name_or_path="SmolLM2-135M-Instruct")
    print(f"adapters: {len(written)} folders under {out} (ranks {list(ranks)}, {n_adapters} each, "
          f"targets {'/'.join(targets)})")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/work/bench", help="output root (default /work/bench)")
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="LoRA ranks (default 8 16)")
    p.add_argument("--n-adapters", type=int, default=32, help="adapters per rank (default 32)")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS,
                   help="LoRA targets (default all seven); a subset writes adapters/r{rank}_{targets}")
    p.add_argument("--force", action="store_true", help="rewrite existing outputs")
    args = p.parse_args(argv)
    if args.n_adapters < 1 or any(r < 1 for r in args.ranks):
        p.error("--n-adapters and --ranks must be positive")
    out = pathlib.Path(args.out).expanduser()
    convert_model(out / "smollm2_hf", force=args.force)
    targets = tuple(t for t in TARGETS if t in args.targets)
    make_adapters(out / "adapters", args.ranks, args.n_adapters, force=args.force, targets=targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
