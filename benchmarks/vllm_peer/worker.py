"""vLLM peer worker: one vLLM `LLM` engine in this process, driven by JSON lines on stdin.

Runs under the vLLM virtualenv's Python (see setup.sh), never under preft_jax's. Normally started by
`client.py`; by hand:

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
      /work/venvs/vllm/bin/python benchmarks/vllm_peer/worker.py --engine lora \
      --model /work/bench/smollm2_hf --adapters /work/bench/adapters/r8 --max-loras 32

Engines (one per process: vLLM's CPU worker binds OpenMP threads and patches torch process-wide, so
two engines in one process are not supported):

    base        vLLM's default plain engine (torch.compile / inductor graphs)
    base_eager  the plain engine with enforce_eager=True (vLLM's CPU LoRA path always runs eager)
    lora        enable_lora=True, max_loras / max_cpu_loras / max_lora_rank; adapters are the PEFT
                folders ADAPTERS/lora_{i}; a request may also run with no adapter (n_adapters=0)

Protocol (stdout carries only protocol lines; every library print is sent to stderr):

    -> {"ready": true, "engine": ..., "vllm_version": ..., "startup": {...seconds...}, "warmup": {...}}
    <- {"op": "run", "n_requests": 32, "prompt_len": 16, "max_tokens": 32, "n_adapters": 8, "seed": 0}
       (workload fields as in workload.Workload; optional "variant" must name this engine; optional
        "prompts": [[ids]...] and "adapter_ids": [i | null, ...] replace the generated ones)
    -> {"ok": true, "wall_s": ..., "generated_tokens": ..., "tok_per_s": ..., "digest": ..., ...}
    <- {"op": "info"}  -> {"ok": true, "engine": ..., "config": {...}}
    <- {"op": "quit"} or end of stdin: the process exits (it also exits when its parent dies).

A bad command gets {"ok": false, "error": "..."} and the worker keeps serving.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from workload import Workload, digest  # noqa: E402

ENGINES = ("base", "base_eager", "lora")


def _protocol_stream():
    """Keep the real stdout for protocol lines; route fd 1 (library prints, logs) to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    return os.fdopen(fd, "w", buffering=1)


def _die_with_parent():
    """Linux: get SIGTERM when the parent process dies (no orphaned worker burning the CPU)."""
    try:
        import ctypes
        import signal
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(0)
    except Exception:
        pass


def _private_tempdir() -> str:
    """vLLM leaves its file-store rendezvous (vllm_dist_*) in the temp dir: give it a private one that is
    removed at exit, keeping torch inductor's cache where it would have been (so compiles are reused)."""
    import getpass
    import tempfile
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    tempfile.tempdir = tempfile.mkdtemp(prefix="vllm_peer_")
    return tempfile.tempdir


def _adapter_folders(root: pathlib.Path, limit: int) -> list[pathlib.Path]:
    found = []
    for i in range(limit):
        f = root / f"lora_{i}"
        if not (f / "adapter_config.json").is_file():
            break
        found.append(f)
    if not found:
        raise SystemExit(f"--adapters {root}: no PEFT adapter folders lora_0, lora_1, ... found "
                         f"(make them with benchmarks/vllm_peer/prepare.py)")
    return found


class Server:
    def __init__(self, args):
        self.args = args
        self.engine = args.engine
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest
        self.vllm_version = vllm.__version__
        self.SamplingParams, self.LoRARequest = SamplingParams, LoRARequest
        t_import = time.perf_counter() - t0

        kw = dict(model=args.model, dtype="float32", seed=0, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_mib << 20, enable_prefix_caching=False,
                  distributed_executor_backend="uni", disable_log_stats=True)
        if args.max_num_seqs:
            kw["max_num_seqs"] = args.max_num_seqs
        if args.engine == "base_eager":
            kw["enforce_eager"] = True
        self.adapters: list[pathlib.Path] = []
        if args.engine == "lora":
            if not args.adapters:
                raise SystemExit("--engine lora needs --adapters DIR (holding lora_0, lora_1, ...)")
            self.adapters = _adapter_folders(pathlib.Path(args.adapters), args.max_cpu_loras or args.max_loras)
            kw.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras or args.max_loras)
        self.engine_kwargs = {k: v for k, v in kw.items() if k != "model"}
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        t_engine = time.perf_counter() - t0
        self.vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        self._lora_requests = [LoRARequest(f"lora_{i}", i + 1, str(f)) for i, f in enumerate(self.adapters)]

        # untimed warm-up: the default workload, with every adapter (all get loaded and cached)
        t0 = time.perf_counter()
        n_warm = len(self.adapters)
        warm = self.run({"n_requests": max(32, n_warm), "n_adapters": n_warm}) if n_warm else self.run({})
        if n_warm:   # also the no-adapter path of the LoRA engine
            self.run({"n_requests": 8, "max_tokens": 4})
        t_warm = time.perf_counter() - t0
        self.ready = {"ready": True, "engine": self.engine, "vllm_version": self.vllm_version,
                      "pid": os.getpid(), "n_adapters_available": len(self.adapters),
                      "config": self.engine_kwargs,
                      "startup": {"import_s": round(t_import, 2), "engine_s": round(t_engine, 2),
                                  "warmup_s": round(t_warm, 2)},
                      "warmup": {k: warm[k] for k in ("wall_s", "tok_per_s")}}

    def run(self, cmd: dict) -> dict:
        cmd = dict(cmd)
        cmd.pop("op", None)
        variant = cmd.pop("variant", None)
        if variant is not None and variant != self.engine:
            raise ValueError(f"this worker serves engine {self.engine!r}, not variant {variant!r}")
        prompts = cmd.pop("prompts", None)
        picks = cmd.pop("adapter_ids", None)
        cmd.setdefault("vocab_size", getattr(self, "vocab", None) or Workload.vocab_size)
        w = Workload.from_dict(cmd)
        if w.n_adapters and self.engine != "lora":
            raise ValueError(f"n_adapters={w.n_adapters} needs the 'lora' engine; this is {self.engine!r}")
        if w.n_adapters > len(self.adapters):
            raise ValueError(f"n_adapters={w.n_adapters} but this worker has {len(self.adapters)} adapters "
                             f"(--adapters folder / --max-cpu-loras)")
        prompts = w.prompts() if prompts is None else [list(map(int, p)) for p in prompts]
        picks = w.adapter_ids() if picks is None else picks
        if len(picks) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(picks)} adapter_ids")
        bad = [p for p in picks if p is not None and not (0 <= int(p) < len(self.adapters))]
        if bad:
            raise ValueError(f"adapter_ids {bad[:5]} out of range 0..{len(self.adapters) - 1}")
        lora = None
        if any(p is not None for p in picks):
            lora = [None if p is None else self._lora_requests[int(p)] for p in picks]
        sp = self.SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(inputs, sp, lora_request=lora, use_tqdm=False)
        wall = time.perf_counter() - t0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        n_gen = sum(len(t) for t in toks)
        return {"ok": True, "engine": self.engine, "wall_s": wall, "generated_tokens": n_gen,
                "expected_tokens": len(prompts) * w.max_tokens, "tok_per_s": n_gen / wall,
                "n_requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
                "n_adapters": w.n_adapters, "distinct_adapters": len({p for p in picks if p is not None}),
                "seed": w.seed, "digest": digest(toks)}

    def handle(self, line: str) -> dict | None:
        try:
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError("a command must be a JSON object")
            op = cmd.get("op", "run")
            if op == "quit":
                return None
            if op == "info":
                return {"ok": True, **{k: v for k, v in self.ready.items() if k != "ready"}}
            if op == "run":
                return self.run(cmd)
            raise ValueError(f"unknown op {op!r}; supported: run, info, quit")
        except Exception as e:  # report and keep serving
            return {"ok": False, "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(limit=3)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="vLLM peer worker (JSON lines on stdin/stdout)")
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--model", required=True, help="HF model folder (prepare.py's smollm2_hf)")
    p.add_argument("--adapters", help="folder of PEFT LoRA folders lora_0, lora_1, ... (lora engine)")
    p.add_argument("--max-loras", type=int, default=32, help="adapters in one batch (lora engine)")
    p.add_argument("--max-cpu-loras", type=int, default=0, help="adapter cache size (default = --max-loras)")
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0 = vLLM's default (256 on CPU)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    args = p.parse_args(argv)
    for name in ("max_loras", "max_lora_rank", "max_model_len", "kv_cache_mib"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = _protocol_stream()
    _die_with_parent()
    tmp = _private_tempdir()

    def leave(code: int):
        import shutil
        out.flush()
        sys.stderr.flush()
        shutil.rmtree(tmp, ignore_errors=True)
        os._exit(code)   # skip vLLM's atexit teardown (nothing to flush; the engine lives in this process)

    import signal
    signal.signal(signal.SIGTERM, lambda *_: leave(143))
    try:
        server = Server(args)
    except BaseException as e:
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        traceback.print_exc()
        leave(1)
    out.write(json.dumps(server.ready) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = server.handle(line)
        if reply is None:
            break
        out.write(json.dumps(reply) + "\n")
        out.flush()
    leave(0)


if __name__ == "__main__":
    sys.exit(main())
