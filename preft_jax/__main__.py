"""`python -m preft_jax "question"` (or `preft-jax "question"`): chat with the default model, optionally
through an adapter."""
from __future__ import annotations

import argparse
import sys

import jax


def build_parser(prog: str = "python -m preft_jax") -> argparse.ArgumentParser:
    from preft_jax import __version__
    from preft_jax.cli_help import HelpFormatter
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--version", action="version", version=f"preft-jax {__version__}")
    ap.add_argument("prompt", help="user message (chat template applied) or raw text with --raw")
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    ap.add_argument("--adapter", default=None, help="adapter folder (PEFT LoRA or preft ReFT)")
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template")
    ap.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                    "whose probability reaches this")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed")
    ap.add_argument("--backend", choices=("auto", "jnp", "xla", "pallas"), default="auto",
                    help="adapter backend (auto: pallas on TPU/GPU where the kernels lower, else xla; jnp on CPU)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="weights, KV cache and adapter bank dtype")
    ap.add_argument("--no-cache", action="store_true",
                    help="neither read nor write the weight / compilation caches (see docs/caching.md)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def main(argv=None, prog: str = "python -m preft_jax") -> int:
    args = build_parser(prog).parse_args(argv)
    import dataclasses

    from preft_jax.sampling import SamplingError, SamplingParams, flag_error
    try:                        # the flags first: a bad value is one line before the model loads
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_tokens)
    except SamplingError as e:
        print("error: " + flag_error(e, {"temperature": "--temperature", "top_p": "--top-p",
                                         "max_new_tokens": "--max-tokens"}), file=sys.stderr)
        return 2
    if not -2 ** 63 <= args.seed < 2 ** 63:
        print(f"error: --seed must fit in 64 bits (a signed integer), got {args.seed}", file=sys.stderr)
        return 2
    from preft_jax.cache.startup import fast_start
    fast_start(use_cache=not args.no_cache)

    from preft_jax.adapters.bank import build_bank
    from preft_jax.adapters.reft_io import load_adapter
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model
    from preft_jax.model import Llama

    try:
        cfg, params, tok = load_model(args.model, cache=False if args.no_cache else None,
                                      progress=False if args.quiet else None)
        bank = build_bank(cfg, [load_adapter(args.adapter, cfg)], dtype=args.dtype) if args.adapter else None
        runner = ModelRunner(Llama.from_params(cfg, params, dtype=args.dtype, adapter_backend=args.backend))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.raw:       # as HF's tokenizer(text): BOS first where the tokenizer adds one
        ids = tok.encode(args.prompt, add_bos=tok.add_bos_default)
    else:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    sampling = dataclasses.replace(sampling, stop_token_ids=tuple(tok.eos_token_ids))
    try:
        out = runner.generate([ids], sampling, bank=bank, adapter_ids=[1] if bank is not None else None,
                              key=jax.random.key(args.seed))[0]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(tok.decode(out.tokens))
    return 0


def console() -> int:
    """The `preft-jax` console script."""
    return main(prog="preft-jax")


if __name__ == "__main__":
    sys.exit(main())
