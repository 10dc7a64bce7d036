"""Drive vLLM peer workers from any Python (no vLLM, no torch import): one worker process per variant.

    from benchmarks.vllm_peer.client import VllmPeer

    with VllmPeer("/work/bench/smollm2_hf", adapters_dir="/work/bench/adapters/r8",
                  variants=("base", "lora")) as peer:          # starts + warms up every worker
        peer.run("base", seed=0)                                # 32 x 16 prompt tokens -> 32 tokens
        peer.run("lora", n_adapters=8, seed=0)                  # each request one of 8 adapters
        peer.run("lora", n_adapters=32, prompts=[...], adapter_ids=[...])   # explicit requests

`run` returns the worker's reply dict: wall_s (the `LLM.generate` call only), generated_tokens,
tok_per_s, digest (hash of the generated ids), ... and raises VllmPeerError when the worker reports
an error or dies. Variants: "base" (vLLM default, compiled), "base_eager" (enforce_eager=True), "lora"
(enable_lora; vLLM runs LoRA eagerly on CPU). Workers are started one after another (startup and
warm-up seconds are in `peer.ready[variant]`); each waits, idle, on its stdin between runs, so
callers can interleave its runs with other engines' runs (round-robin timing).

Environment given to every worker (callers' values win, except the two vLLM switches below):
VLLM_CPU_OMP_THREADS_BIND=0-{ncpu-1} (else vLLM uses one core), VLLM_ENABLE_V1_MULTIPROCESSING=0
(engine in the worker process: no engine-core / executor subprocesses), offline and no telemetry,
and LD_PRELOAD of tcmalloc + Intel OpenMP when present (vLLM's documented CPU setup; preload=False
turns it off). The worker's Python is `python=`, else $VLLM_PEER_PYTHON, else /work/venvs/vllm/bin/python.
"""
from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "worker.py"
DEFAULT_PYTHON = "/work/venvs/vllm/bin/python"
VARIANTS = ("base", "base_eager", "lora")
TCMALLOC_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                       "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")

__all__ = ["VllmPeer", "VllmPeerError", "VARIANTS", "worker_env"]


class VllmPeerError(RuntimeError):
    """A worker failed to start, reported an error, timed out or died."""


def _venv_root(python: str) -> pathlib.Path:
    return pathlib.Path(python).parent.parent      # <venv>/bin/python -> <venv>


def worker_env(python: str, preload: bool = True, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncpu - 1}")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
                 "PYTHONUNBUFFERED": "1"}.items():
        env.setdefault(k, v)
    for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JAX_PLATFORMS", "XLA_FLAGS"):
        env.pop(k, None)   # the caller's env (preft_jax's) must not leak into the vLLM venv
    if preload and "LD_PRELOAD" not in env:
        libs = [p for p in TCMALLOC_CANDIDATES if os.path.exists(p)]
        iomp = _venv_root(python) / "lib" / "libiomp5.so"
        if iomp.exists():
            libs.append(str(iomp))
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    return env


class _Worker:
    def __init__(self, variant: str, argv: list[str], env: dict, log_path: pathlib.Path):
        self.variant, self.log_path = variant, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, start_new_session=True)
        self._buf = b""

    def _log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def read_line(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise VllmPeerError(f"vLLM worker {self.variant!r} gave no reply within {timeout:.0f} s "
                                    f"(log {self.log_path}):\n{self._log_tail()}")
            ready, _, _ = select.select([fd], [], [], min(left, 5.0))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.proc.wait(timeout=10)
                    raise VllmPeerError(f"vLLM worker {self.variant!r} exited (code {self.proc.returncode}); "
                                        f"log {self.log_path}:\n{self._log_tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise VllmPeerError(f"vLLM worker {self.variant!r} is gone; log {self.log_path}:\n"
                                f"{self._log_tail()}") from None

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()          # EOF: the worker exits by itself
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self.proc.pid, sig)   # its own session: the worker and any children
                    except ProcessLookupError:
                        break
                    try:
                        self.proc.wait(timeout=10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        for f in (self.proc.stdout, self.proc.stdin, self._log):
            try:
                f.close()
            except OSError:
                pass


class VllmPeer:
    """One vLLM worker per variant; `run(variant, **workload)`; `close()` (also at exit / `with`)."""

    def __init__(self, model_dir: str | os.PathLike, adapters_dir: str | os.PathLike | None = None,
                 variants=("base", "lora"), *, python: str | None = None, max_loras: int = 32,
                 max_cpu_loras: int | None = None, max_lora_rank: int = 16, max_num_seqs: int = 0,
                 max_model_len: int = 256, kv_cache_mib: int = 512, preload: bool = True,
                 startup_timeout: float = 1800.0, run_timeout: float = 1800.0,
                 log_dir: str | os.PathLike | None = None, env: dict | None = None,
                 worker_script: str | os.PathLike = WORKER):
        variants = tuple(variants)
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants or len(set(variants)) != len(variants):
            raise ValueError(f"variants must be distinct names from {VARIANTS}, got {variants}")
        self.python = python or os.environ.get("VLLM_PEER_PYTHON") or DEFAULT_PYTHON
        if not os.path.isfile(self.python):
            raise FileNotFoundError(f"vLLM venv python not found: {self.python} "
                                    f"(create it with: bash {HERE / 'setup.sh'}; or pass python=/ set VLLM_PEER_PYTHON)")
        model_dir = pathlib.Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"HF model folder without config.json: {model_dir} "
                                    f"(make it with: python {HERE / 'prepare.py'} --out DIR)")
        if "lora" in variants and (adapters_dir is None or not pathlib.Path(adapters_dir).is_dir()):
            raise FileNotFoundError(f"variant 'lora' needs adapters_dir holding lora_0, lora_1, ...; "
                                    f"got {adapters_dir!r}")
        self.run_timeout = run_timeout
        self._own_log_dir = log_dir is None     # removed at close() when every worker exited cleanly
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="vllm_peer_logs_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = worker_env(self.python, preload=preload, base=env)
        self.workers: dict[str, _Worker] = {}
        self.ready: dict[str, dict] = {}
        atexit.register(self.close)
        common = ["--model", str(model_dir), "--max-model-len", str(max_model_len),
                  "--kv-cache-mib", str(kv_cache_mib), "--max-num-seqs", str(max_num_seqs)]
        try:
            for v in variants:
                argv = [self.python, str(worker_script), "--engine", v, *common]
                if v == "lora":
                    argv += ["--adapters", str(adapters_dir), "--max-loras", str(max_loras),
                             "--max-cpu-loras", str(max_cpu_loras or max_loras),
                             "--max-lora-rank", str(max_lora_rank)]
                t0 = time.perf_counter()
                w = _Worker(v, argv, self.env, self.log_dir / f"{v}.log")
                self.workers[v] = w
                msg = w.read_line(startup_timeout)
                if not msg.get("ready"):
                    raise VllmPeerError(f"vLLM worker {v!r} failed to start: {msg.get('error')}\n"
                                        f"log {w.log_path}:\n{w._log_tail()}")
                msg["startup"]["total_s"] = round(time.perf_counter() - t0, 2)
                self.ready[v] = msg
        except BaseException:
            self.close()
            raise

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(self.workers)

    def run(self, variant: str, **workload) -> dict:
        """Serve one batch on `variant`'s engine; keys as in workload.Workload (+ prompts, adapter_ids)."""
        if variant not in self.workers:
            raise ValueError(f"unknown variant {variant!r}; started: {self.variants}")
        w = self.workers[variant]
        t0 = time.perf_counter()
        w.send({"op": "run", **workload})
        reply = w.read_line(self.run_timeout)
        reply["roundtrip_s"] = time.perf_counter() - t0
        if not reply.get("ok"):
            raise VllmPeerError(f"vLLM worker {variant!r}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Stop every worker (EOF on stdin, then SIGTERM/SIGKILL of its process group). Idempotent."""
        for w in self.workers.values():
            w.close()
        atexit.unregister(self.close)
        if self._own_log_dir and self.workers and all(w.proc.returncode == 0 for w in self.workers.values()):
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    sys.exit("import VllmPeer from this module; see benchmarks/vllm_peer/bench.py for a runnable benchmark")
