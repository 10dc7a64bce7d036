"""Command-line pieces shared by `python -m train.sft` and `python -m train.grpo`.

Flags (defaults from the trainer's config class):

    adapter     --adapter {lora,reft} --rank --mode {prefill,all,activated} --alpha --targets q,v,... --layers 0,2
                --reft-kind {loreft,direft} --invocation TEXT|IDS (mode activated: the aLoRA invocation)
    optimizer   --lr --warmup-steps --weight-decay --grad-clip
    loop        --steps --seed --log-every --eval-every --logit-chunk --remat --pad-multiple
    mesh        --mesh data,fsdp,tensor            (multi-process: must use every device)
    checkpoint  --checkpoint-every --keep-checkpoints
    model       --model PATH --dtype {float32,bfloat16} --backend {auto,jnp,xla,pallas} --quantize {int8,int4}
                --attention {auto,xla,flash,...}
    processes   --coordinator HOST:PORT|auto --num-processes --process-id --local-device-count --init-timeout
    output      --out RUN_FOLDER  (checkpoints/, metrics.jsonl, adapter/, data/; resumes when it holds checkpoints)

`make_parser` gives both CLIs the same `--help` (prog in the `python -m` / `preft-train` form, every
flag with help and its default); `parse_noting` records which flags the user actually gave (the
dataset check of `train.data.prepare_dataset` compares only those).

`main_guard` turns the errors a user can fix (bad flags, unreachable coordinator, a mesh that does
not fit the devices, a checkpoint of another model / adapter / process count) into one
`error: ...` line on stderr and exit status 2, with nothing written.
"""
from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import traceback

from train import distributed as dist
from preft_jax.config import REMAT_WORDS, remat_from_word
from train.config import (ADAPTERS, BACKENDS, CHUNK_ATTENTION, DTYPES, MODES, QUANT_MODES, AdapterSpec,
                          CheckpointConfig, MeshConfig, ModelOptions, OptimizerConfig, TrainerConfig)

log = logging.getLogger("train")


def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None or text == "" or text == "all":
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_trainer_args(p: argparse.ArgumentParser, defaults: TrainerConfig, out: str) -> None:
    d = defaults
    g = p.add_argument_group("adapter")
    g.add_argument("--adapter", choices=ADAPTERS, default=d.adapter.kind, help="adapter type to train")
    g.add_argument("--rank", type=int, default=d.adapter.rank, help="LoRA / ReFT rank")
    g.add_argument("--mode", choices=MODES, default=d.adapter.mode,
                   help="prefill: the adapter acts on prompt tokens only (PreFT); all: on every token; activated: "
                        "from the last occurrence of --invocation in the prompt on (aLoRA)")
    g.add_argument("--alpha", type=float, default=d.adapter.alpha, help="LoRA alpha (default 2 * rank)")
    g.add_argument("--targets", default=",".join(d.adapter.targets),
                   help="comma-separated LoRA target projections")
    g.add_argument("--layers", type=_ints, default=d.adapter.layers,
                   help="comma-separated layer indices (default: all)")
    g.add_argument("--reft-kind", choices=("loreft", "direft"), default=d.adapter.reft_kind,
                   help="ReFT intervention")
    g.add_argument("--invocation", default=None,
                   help="mode activated (aLoRA): the invocation sequence the adapter acts from, as text (tokenized "
                        "without special-token handling, like PEFT's tokenizer.encode(..., add_special_tokens="
                        "False)) or as token ids: comma-separated ('12,34') or a JSON list ('[12]')")
    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=d.optimizer.lr, help="peak learning rate (AdamW, cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=d.optimizer.warmup_steps, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=d.optimizer.weight_decay, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=d.optimizer.grad_clip,
                   help="global gradient-norm clip (0: none)")
    g = p.add_argument_group("loop")
    g.add_argument("--steps", type=int, default=d.steps, help="training steps (batches)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the adapter init, batches and sampling "
                   "(and of a generated dataset)")
    g.add_argument("--log-every", type=int, default=d.log_every, help="steps between log lines (0: none)")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evaluations (0: at the end)")
    g.add_argument("--logit-chunk", type=int, default=d.logit_chunk,
                   help="sequence positions per vocabulary-projection chunk (memory vs speed)")
    g.add_argument("--remat", choices=REMAT_WORDS,
                   default="full" if d.remat is True else "off" if d.remat is False else d.remat,
                   help="what each layer recomputes in the backward pass: full (only its input kept; the least "
                        "memory), save_qkvo / save_projections (also keep those projections' outputs: fewer "
                        "FLOPs, more memory; benchmarks.memory_plan --remat plans it), off")
    g.add_argument("--pad-multiple", type=int, default=d.pad_multiple,
                   help="sequences are padded to a multiple of this (fewer distinct shapes: fewer compiles)")
    g.add_argument("--mesh", default=",".join(map(str, d.mesh.shape)), help="device mesh sizes data,fsdp,tensor")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint.every,
                   help="steps between Orbax checkpoints (0: only at the end of the run)")
    g.add_argument("--keep-checkpoints", type=int, default=d.checkpoint.max_to_keep,
                   help="newest checkpoints kept")
    g.add_argument("--out", default=out, help="run folder: checkpoints/, metrics.jsonl, adapter/, data/ "
                   "(a run resumes from its checkpoints)")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--fault-after-step", type=int, default=None, help=argparse.SUPPRESS)   # tests: SIGKILL
    g.add_argument("--sigterm-after-step", type=int, default=None, help=argparse.SUPPRESS)  # tests: SIGTERM
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded SmolLM2-135M)")
    g.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the frozen base model (adapter params and optimizer state stay float32)")
    g.add_argument("--backend", default="jnp", help=f"adapter backend, one of {BACKENDS} (the model validates it)")
    g.add_argument("--attention", choices=CHUNK_ATTENTION, default=None,
                   help="causal attention of the training forward: auto (flash kernels for a bfloat16 model on a "
                        "GPU/TPU, else xla), xla, flash (default: $PREFT_JAX_CHUNK_ATTENTION, else auto)")
    g.add_argument("--quantize", choices=QUANT_MODES, default=None,
                   help="frozen base weights int8 (per channel) or int4 (grouped), adapters in float: QLoRA "
                        "(docs/quantization.md)")
    dist.add_cli_args(p)


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the shared help style (preft_jax.cli_help)."""
    from preft_jax.cli_help import HelpFormatter
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)


def parse_noting(p: argparse.ArgumentParser, argv, dests) -> argparse.Namespace:
    """parse_args, plus `.given`: {dest: "--flag value"} for each of `dests` set on the command line."""
    unset = object()
    a = p.parse_args(argv, namespace=argparse.Namespace(**{k: unset for k in dests}))
    flags = {act.dest: act.option_strings[0] for act in p._actions if act.option_strings}
    a.given = {}
    for k in dests:
        if getattr(a, k) is unset:
            setattr(a, k, p.get_default(k))
        else:
            a.given[k] = f"{flags.get(k, k)} {getattr(a, k)}"
    return a


def data_dir(a) -> pathlib.Path:
    """--data, else <out>/data: a run's generated dataset lives with the run."""
    return pathlib.Path(a.data) if a.data else pathlib.Path(a.out) / "data"


class RunFolderError(ValueError):
    """--out cannot be the run folder (the message names it and why)."""


def check_run_folder(out: str | os.PathLike) -> pathlib.Path:
    """--out made (with its parents) and writable, before anything is loaded: a RunFolderError naming the
    flag and the fault (a file, a read-only folder) instead of a traceback from the first write."""
    from preft_jax.cache.location import writable_reason
    folder = pathlib.Path(out)
    why = writable_reason(folder)                 # creates it (and its parents), probes with a unique file
    if why and os.path.lexists(folder) and not os.path.isdir(folder):          # neither raises
        raise RunFolderError(f"--out {out}: not a folder")
    if why:
        raise RunFolderError(f"--out {out}: the run folder cannot be created or written ({why})")
    return folder


def prepare_data(a, params: dict, given: dict) -> pathlib.Path:
    """Checks the run folder (`check_run_folder`), generates or checks the run's dataset on process 0
    (train.data.prepare_dataset, one log line), then waits for it everywhere (`dist.on_primary`: a
    refusal there stops every process with its line). DatasetMismatchError (exit 2) when it does not
    fit the flags."""
    from train.data import prepare_dataset
    check_run_folder(a.out)
    folder = data_dir(a)
    said = dist.on_primary(lambda: prepare_dataset(folder, params, given), "preparing the dataset")
    if said is not None:
        log.info("%s", said)
    return folder


def invocation_ids(text: str | None, tokenizer=None) -> tuple[int, ...] | None:
    """--invocation -> token ids: comma-separated integers or a JSON list of them are ids; other text is
    tokenized by `tokenizer` (None: a placeholder (0,), for validating flags before the model loads)."""
    if text is None:
        return None
    body = text.strip()
    bracketed = body.startswith("[") and body.endswith("]")
    inner = body[1:-1] if bracketed else body
    parts = [p.strip() for p in inner.split(",")]
    if (bracketed or len(parts) > 1) and parts and all(p.isdigit() for p in parts):
        return tuple(int(p) for p in parts)
    if tokenizer is None:
        return (0,)
    ids = tuple(tokenizer.encode(text))
    if not ids:
        raise ValueError(f"--invocation {text!r} tokenizes to no tokens")
    return ids


def trainer_fields(a, tokenizer=None) -> dict:
    """The TrainerConfig fields (nested groups) from parsed flags (`tokenizer`: see `invocation_ids`)."""
    return dict(
        adapter=AdapterSpec(kind=a.adapter, rank=a.rank, mode=a.mode, alpha=a.alpha,
                            targets=tuple(t for t in a.targets.split(",") if t), layers=a.layers,
                            reft_kind=a.reft_kind, invocation=invocation_ids(a.invocation, tokenizer)),
        optimizer=OptimizerConfig(lr=a.lr, warmup_steps=a.warmup_steps, weight_decay=a.weight_decay,
                                  grad_clip=a.grad_clip),
        mesh=MeshConfig.parse(a.mesh),
        checkpoint=CheckpointConfig(every=a.checkpoint_every, max_to_keep=a.keep_checkpoints),
        steps=a.steps, seed=a.seed, log_every=a.log_every, eval_every=a.eval_every, logit_chunk=a.logit_chunk,
        pad_multiple=a.pad_multiple, remat=remat_from_word(a.remat))


def model_options(a) -> ModelOptions:
    return ModelOptions(path=a.model, dtype=a.dtype, backend=a.backend, quantize=a.quantize, attention=a.attention)


def start(a) -> dist.DistributedConfig:
    """jax.distributed start-up from flags / environment, then logging (process 0 at INFO)."""
    from preft_jax.cache.startup import quiet_backend_probe
    from preft_jax.progress import set_quiet
    set_quiet(getattr(a, "quiet", False))
    quiet_backend_probe()          # no "Unable to initialize backend 'tpu'" line on machines without one
    dcfg = dist.config_from_args(a)
    dist.initialize(dcfg)
    import jax
    level = logging.INFO if jax.process_index() == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s [p{jax.process_index()}] %(name)s %(message)s",
                        force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)       # Orbax's per-save chatter
    logging.getLogger("datasets").setLevel(logging.WARNING)   # "JAX version ... available." at its import
    return dcfg


def load_base(opts: ModelOptions, mesh=None):
    """(ModelConfig, ModelRunner of the frozen base in opts.dtype (quantized by opts.quantize) with
    opts.backend, tokenizer). The weights are placed on `mesh` (one device without) as they load: an
    HF folder streams tensor by tensor and each process reads only its devices' slices
    (preft_jax.loading.load_model_sharded)."""
    from preft_jax.generation import ModelRunner
    from preft_jax.loading import load_model_sharded
    from preft_jax.model import Llama
    from preft_jax import chunk_attention
    try:                            # before any weight is read: a bad --attention is one line
        attention = chunk_attention.resolve(opts.attention, opts.jnp_dtype)
    except ValueError as e:
        raise ValueError(f"--attention {opts.attention}: {e}" if opts.attention else str(e)) from None
    cfg, params, tok = load_model_sharded(opts.path, mesh, opts.dtype)
    if opts.quantize:
        from preft_jax.loading.quantized import quantize_model_params
        params = quantize_model_params(cfg, params, opts.quantize, opts.jnp_dtype, path=opts.path)
    return cfg, ModelRunner(Llama.from_params(cfg, params, dtype=opts.jnp_dtype, adapter_backend=opts.backend,
                                              chunk_attention=attention)), tok


def callbacks(a) -> tuple:
    """Test hooks: --fault-after-step K kills this process (SIGKILL) once batch K is checkpointed;
    --sigterm-after-step K sends it a SIGTERM (a preemption notice) after batch K."""
    out = []
    if a.fault_after_step is not None:
        def crash(row, state):
            if row["step"] == a.fault_after_step:
                log.warning("fault injection: SIGKILL after step %d", row["step"])
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
        out.append(crash)
    if getattr(a, "sigterm_after_step", None) is not None:
        def notice(row, state):
            if row["step"] == a.sigterm_after_step:
                os.kill(os.getpid(), signal.SIGTERM)
        out.append(notice)
    return tuple(out)


def _say_last(line: str) -> None:
    """`line` on stderr, and nothing after it: stderr (the descriptor, which native threads write to,
    and sys.stderr) goes to /dev/null first, the line to a copy of the descriptor."""
    sys.stderr.flush()
    kept = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = open(os.devnull, "w")
    os.write(kept, (line + "\n").encode("utf-8", "replace"))
    os.close(kept)


def main_guard(fn, argv=None, exiting: bool = False) -> int:
    """Runs fn(argv); user-fixable errors -> `error: ...` on stderr, exit status 2. `exiting`: the
    process ends after this (a CLI's main): after a checkpoint that could not be read, what Orbax's
    threads print while the interpreter tears down (the failed restore's sibling reads, each with
    TensorStore's whole spec: hundreds of lines) is dropped, so the error stays the one line."""
    from train.checkpoint import CheckpointReadError
    from train.data import DatasetFormatError, DatasetMismatchError
    from train.preemption import EXIT_STATUS, Preempted
    from train.trainer import ResumeError, RunError
    graceful = True
    try:
        fn(argv)
    except Preempted as e:                      # every process stopped at the same step, saved: a clean end
        if dist.is_primary():
            print(f"stopped: {e}", file=sys.stderr, flush=True)
        return EXIT_STATUS
    except (dist.DistributedError, ResumeError, ValueError, OSError) as e:
        if os.environ.get("PREFT_TRACEBACK"):
            raise
        specific = isinstance(e, (dist.DistributedError, ResumeError, FileNotFoundError, DatasetMismatchError,
                                  DatasetFormatError, CheckpointReadError, RunFolderError, RunError))
        line = f"error: {e}" + ("" if specific else f" ({type(e).__name__}; PREFT_TRACEBACK=1 shows where)")
        if exiting and isinstance(e, CheckpointReadError):
            _say_last(line)
        else:
            print(line, file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        # in a multi-process run, an unexpected error is told before anything waits on the other
        # processes: jax.distributed's shutdown barrier would wait for a peer that is gone (or stuck
        # in a collective this process left) until its heartbeat times out, then abort the process
        if not dist.multi_process():
            raise
        graceful = False
        lost = dist.lost_peer(e)                 # another process of the run is gone: one line
        if lost is not None and not os.environ.get("PREFT_TRACEBACK"):
            print(f"error: {lost}", file=sys.stderr, flush=True)
        else:
            traceback.print_exc()
        if exiting:
            dist.abandon(1)
        return 1
    finally:
        if graceful:
            dist.shutdown()
    return 0
