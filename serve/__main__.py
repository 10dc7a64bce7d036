"""Command line: one-off generation or the OpenAI-compatible server (`python -m serve ...`, or the
`preft-serve ...` console script).

    python -m serve generate --prompt "What is the capital of France?" [--adapter NAME=FOLDER ...]
                             [--use|--adapter-name NAME] [--max-tokens 64] [--temperature 0] [--mode prefill|all]
    python -m serve server [--host 127.0.0.1] [--port 8000] [--adapter NAME=FOLDER ...]
                           [--mode prefill|all] [--slots 8] [--max-len 1024]
                           [--model PATH|tiny] [--capacity 16] [--lora-rank 16] [--reft-rank 8]
                           [--api-key KEY] [--admin-key KEY] [--allow-unauthenticated-admin]
                           [--adapter-root DIR] [--max-queued 1024] [--request-timeout 600]
                           [--max-body-bytes 4194304] [--shutdown-grace 10]
                           [--header-timeout 10] [--body-timeout 60] [--keep-alive-timeout 5]
                           [--max-header-bytes 16384] [--limit-concurrency N]
                           [--warmup background|full|none] [--warmup-logprobs] [--decode-steps-per-call 1]
    both: [--backend auto|jnp|xla|pallas] [--dtype float32|bfloat16] [--quantize int8|int4]
          [--mesh data=D,tensor=T] [--cpu-decode auto|native|xla] [--cpu-binding off|on]
          [--no-cache] [--quiet]

`python -m serve generate --help` / `server --help` list every flag with its default.

Both enable the persistent compilation cache at start-up (`preft_jax.cache.fast_start`, as
`python -m preft_jax` does; docs/caching.md); `--no-cache` leaves it and the weight cache off.

`--model tiny` is a small random-weight model with a UTF-8 byte tokenizer (demos, fault tests).

A missing model or adapter folder, or an adapter that does not load, exits with status 2 and a
message on stderr.
"""
from __future__ import annotations

import argparse
import os
import sys


class CliError(Exception):
    """A user error: printed as `error: ...`, exit status 2."""


def _parse_adapters(specs: list[str]) -> dict[str, str]:
    from serve.errors import RequestError
    from serve.registry import check_adapter_name
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise CliError(f"--adapter takes NAME=FOLDER, got {spec!r}")
        try:
            check_adapter_name(name)
        except RequestError as e:
            raise CliError(f"--adapter {spec!r}: {e}") from None
        if name in out:
            raise CliError(f"adapter name {name!r} given twice")
        if not os.path.isdir(folder):
            raise CliError(f"adapter folder for {name!r} does not exist or is not a folder: {folder}")
        out[name] = folder
    return out


def _parse_mesh(spec):
    """--mesh data=D,tensor=T -> a jax Mesh over every device (None when not given)."""
    if spec is None:
        return None
    from preft_jax.sharding import mesh_from_spec
    try:
        return mesh_from_spec(spec)
    except ValueError as e:
        raise CliError(f"--mesh: {e}") from None


def _load_model(path, no_cache: bool = False, quiet: bool = False, mesh=None, dtype: str = "float32"):
    """(cfg, params, tokenizer): the weights placed in `dtype` on the mesh (one device without), an HF
    folder streamed tensor by tensor (preft_jax.loading.load_model_sharded)."""
    from preft_jax.loading import load_model_sharded
    if path == "tiny":
        from preft_jax.config import tiny_config
        from serve.byte_tokenizer import ByteTokenizer
        from serve.tiny_model import tiny_params
        cfg = tiny_config(max_seq_len=1024)
        return cfg, tiny_params(cfg), ByteTokenizer()
    try:
        return load_model_sharded(path, mesh, dtype, cache=False if no_cache else None,
                                  progress=False if quiet else None)
    except FileNotFoundError as e:
        raise CliError(f"model not found: {e}") from None
    except (ValueError, OSError) as e:
        raise CliError(f"could not load the model {path!r}: {e}") from None


def _load_adapter_weights(cfg, folders: dict[str, str]) -> dict:
    from preft_jax.adapters.reft_io import load_adapter
    weights = {}
    for name, folder in folders.items():
        try:
            weights[name] = load_adapter(folder, cfg)
        except (ValueError, OSError) as e:
            raise CliError(f"could not load adapter {name!r} from {folder}: {e}") from None
    return weights


def _build_engine(cfg, params, tokenizer, weights: dict, *, capacity, lora_rank, reft_rank, mode, backend,
                  dtype="float32", adapter_dir=None, host_cache_bytes=1 << 30, mesh=None, quantize=None,
                  model_path=None, max_invocation_tokens=16, **engine_kw):
    """ModelRunner + AdapterRegistry (tiers) + Engine; engine_kw are EngineConfig fields. quantize:
    "int8" | "int4" base weights (GGUF Q8_0 / Q4_0 tensors of `model_path` read as they are)."""
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from preft_jax.loading.quantized import quantize_model_params
    from preft_jax.quantize import quantize_params
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    max_len = engine_kw.get("max_model_len", 1024)
    if max_len > cfg.max_seq_len:
        raise CliError(f"--max-model-len {max_len} exceeds the model's context {cfg.max_seq_len}")
    try:
        if quantize:
            params = (quantize_params(cfg, params, quantize, dtype) if model_path == "tiny"
                      else quantize_model_params(cfg, params, quantize, dtype, path=model_path))
        runner = ModelRunner(Llama.from_params(cfg, params, dtype=dtype, adapter_backend=backend), mesh=mesh)
        registry = AdapterRegistry(cfg, capacity, lora_rank=lora_rank, reft_rank=reft_rank, dtype=runner.dtype,
                                   adapter_dir=adapter_dir, host_cache_bytes=host_cache_bytes,
                                   max_invocation_tokens=max_invocation_tokens)
    except ValueError as e:
        raise CliError(str(e)) from None
    from serve.errors import AdapterLoadError, RequestError
    for name, w in weights.items():
        try:
            registry.load(name, w)
        except AdapterLoadError as e:   # NaN/Inf weights, bad shapes; AdapterFitError names --lora-rank / --reft-rank
            raise CliError(str(e)) from None
        except RequestError as e:       # a name taken by --adapter-dir, ...
            raise CliError(f"--adapter {name}: {e}") from None
    try:
        engine_kw["max_prefill_seqs"] = min(engine_kw.get("max_prefill_seqs", 4), engine_kw.get("max_num_seqs", 16))
        return Engine(runner, registry, EngineConfig(mode=mode, **engine_kw), tokenizer)
    except ValueError as e:
        raise CliError(str(e)) from None


def _ranks(weights: dict) -> tuple[int, int]:
    from preft_jax.adapters.config import LoraWeights
    lora = [w.config.rank for w in weights.values() if isinstance(w, LoraWeights)]
    reft = [w.config.rank for w in weights.values() if not isinstance(w, LoraWeights)]
    return max(lora, default=1), max(reft, default=1)


def cmd_generate(args) -> int:
    from preft_jax.sampling import SamplingParams
    folders = _parse_adapters(args.adapter)
    if args.use is None and len(folders) == 1:
        args.use = next(iter(folders))
    if args.use is not None and args.use not in folders:
        raise CliError(f"--use {args.use!r}: no such --adapter (given: {', '.join(folders) or 'none'})")
    import dataclasses

    from preft_jax.sampling import SamplingError, flag_error
    try:                        # the flags first: a bad value is one line before the model loads
        sp = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_tokens)
    except SamplingError as e:
        raise CliError(flag_error(e, {"temperature": "--temperature", "max_new_tokens": "--max-tokens"})) from None
    mesh = _parse_mesh(args.mesh)
    cfg, params, tok = _load_model(args.model, args.no_cache, args.quiet, mesh, args.dtype)
    weights = _load_adapter_weights(cfg, folders)
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    max_len = min(cfg.max_seq_len, len(prompt_ids) + args.max_tokens + 1)
    if len(prompt_ids) + 1 >= max_len:
        raise CliError(f"prompt of {len(prompt_ids)} tokens does not fit the context {cfg.max_seq_len}")
    lora_rank, reft_rank = _ranks(weights)
    engine = _build_engine(cfg, params, tok, weights, capacity=len(weights), lora_rank=lora_rank,
                           reft_rank=reft_rank, mode=args.mode, backend=args.backend, dtype=args.dtype, mesh=mesh,
                           quantize=args.quantize, model_path=args.model,
                           max_num_seqs=1, max_prefill_seqs=1, max_model_len=max_len,
                           max_num_batched_tokens=max(2, min(512, max_len)), cpu_decode=args.cpu_decode,
                           cpu_binding=args.cpu_binding,
                           max_invocation_tokens=max([16] + [len(w.config.policy.invocation_tokens or ())
                                                             for w in weights.values()]))
    sp = dataclasses.replace(sp, stop_token_ids=tuple(tok.eos_token_ids))
    from serve.errors import InvocationMissingError
    try:
        result = engine.generate([(prompt_ids, args.use, sp)])[0]
    except InvocationMissingError as e:     # the chat-templated prompt lacks an aLoRA adapter's invocation
        raise CliError(str(e)) from None
    print(result.text)
    return 0


def _configure_logging(level: str) -> None:
    """The server's log format, set before anything logs (the cache's and the native library's one
    line per degraded mode included); Orbax's (absl) per-load INFO chatter is left out."""
    import logging
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)


def cmd_server(args) -> int:
    from serve.access import ServerConfig
    from serve.server import ListenError, create_app, listen_socket, serve_forever
    folders = _parse_adapters(args.adapter)
    if not 0 <= args.port <= 65535:          # else the socket takes it modulo 65536: another port
        raise CliError(f"--port must be in [0, 65535], got {args.port}")
    try:
        server_config = ServerConfig(api_key=args.api_key, admin_key=args.admin_key,
                                     allow_unauthenticated_admin=args.allow_unauthenticated_admin,
                                     adapter_root=args.adapter_root, max_body_bytes=args.max_body_bytes,
                                     shutdown_grace=args.shutdown_grace, header_timeout=args.header_timeout,
                                     body_timeout=args.body_timeout, keep_alive_timeout=args.keep_alive_timeout,
                                     max_header_bytes=args.max_header_bytes, limit_concurrency=args.limit_concurrency)
    except ValueError as e:
        raise CliError(str(e)) from None
    mesh = _parse_mesh(args.mesh)
    try:
        sock = listen_socket(args.host, args.port)          # before the model: a bad address fails at once
    except ListenError as e:
        raise CliError(str(e)) from None
    port = sock.getsockname()[1]                            # --port 0: the one the system picked
    cfg, params, tok = _load_model(args.model, args.no_cache, args.quiet, mesh, args.dtype)
    weights = _load_adapter_weights(cfg, folders)
    engine = _build_engine(cfg, params, tok, weights, capacity=args.max_device_adapters, lora_rank=args.lora_rank,
                           reft_rank=args.reft_rank, mode=args.mode, backend=args.backend, dtype=args.dtype,
                           adapter_dir=args.adapter_dir, host_cache_bytes=args.host_cache_bytes, mesh=mesh,
                           quantize=args.quantize, model_path=args.model,
                           max_invocation_tokens=args.max_invocation_tokens,
                           max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                           max_prefill_seqs=args.max_prefill_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           block_size=args.block_size, kv_cache_tokens=args.kv_cache_tokens,
                           kv_cache_memory=args.kv_cache_memory, enable_prefix_cache=not args.no_prefix_cache,
                           cpu_decode=args.cpu_decode, cpu_binding=args.cpu_binding,
                           max_queued=args.max_queued, request_timeout=args.request_timeout or None,
                           max_request_sequences=args.max_request_sequences,
                           max_request_prompt_logprob_tokens=args.max_request_prompt_logprob_tokens,
                           warmup_logprobs=args.warmup_logprobs, decode_steps_per_call=args.decode_steps_per_call)
    warmup = "none" if args.no_warmup else args.warmup
    if warmup == "full":
        seconds = engine.warmup(progress=lambda msg: print(f"warmup: {msg}", file=sys.stderr, flush=True))
        print(f"warmup: done in {seconds:.1f} s", file=sys.stderr, flush=True)
    elif warmup == "background":
        n = engine.warm_in_background()
        print(f"warmup: {n} programs compile in the background while the engine is idle "
              f"(GET /health: warmup_pending)", file=sys.stderr, flush=True)
    model_id = args.model_id or ("smollm2-135m-instruct" if args.model is None else
                                 "tiny" if args.model == "tiny" else
                                 os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0])
    app = create_app(engine, tok, model_id=model_id, config=server_config)
    admin = ("admin key" if args.admin_key else "UNAUTHENTICATED" if args.allow_unauthenticated_admin
             else "disabled")
    print(f"serving {model_id!r} (+ {len(weights)} adapter(s), mode={args.mode}) on "
          f"http://{args.host}:{port}/v1 (api key: {'on' if args.api_key else 'off'}, adapter admin: {admin})",
          file=sys.stderr, flush=True)
    serve_forever(app, host=args.host, port=port, log_level=args.log_level, sock=sock)
    return 0


def build_parser(prog: str = "python -m serve") -> argparse.ArgumentParser:
    from preft_jax import __version__
    from preft_jax.config import QUANT_MODES
    from preft_jax.cli_help import HelpFormatter
    p = argparse.ArgumentParser(prog=prog, description="preft_jax serving: PreFT adapted prefill, base-weights "
                                "decode.", formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"preft-jax {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{generate,server}")

    def common(sp):
        sp.add_argument("--model", default=None,
                        help="a .gguf file, an HF folder, or 'tiny' (default: embedded SmolLM2-135M)")
        sp.add_argument("--adapter", action="append", default=[], metavar="NAME=FOLDER",
                        help="load a PEFT LoRA or ReFT adapter folder under NAME (repeatable)")
        sp.add_argument("--mode", choices=("prefill", "all"), default="prefill",
                        help="prefill: adapters at prefill only (PreFT); all: adapters at every token")
        sp.add_argument("--backend", choices=("auto", "jnp", "xla", "pallas"), default="auto",
                        help="adapter backend (auto: pallas on TPU/GPU where the kernels lower, else xla; jnp on CPU)")
        sp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights, KV cache and adapter bank dtype")
        sp.add_argument("--quantize", choices=QUANT_MODES, default=None,
                        help="base weights int8 (per channel) or int4 (grouped) through qwix; adapters, KV cache "
                             "and activations stay in --dtype (docs/quantization.md)")
        sp.add_argument("--mesh", default=None, metavar="data=D,tensor=T",
                        help="shard over every device: tensor-parallel heads/ffn/vocab, data-parallel rows "
                             "(sizes default to 1; their product must equal the device count)")
        sp.add_argument("--cpu-decode", choices=("auto", "native", "xla"), default="auto",
                        help="on one CPU device in float32: native = the native decode step and native base "
                             "projections (pallas_kernels.cpu), xla = XLA:CPU for everything; auto = native where "
                             "its library builds")
        sp.add_argument("--cpu-binding", choices=("off", "on"), default="off",
                        help="on: the thread that steps the engine on a core of its own, XLA's and the native "
                             "step's threads on the other cores (faster where host work is large next to the step, "
                             "e.g. a small model with many rows; costs the computation one core: "
                             "docs/serving.md); off: the OS places them")
        sp.add_argument("--no-cache", action="store_true",
                        help="neither read nor write the weight / compilation caches (see docs/caching.md)")
        sp.add_argument("--quiet", action="store_true", help="no progress bars")

    g = sub.add_parser("generate", help="print the completion of one chat prompt", formatter_class=HelpFormatter,
                       description="Print the completion of one chat prompt (the chat template is applied).")
    common(g)
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--use", "--adapter-name", dest="use", default=None, metavar="NAME",
                   help="adapter to use (default: the base model, or the only --adapter given)")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("server", help="run the OpenAI-compatible HTTP server", formatter_class=HelpFormatter,
                       description="Run the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                   "/v1/models, adapter load/unload, /health, /metrics).")
    common(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--max-num-seqs", "--slots", dest="max_num_seqs", type=int, default=16,
                   help="sequences running at once (decode rows)")
    s.add_argument("--max-model-len", "--max-len", dest="max_model_len", type=int, default=1024,
                   help="tokens per sequence (prompt + completion)")
    s.add_argument("--max-prefill-seqs", "--prefill-batch", dest="max_prefill_seqs", type=int, default=4,
                   help="prompts prefilled per step")
    s.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="tokens per step (decode + prefill chunks); longer prompts are prefilled in chunks")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    s.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV pool size in tokens (default: max-num-seqs x max-model-len)")
    s.add_argument("--kv-cache-memory", type=int, default=None, help="KV pool size in bytes (instead of tokens)")
    s.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    s.add_argument("--max-device-adapters", "--capacity", dest="max_device_adapters", type=int, default=16,
                   help="device adapter bank slots (PreFT holds one only during a request's prefill)")
    s.add_argument("--adapter-dir", default=None,
                   help="a folder of adapter folders, found by name on first use (PEFT, ReFT, pyreft, Orbax)")
    s.add_argument("--host-cache-bytes", type=int, default=1 << 30,
                   help="host memory for loaded adapters (LRU beyond it)")
    s.add_argument("--lora-rank", type=int, default=16, help="largest LoRA rank the bank holds")
    s.add_argument("--reft-rank", type=int, default=8, help="largest ReFT rank the bank holds")
    s.add_argument("--max-invocation-tokens", type=int, default=16,
                   help="longest invocation sequence of an activated (aLoRA) adapter the bank holds")
    s.add_argument("--model-id", default=None, help="the base model's name in the API (default: from --model)")
    s.add_argument("--log-level", default="info", type=str.lower, choices=("critical", "error", "warning", "info", "debug"),
                   help="server and engine log level")
    s.add_argument("--api-key", default=os.environ.get("PREFT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 endpoints (default: $PREFT_API_KEY, else none)")
    s.add_argument("--admin-key", default=os.environ.get("PREFT_ADMIN_KEY"),
                   help="key for adapter load/unload (default: $PREFT_ADMIN_KEY); without one those endpoints are off")
    s.add_argument("--allow-unauthenticated-admin", action="store_true",
                   help="allow adapter load/unload without a key (trusted networks only)")
    s.add_argument("--adapter-root", default=None,
                   help="run-time adapter loads read only folders under this directory")
    s.add_argument("--max-queued", type=int, default=1024, help="waiting requests before 429")
    s.add_argument("--max-request-sequences", type=int, default=64,
                   help="sequences one request may start (prompts x n); more is a 400")
    s.add_argument("--max-request-prompt-logprob-tokens", type=int, default=8192,
                   help="prompt tokens one request may ask log-probabilities of (echo + logprobs); more is a 400")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="total seconds a request may take, queue included (0 = no limit)")
    s.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted (413 beyond)")
    s.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish on SIGTERM before they fail (/health answers "
                        "503 meanwhile; a second signal exits at once)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's headers may take to arrive before the connection is closed (slowloris)")
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request's body may take to arrive after its headers (408 beyond)")
    s.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    s.add_argument("--max-header-bytes", type=int, default=16 * 1024,
                   help="largest request line + headers accepted (400 beyond)")
    s.add_argument("--limit-concurrency", type=int, default=None,
                   help="open connections + requests in progress before new requests get 503 (default: no limit)")
    s.add_argument("--warmup", choices=("background", "full", "none"), default="background",
                   help="compile every shape bucket in the background while idle, serving at once (default); "
                        "'full': all of them before the port opens; 'none': each on first use")
    s.add_argument("--no-warmup", action="store_true", help="same as --warmup none")
    s.add_argument("--warmup-logprobs", action="store_true",
                   help="also compile the log-probability variants at start-up (else on the first such request)")
    s.add_argument("--decode-steps-per-call", type=int, default=1, metavar="K",
                   help="fuse K decode steps into one device call while only decoding runs (fewer dispatches "
                        "and host passes; tokens stream K at a time; docs/serving.md)")
    s.set_defaults(func=cmd_server)
    return p


def main(argv=None, prog: str = "python -m serve") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.command == "server":
        _configure_logging(args.log_level)
    from preft_jax.cache.startup import fast_start
    fast_start(use_cache=not args.no_cache)       # before anything compiles
    try:
        return args.func(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def console() -> int:
    """The `preft-serve` console script."""
    return main(prog="preft-serve")


if __name__ == "__main__":
    sys.exit(main())
