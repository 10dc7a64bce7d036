"""Shared pieces of the engine benchmarks (benchmarks/*.py): model loading, workloads, serving one
batch through an `Engine` with per-request TTFT, round-robin timing and spread formatting.

Every benchmark times all its variants round-robin in one process (repeat r runs variant 1, 2, ...
before repeat r + 1 starts), so load from other processes on the shared machine hits them alike, and
reports the median with the min-max over the repeats.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import statistics
import sys
import time
from typing import Callable

import numpy as np

from preft_jax.sampling import SamplingParams

NO_STOP = (-1,)                       # no stop token: every request generates exactly max_tokens


def load_runner(model: str | None = None, dtype: str = "float32", backend: str = "auto", quantize: str | None = None):
    """ModelRunner for 'tiny' (random tiny model), a GGUF/HF path, or None (embedded SmolLM2-135M);
    quantize: "int8" | "int4" base weights (preft_jax.quantize; not for 'tiny')."""
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    if model == "tiny":
        from flax import nnx
        from preft_jax.config import tiny_config
        return ModelRunner(Llama(tiny_config(max_seq_len=2048), rngs=nnx.Rngs(0), dtype=dtype,
                                 adapter_backend=backend))
    from preft_jax.loading import load_model
    cfg, params, _ = load_model(model)
    if quantize:
        from preft_jax.loading.quantized import quantize_model_params
        params = quantize_model_params(cfg, params, quantize, dtype, path=model)
    return ModelRunner(Llama.from_params(cfg, params, dtype=dtype, adapter_backend=backend))


def random_prompts(n: int, length: int | tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """n prompts of `length` random ids (or lengths uniform in [lo, hi]); the vLLM peer's rule for a fixed length."""
    rng = np.random.default_rng(seed)
    if isinstance(length, int):
        return [rng.integers(0, vocab, length).tolist() for _ in range(n)]
    return [rng.integers(0, vocab, int(rng.integers(length[0], length[1] + 1))).tolist() for _ in range(n)]


@dataclasses.dataclass
class Served:
    """One batch served: generated tokens, wall seconds, per-request TTFT, peak concurrency, outputs."""
    tokens: int
    wall: float
    ttft: list[float]
    max_running: int
    mean_running: float                  # sequences running, averaged over the engine's steps
    outputs: list[list[int]]
    steps: int
    started: float = 0.0                 # time.perf_counter() when serving began (the wall's start)
    submit_s: float = 0.0                # seconds until every request was submitted (part of the wall)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.wall


def serve(engine, prompts, adapters, max_tokens, *, check_length: bool = True) -> Served:
    """Submits every request at once (max_tokens: an int or one per request), steps the engine until
    all finish; TTFT = first token time - submit time of each request."""
    from serve.request import GenerationRequest
    mts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    t0 = time.perf_counter()
    steps0 = engine.steps
    params = {m: SamplingParams(max_new_tokens=m, stop_token_ids=NO_STOP) for m in set(mts)}   # a client reuses them
    handles = [reqs[0] for reqs in engine.submit_many(          # one batch, as a client with many prompts
        [GenerationRequest(p, a, params[m]) for p, a, m in zip(prompts, adapters, mts)])]
    submitted = time.perf_counter()
    peak, running = 0, []
    while any(not h.finished for h in handles):
        engine.step()
        running.append(engine.active)
        peak = max(peak, engine.active)
        if not engine.active and any(not h.finished for h in handles):
            time.sleep(0.002)            # only waiting on adapter loads (as the engine's own loop does;
                                         # not after the last step: that charged every run 2 ms)
    wall = time.perf_counter() - t0
    for h in handles:
        if h.error is not None:
            raise h.error
    outs = [list(h.result.tokens) for h in handles]
    if check_length:
        for o, m in zip(outs, mts):
            assert len(o) == m, f"a request generated {len(o)} tokens, expected {m}"
    ttft = [h.first_token_at - h.submitted_at for h in handles]
    busy = [r for r in running if r]
    return Served(sum(len(o) for o in outs), wall, ttft, peak, float(np.mean(busy)) if busy else 0.0, outs,
                  engine.steps - steps0, t0, submitted - t0)


def stats(values) -> tuple[float, float, float]:
    v = list(values)
    return statistics.median(v), min(v), max(v)


def spread(values, fmt: str = "{:.1f}") -> str:
    """'median (min-max)'."""
    m, lo, hi = stats(values)
    return f"{fmt.format(m)} ({fmt.format(lo)}-{fmt.format(hi)})"


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, float), q))


def round_robin(cases: dict[str, Callable[[int], dict]], repeats: int, log=print) -> dict[str, list[dict]]:
    """Runs cases[name](repeat) for every name, repeat after repeat; each returns a dict of numbers
    (with 'tok_per_s'). Returns name -> list of those dicts."""
    runs: dict[str, list[dict]] = {k: [] for k in cases}
    for rep in range(repeats):
        for name, fn in cases.items():
            la = os.getloadavg()[0]
            r = fn(rep)
            r["load1"] = la
            runs[name].append(r)
            extra = "  ".join(f"{k} {v:.3g}" for k, v in r.items() if k not in ("tok_per_s", "load1")
                              and isinstance(v, (int, float)))
            log(f"rep {rep} {name:28s} {r.get('tok_per_s', float('nan')):8.1f} tok/s  {extra}  load {la:.2f}")
    return runs


def cpu_model() -> str:
    """'<model name>, AVX-512' or '..., no AVX-512' from /proc/cpuinfo ('' where unreadable): CPU figures
    differ by machine, and the native decode step's GEMM tile by instruction set."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return f"{name}, {'AVX-512' if 'avx512f' in flags else 'no AVX-512'}"


def header(runner, extra: str = "") -> str:
    import jax
    cfg = runner.cfg
    return (f"# {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} CPUs ({cpu_model()}), "
            f"backend={runner.adapter_backend}, dtype={np.dtype(runner.dtype).name}, "
            f"model layers={cfg.n_layers} d={cfg.d_model} vocab={cfg.vocab_size}; "
            f"load average {os.getloadavg()[0]:.2f}; {extra}")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse then names the flag and exits 2)."""
    import argparse
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def run(main: Callable[[], int | None]) -> int:
    """A benchmark's entry point: main()'s status, or for a refused value (a ValueError: a flag out of
    range, a decode path this machine cannot build) one `error:` line and status 2, never a traceback
    (PREFT_TRACEBACK=1 shows where)."""
    try:
        return main() or 0
    except ValueError as e:
        if os.environ.get("PREFT_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


def log(msg: str) -> None:
    print(msg, flush=True)


def write_json(path: str | None, data) -> None:
    if path:
        import json
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=float)
        print(f"# wrote {path}", file=sys.stderr)
