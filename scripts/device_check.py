"""One command for an accelerator (GPU or TPU): how close serving and training come to the hardware,
whether the kernels are right there, what PreFT buys when serving at the paper's shapes. Writes a
markdown report into docs/device_check.md (between its `device_check:latest` markers; the earlier
runs below them are kept).

    python scripts/device_check.py                     # the prepared run: roofline,serving,training, within its 330 s budget
    python scripts/device_check.py --dry-run           # the same sections at tiny shapes (CPU, interpret mode)
    python scripts/device_check.py --sections kernels,timing    # the kernel checks of the first lease

Sections (each has a share of the time budget; every item checks its deadline first and is skipped,
and listed as skipped, once it is spent; the report is rewritten after every section; compiled
programs go to the persistent compilation cache, so a second try in the same lease compiles
nothing):
  roofline  benchmarks.roofline on random-weight bf16 models: decode step time of the Llama-3.1-8B
            shape at B=64, context 128 and 2048, one step per call and 8 steps per call
            (paged_decode_steps: no host sync), the same for the Qwen2.5-0.5B shape, then the 8B
            shape at B=1, 16, 256, prefill chunks of 2048 and 512 tokens (base and PreFT-LoRA with 64
            adapters), and the 8B decode step's components by ablation plus its op profile; each
            figure beside its bound ("NN% of HBM bound", H200: 4.8 TB/s, 989 TFLOP/s; H100 SXM:
            3.35 TB/s, 989). Every decode case is planned against the device's memory first
            (weights + its KV pool + logits + 2 GiB, `benchmarks.roofline.decode_need`): one that
            cannot fit is listed as skipped with what it needs (on an 80 GB H100: the 8B shape at
            B=256, context 2048, ~82 GiB), and the pool-size component takes the largest pool
            (4x, 3x, 2x) that fits.
  serving   experiments.serve_benchmark's engine benchmark (base vs all-token LoRA vs PreFT-LoRA vs PreFT-ReFT)
            on the Llama-3.1-8B shape, 64 and 512 adapters, adapter backend `auto`; base end to end
            against its roofline.
  training  benchmarks.train_mfu on the Llama-3.1-8B shape: one SFT step and one GRPO update (LoRA r16
            on q/k/v/o/gate/up/down, seq 1024, batch 8, bf16 activations, f32 adapter and AdamW),
            MFU against peak, GRPO backward / forward, and x W vs dY W^T at the MLP's shape.
  kernels   every Pallas kernel compiled with interpret=False (lora_sgmv, lora_bgmv, reft_apply;
            their backward passes run the grouped outer-product kernel) at the paper's layer
            shapes in float32 and bfloat16, forward and gradients checked against a float32 jnp
            reference (random group sizes, empty groups included); the same for the `xla`
            adapter backend (ragged_dot grouped / per-token gather); and slot isolation on every
            backend (NaN/Inf weights in one slot must not change any other row).
  timing    one layer's adapter op, round-robin timed, median per call (min-max over rounds):
            prefill LoRA (SGMV vs xla ragged_dot), decode LoRA (the BGMV kernel vs xla gather),
            prefill ReFT (Pallas vs xla ragged_dot), for 1, 64 and 512 adapters.

It runs on whatever jax the machine has (the H200 lease: its own jax 0.11.x and flax; a carried
flax does not import there) and says which versions it ran. It owns the device: unless the caller
sets XLA_PYTHON_CLIENT_MEM_FRACTION, XLA's allocator takes 90% of the device's memory (vLLM's
gpu_memory_utilization default), not jax's 75%; the header says which, and how many GiB that is.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import os
import pathlib
import platform as pyplatform
import statistics
import sys
import threading
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))             # this checkout's packages, not an installed copy

import jax                                 # noqa: E402
import jax.numpy as jnp                    # noqa: E402
import numpy as np                         # noqa: E402

from preft_jax import chunk_attention     # noqa: E402
from preft_jax.adapters import apply       # noqa: E402
from preft_jax.adapters.context import AdapterContext, pallas_lowers_on, resolve_backend   # noqa: E402
from preft_jax.lowering import error_line  # noqa: E402
from benchmarks import cost_model as cm   # noqa: E402
from preft_jax.config import ModelConfig   # noqa: E402

QWEN_05B = dataclasses.replace(cm.MODEL_CONFIGS["qwen2.5-0.5b"], max_seq_len=512)
LLAMA_8B = dataclasses.replace(cm.MODEL_CONFIGS["llama-3.1-8b"], max_seq_len=512)
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   tie_embeddings=True, max_seq_len=64)
MODELS = {"qwen2.5-0.5b": QWEN_05B, "llama-3.1-8b": LLAMA_8B}
SECTIONS = ("roofline", "serving", "training", "kernels", "timing")
DEFAULT_SECTIONS = "roofline,serving,training"
SHARE = {"roofline": 0.45, "serving": 0.25, "training": 0.30, "kernels": 0.5, "timing": 0.5}   # of the budget
# XLA's GPU allocator takes 75% of the device's memory by default; this run, which owns the device,
# takes 90% (vLLM's default gpu_memory_utilization) unless the caller chose (the header says which).
MEM_FRACTION_ENV, MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90"
MARK_BEGIN, MARK_END = "<!-- device_check:latest -->", "<!-- /device_check:latest -->"
TOL = {"float32": 1e-2, "bfloat16": 3e-2}   # max |err| / max |ref|; f32 matmuls may run as TF32 on GPUs


@dataclasses.dataclass(frozen=True)
class Plan:
    tiny: bool
    interpret: bool
    kernel_shapes: tuple             # (label, T prefill, T decode, d_in, d_out, rank, N)
    kernel_dtypes: tuple
    timing_dims: tuple               # (label, d) of the projection / residual stream
    timing_tokens: tuple             # (prefill tokens, decode tokens)
    adapter_counts: tuple            # timing section
    timing_calls: int
    timing_rounds: int
    models: tuple                    # serving: (label, ModelConfig)
    serving: dict                    # Workload fields
    serving_counts: tuple            # serving: numbers of adapters
    roofline: dict                   # see roofline_section
    training: dict                   # see training_section
    memory_limit: int | None = None  # bytes of device memory the cases are planned against (None: unchecked)


def make_plan(tiny: bool, models: list[str] | None, adapters: list[int] | None) -> Plan:
    if tiny:
        # every path of the full plan at tiny sizes: a second model (one on the device at a time),
        # more decode cases, the components and the op trace
        roof = dict(dtype="f32", head=("tiny", [(4, 16, 0), (4, 16, 2)]), second=("smollm2-135m", [(2, 16, 0)]),
                    more=[(1, 16, 0)], prefill=[32], prefill_rows=2, adapters=3, components=(4, 16), multi=2,
                    rounds=2, round_s=0.02, max_kv_gb=1.0)
        train = dict(model="tiny", dtype="f32", batch=2, seq=32, prompt_len=8, rank=4)
        return Plan(True, True, (("tiny", 24, 6, 32, 48, 4, 5),), ("float32",), (("tiny", 64),), (24, 4), (2,), 1, 1,
                    (("tiny", TINY),), dict(slots=2, requests=2, prefill_batch=2, prompt_len=4, max_tokens=2,
                                            repeats=1, lora_rank=4, reft_rank=2, reft_layers=(1,)),
                    tuple(adapters or (2,)), roof, train)
    counts = tuple(adapters or (1, 64, 512))
    roof = dict(dtype="bf16",
                head=("llama-3.1-8b", [(64, 128, 0), (64, 128, 8), (64, 2048, 0), (64, 2048, 8)]),
                second=("qwen2.5-0.5b", [(64, 128, 0), (64, 128, 8), (64, 2048, 0), (64, 2048, 8)]),
                more=[(1, 128, 0), (16, 128, 0), (256, 128, 0), (1, 2048, 0), (16, 2048, 0), (256, 2048, 0)],
                prefill=[2048, 512], prefill_rows=16, adapters=64, components=(64, 2048), multi=8, rounds=3,
                round_s=0.25, max_kv_gb=90.0)
    train = dict(model="llama-3.1-8b", dtype="bf16", batch=8, seq=1024, prompt_len=256, rank=16)
    return Plan(False, False,
                (("qwen q-proj", 1024, 64, 896, 896, 16, 64), ("llama q-proj", 1024, 64, 4096, 4096, 16, 64)),
                ("float32", "bfloat16"),
                (("qwen2.5-0.5b", 896), ("llama-3.1-8b", 4096)), (2048, 64), counts, 20, 5,
                tuple((m, MODELS[m]) for m in (models or ["llama-3.1-8b"])),
                dict(slots=64, requests=64, prefill_batch=16, prompt_len=64, max_tokens=64, repeats=2,
                     lora_rank=16, reft_rank=8), tuple(adapters or (64, 512)), roof, train)


class Report:
    """The report: header + sections, written after every section. An existing `out` with the
    device_check:latest markers keeps everything outside them (earlier runs); one without markers
    gets the block on top of its old text."""

    def __init__(self, out: pathlib.Path, budget_s: float):
        self.out, self.t0, self.budget_s = out, time.perf_counter(), budget_s
        self.deadline = self.section_deadline = self.t0 + budget_s
        self.sections: list[tuple[str, float, list[str]]] = []
        self.plan = self.hardware = None
        self.notes: list[str] = []
        self.header: list[str] = []
        self.summary: list[str] = []
        self.warnings: WarningLog | None = None
        self.old = out.read_text() if out.is_file() else None

    def over_budget(self) -> bool:
        return time.perf_counter() > min(self.deadline, self.section_deadline)

    def section(self, title, seconds, lines):
        self.sections.append((title, seconds, lines))
        print(f"\n## {title} ({seconds:.0f} s)\n" + "\n".join(lines), flush=True)
        self.write()

    def block(self) -> str:
        total = time.perf_counter() - self.t0
        text = ["## Latest run", "", *self.header, f"- total wall time: {total:.0f} s (budget {self.budget_s:.0f} s)",
                ""]
        if self.summary:
            text += ["Figures (one line each):", "", "```", *self.summary, "```", ""]
        if self.notes:
            text += [*self.notes, ""]
        for title, seconds, lines in self.sections:
            text += [f"### {title}", "", f"_section wall time {seconds:.0f} s_", "", *lines, ""]
        if self.warnings is not None:
            text += ["### Warnings this run raised", "", *(self.warnings.lines() or ["- none"]), ""]
        return "\n".join([MARK_BEGIN, *text, MARK_END])

    def write(self):
        block = self.block()
        if self.old is None:
            text = "\n".join(["# Device check", "", block, ""])
        elif MARK_BEGIN in self.old and MARK_END in self.old:
            head, rest = self.old.split(MARK_BEGIN, 1)
            text = head + block + rest.split(MARK_END, 1)[1]
        else:
            lines = self.old.splitlines()
            k = 1 if lines and lines[0].startswith("# ") else 0
            text = "\n".join(lines[:k] + ["", block, ""] + lines[k:]) + "\n"
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(text)


class WarningLog:
    """Every warning the run raises, once per category and message, with how many places raised it and
    the first: DeprecationWarnings included (Python hides those outside __main__), so a run on a newer
    jax (the device's 0.11.x) says in its report what of this code's path that jax deprecates - from
    jax 0.11.0 every Pallas Triton kernel's lowering warns that the Triton backend will be removed,
    and jax's Triton ops (the GPU paged attention among them) warn on import. Each message is still
    printed once. A context manager; `lines()` is the report's list."""

    def __init__(self):
        self.seen: dict[tuple[str, str], list] = {}      # (category, message) -> [places, first place]
        self._lock = threading.Lock()                   # the engines' threads warn too

    def __enter__(self) -> "WarningLog":
        self._scope = warnings.catch_warnings()         # restores the filters and showwarning on exit
        self._scope.__enter__()
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("default", category=category)    # once per place, not hidden
        self._print, warnings.showwarning = warnings.showwarning, self._show
        return self

    def __exit__(self, *exc) -> None:
        self._scope.__exit__(*exc)

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = (str(message).strip().splitlines() or [""])[0][:300]
        key = (category.__name__, text)
        with self._lock:
            first = key not in self.seen
            if first:
                self.seen[key] = [0, f"{_short_path(filename)}:{lineno}"]
            self.seen[key][0] += 1
        if first:
            self._print(message, category, filename, lineno, file, line)

    def lines(self) -> list[str]:
        return [f"- {cat} ({n} place{'s' if n > 1 else ''}, first {where}): {text}"
                for (cat, text), (n, where) in sorted(self.seen.items())]


def _short_path(filename: str) -> str:
    """A source path from its package down (`jax/_src/...`, `preft_jax/...`), not the machine's
    prefix; a name that is no path (`<string>`, `<frozen importlib._bootstrap>`) as it is."""
    if filename.startswith("<"):
        return filename
    parts = pathlib.PurePath(filename).parts
    for k in range(len(parts) - 1, -1, -1):
        if parts[k] in ("site-packages", "dist-packages"):
            return "/".join(parts[k + 1:])
    try:
        return str(pathlib.Path(filename).resolve().relative_to(ROOT))
    except ValueError:
        return filename


def _err(e: BaseException) -> str:
    """`lowering.error_line`, safe in a markdown table."""
    return error_line(e, 160).replace("|", "/")


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _slots(rng, T, N):
    """Random slot per token from about half of the N slots (the others stay empty), unsorted."""
    used = rng.choice(N, max(1, (N + 1) // 2), replace=False)
    return jnp.asarray(rng.choice(used, T), jnp.int32)


# ---- 1. kernels --------------------------------------------------------------------------------
def _lora_ref(x, A, B, idx):
    return apply.lora_gather(x.astype(jnp.float32), A.astype(jnp.float32), B.astype(jnp.float32), idx)


def _reft_ref(h, R, W, b, sub, idx):
    return apply.reft_gather(h.astype(jnp.float32), R.astype(jnp.float32), W.astype(jnp.float32),
                             b.astype(jnp.float32), sub, idx)


def _fwd_and_grads(fn, args, n_diff, seed):
    """fn(*args) and d/d(args[:n_diff]) of sum(fn * w) for a fixed random w, jitted."""
    def loss(*diff):
        y = fn(*diff, *args[n_diff:])
        w = jax.random.normal(jax.random.key(seed), y.shape, jnp.float32)
        return jnp.sum(y.astype(jnp.float32) * w), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n_diff)), has_aux=True))(*args[:n_diff])
    return y, g


_REF_CACHE: dict = {}


def _check(name, dtype, fn, ref, args, n_diff, seed):
    y, g = _fwd_and_grads(fn, args, n_diff, seed)
    key = (ref, dtype, tuple(id(a) for a in args))          # pallas and xla rows share one reference
    if key not in _REF_CACHE:
        _REF_CACHE[key] = _fwd_and_grads(ref, [a.astype(jnp.float32) if a.dtype == jnp.dtype(dtype) else a
                                               for a in args], n_diff, seed)
    yr, gr = _REF_CACHE[key]
    errs = [_rel(y, yr)] + [_rel(a, b) for a, b in zip(g, gr)]
    ok = max(errs) < TOL[dtype] and all(np.isfinite(errs))
    return ok, f"fwd {errs[0]:.1e}, grads max {max(errs[1:]):.1e}"


def kernel_checks(plan: Plan, rep: Report, platform: str):
    import pallas_kernels
    lines = ["| op | implementation | shape | dtype | result | max rel. error |", "|---|---|---|---|---|---|"]
    pallas_ok = pallas_lowers_on(platform)
    rng = np.random.default_rng(0)
    for label, Tp, Td, d_in, d_out, r, N in plan.kernel_shapes:
        for dtype in plan.kernel_dtypes:
            dt = jnp.dtype(dtype)
            x = jax.random.normal(jax.random.key(1), (Tp, d_in), dt)
            A = 0.1 * jax.random.normal(jax.random.key(2), (N, d_in, r), dt)
            B = 0.1 * jax.random.normal(jax.random.key(3), (N, r, d_out), dt)
            R = 0.1 * jax.random.normal(jax.random.key(4), (N, r, d_in), dt)
            W = 0.1 * jax.random.normal(jax.random.key(5), (N, r, d_in), dt)
            b = jax.random.normal(jax.random.key(6), (N, r), dt)
            sub = jnp.asarray(np.arange(N) % 2, jnp.float32)
            idx_p, idx_d = _slots(rng, Tp, N), _slots(rng, Td, N)
            xd = x[:Td]
            kern = functools.partial
            items = [
                ("LoRA prefill", "pallas lora_sgmv", f"T={Tp} {d_in}->{d_out} r={r} N={N}",
                 kern(pallas_kernels.lora_sgmv, interpret=plan.interpret), _lora_ref, [x, A, B, idx_p], 3, pallas_ok),
                ("LoRA decode", "pallas lora_bgmv", f"T={Td} {d_in}->{d_out} r={r} N={N}",
                 kern(pallas_kernels.lora_bgmv, interpret=plan.interpret), _lora_ref, [xd, A, B, idx_d], 3, pallas_ok),
                ("ReFT prefill", "pallas reft_apply", f"T={Tp} d={d_in} r={r} N={N}",
                 kern(pallas_kernels.reft_apply, interpret=plan.interpret), _reft_ref, [x, R, W, b, sub, idx_p], 4,
                 pallas_ok),
                ("LoRA prefill", "xla ragged_dot", f"T={Tp} {d_in}->{d_out} r={r} N={N}",
                 lambda x, A, B, i: AdapterContext.build(i, N, "xla", "grouped").lora(x, A, B), _lora_ref,
                 [x, A, B, idx_p], 3, True),
                ("LoRA decode", "xla gather", f"T={Td} {d_in}->{d_out} r={r} N={N}",
                 lambda x, A, B, i: AdapterContext.build(i, N, "xla", "gather").lora(x, A, B), _lora_ref,
                 [xd, A, B, idx_d], 3, not plan.tiny),      # tiny: this *is* the f32 reference's code
                ("ReFT prefill", "xla ragged_dot", f"T={Tp} d={d_in} r={r} N={N}",
                 lambda h, R, W, b, s, i: AdapterContext.build(i, N, "xla", "grouped").reft(h, R, W, b, s), _reft_ref,
                 [x, R, W, b, sub, idx_p], 4, True),
            ]
            for op, impl, shape, fn, ref, args, n_diff, available in items:
                if rep.over_budget():
                    lines.append(f"| {op} | {impl} | {shape} | {dtype} | skipped (budget) | |")
                    continue
                if not available:
                    why = "tiny run: same code as the reference" if impl == "xla gather" else f"does not lower on {platform}"
                    lines.append(f"| {op} | {impl} | {shape} | {dtype} | n/a: {why} | |")
                    continue
                try:
                    t0 = time.perf_counter()
                    ok, detail = _check(impl, dtype, fn, ref, args, n_diff, 7)
                    print(f"  {op} {impl} {shape} {dtype}: {'PASS' if ok else 'FAIL'} {detail} "
                          f"({time.perf_counter() - t0:.1f} s)", flush=True)
                    lines.append(f"| {op} | {impl} | {shape} | {dtype} | {'PASS' if ok else 'FAIL'} | {detail} |")
                except Exception as e:       # noqa: BLE001  (report, keep going)
                    lines.append(f"| {op} | {impl} | {shape} | {dtype} | FAIL | {_err(e)} |")
    lines += ["", f"Tolerance: max |err| / max |reference| < {TOL['float32']} (float32), {TOL['bfloat16']} "
              "(bfloat16); reference: float32 per-token gather in plain jnp."]
    lines += ["", *isolation_checks(plan, rep, platform, pallas_ok)]
    return lines


def isolation_checks(plan: Plan, rep: Report, platform: str, pallas_ok: bool):
    """NaN/Inf in slot 2 must leave every other row bitwise unchanged, per backend and layout."""
    T, d, r, N = 48, 64, 4, 6
    rng = np.random.default_rng(3)
    idx = jnp.asarray(rng.choice([0, 1, 2, 3, 5], T), jnp.int32)
    x = jax.random.normal(jax.random.key(8), (T, d), jnp.float32)
    A = 0.1 * jax.random.normal(jax.random.key(9), (N, d, r))
    B = 0.1 * jax.random.normal(jax.random.key(10), (N, r, d))
    R, W = A.swapaxes(1, 2), B
    b, sub = jax.random.normal(jax.random.key(11), (N, r)), jnp.ones((N,))
    other = np.asarray(idx) != 2
    lines = ["| isolation (NaN/Inf in slot 2) | gather | grouped |", "|---|---|---|"]
    for backend in ("jnp", "xla", "pallas"):
        cells = []
        for mode in ("gather", "grouped"):
            if backend == "pallas" and not pallas_ok:
                cells.append("n/a")
                continue
            if rep.over_budget():
                cells.append("skipped (budget)")
                continue
            try:
                ctx = AdapterContext.build(idx, N, backend, mode)
                both = jax.jit(lambda A, B, R, b: (ctx.lora(x, A, B), ctx.reft(x, R, W, b, sub)))
                clean = both(A, B, R, b)
                dirty = both(A.at[2].set(jnp.nan), B.at[2].set(jnp.inf), R.at[2].set(jnp.inf), b.at[2].set(jnp.nan))
                same_l, same_r = (np.array_equal(np.asarray(u)[other], np.asarray(v)[other])
                                  for u, v in zip(dirty, clean))
                cells.append("PASS" if same_l and same_r else f"FAIL (LoRA {same_l}, ReFT {same_r})")
            except Exception as e:           # noqa: BLE001
                cells.append(f"FAIL {_err(e)}")
        lines.append(f"| {backend} | {cells[0]} | {cells[1]} |")
        print(f"  isolation {backend}: {cells}", flush=True)
    return lines


# ---- 2. timing ---------------------------------------------------------------------------------
def _time_round_robin(fns: dict, calls: int, rounds: int, rep: Report):
    """{name: (jitted fn, args)} -> {name: [per-call seconds per round]}; compiled first."""
    for f, a in fns.values():
        jax.block_until_ready(f(*a))
        jax.block_until_ready(f(*a))
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (f, a) in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                out = f(*a)
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / calls)
        if rep.over_budget():
            break
    return times


def _fmt(ts):
    med = statistics.median(ts) * 1e6
    return f"{med:.0f} ({min(ts) * 1e6:.0f}-{max(ts) * 1e6:.0f})"


def _bgmv_kernel(x, A, B, idx, interpret):
    import pallas_kernels
    return pallas_kernels.lora_bgmv(x, A, B, idx, interpret=interpret)


def timing(plan: Plan, rep: Report, platform: str):
    pallas_ok = pallas_lowers_on(platform)
    dt = jnp.bfloat16
    Tp, Td = plan.timing_tokens
    r = 16 if not plan.tiny else 4
    lines = [f"Per call, microseconds: median (min-max) over {plan.timing_rounds} round-robin rounds of "
             f"{plan.timing_calls} calls; bfloat16; LoRA rank {r} on a d->d projection; ReFT rank 8; prefill "
             f"{Tp} tokens, decode {Td} tokens, each token on a random one of N adapters. Pallas builds its token "
             "layout inside each call; the xla context's layout (sort) is built once per step and excluded.", "",
             "| op | model dims | N | pallas us | xla us | xla / pallas |", "|---|---|---:|---:|---:|---:|"]
    rng = np.random.default_rng(1)
    for label, d in plan.timing_dims:
        for N in plan.adapter_counts:
            if rep.over_budget():
                lines.append(f"| all | {label} | {N} | skipped (budget) | | |")
                continue
            s = N + 1
            x = jax.random.normal(jax.random.key(0), (Tp, d), dt)
            A = 0.02 * jax.random.normal(jax.random.key(1), (s, d, r), dt)
            B = 0.02 * jax.random.normal(jax.random.key(2), (s, r, d), dt)
            rr = 8 if not plan.tiny else 2
            R = 0.02 * jax.random.normal(jax.random.key(3), (s, rr, d), dt)
            b, sub = jnp.zeros((s, rr), dt), jnp.ones((s,), dt)
            idx_p = jnp.asarray(rng.integers(1, s, Tp), jnp.int32)
            idx_d = jnp.asarray(rng.integers(1, s, Td), jnp.int32)
            xd = x[:Td]
            lora = jax.jit(lambda c, x, A, B: c.lora(x, A, B))
            reft = jax.jit(lambda c, h, R, b, sub: c.reft(h, R, R, b, sub))
            # the pallas backend's decode LoRA is XLA's gather on GPUs (adapters/context.py): the BGMV
            # kernel is timed by calling it directly
            bgmv = jax.jit(functools.partial(_bgmv_kernel, interpret=plan.interpret))
            cases = {
                "LoRA prefill (SGMV)": ("grouped", idx_p, lora, (x, A, B), None),
                "LoRA decode (BGMV)": ("gather", idx_d, lora, (xd, A, B), (bgmv, (xd, A, B, idx_d))),
                "ReFT prefill": ("grouped", idx_p, reft, (x, R, b, sub), None),
            }
            for op, (mode, idx, fn, args, kernel) in cases.items():
                fns = {}
                try:
                    fns["xla"] = (fn, (AdapterContext.build(idx, s, "xla", mode), *args))
                    if pallas_ok:
                        fns["pallas"] = kernel or (fn, (AdapterContext.build(idx, s, "pallas", mode), *args))
                    t0 = time.perf_counter()
                    t = _time_round_robin(fns, plan.timing_calls, plan.timing_rounds, rep)
                    print(f"  timed {op} {label} N={N} ({time.perf_counter() - t0:.1f} s)", flush=True)
                    p = _fmt(t["pallas"]) if "pallas" in t else "n/a"
                    ratio = (f"{statistics.median(t['xla']) / statistics.median(t['pallas']):.2f}x"
                             if "pallas" in t else "")
                    lines.append(f"| {op} | {label} | {N} | {p} | {_fmt(t['xla'])} | {ratio} |")
                except Exception as e:       # noqa: BLE001
                    lines.append(f"| {op} | {label} | {N} | FAIL | {_err(e)} | |")
    if not pallas_ok:
        lines += ["", f"pallas: n/a — the Pallas kernels do not lower on {platform} in this build "
                  "(scalar prefetch is TPU-only), so `auto` uses the xla backend here."]
    return lines


# ---- 3. serving --------------------------------------------------------------------------------
def _engine_line(label: str, work, base, rep: Report) -> str:
    """The base engine's end-to-end time against its roofline (prefill FLOPs at peak + every decode
    step's bytes at the bandwidth; benchmarks.roofline.engine_bound)."""
    from benchmarks import roofline as rf
    rate = statistics.median(base.rates)
    tokens = work.requests * work.max_tokens
    shape = cm.shape(label) if label in cm.MODEL_CONFIGS else cm.Shape.from_config(label, TINY)
    nbytes = 4 if rep.plan.tiny else 2
    steps = -(-work.requests // work.slots) * (work.max_tokens - 1)
    pre = cm.prefill_cost(shape, work.requests, work.prompt_len, 0, nbytes)
    dec = cm.decode_cost(shape, work.slots, work.prompt_len + work.max_tokens // 2, nbytes)
    row = rf.Row("engine", "engine", [tokens / rate], bytes=steps * dec["bytes"], flops=pre["flops"] + steps * dec["flops"])
    row.prefill_flops = pre["flops"]
    b = rf.engine_bound(row, rep.hardware)
    return (f"{cm.MODEL_NAMES.get(label, label)} serving base, {work.requests} requests x {work.prompt_len} -> "
            f"{work.max_tokens} tokens, {work.slots} slots: {rate:.0f} tok/s, {tokens / b:.0f} tok/s at the roofline: "
            f"{100 * b / row.t:.2g}% of the roofline")


def _breakdown_lines(parts: dict) -> list[str]:
    """Per N: where PreFT's time over base goes (one more run of each timed engine, its prefill and
    decode calls replayed apart: `benchmarks.preft_overhead.breakdown`)."""
    from benchmarks.preft_overhead import breakdown_lines
    out = []
    for n, p in parts.items():
        out += [f"PreFT vs base broken down, N={n} (one run each, its calls replayed: prefill and decode "
                f"device time, host = wall - both):", ""]
        out += (["skipped (budget)", ""] if p is None else [p, ""] if isinstance(p, str)
                else [*breakdown_lines(p), ""])
    return out


def serving(plan: Plan, rep: Report, backend: str):
    from flax import nnx

    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from experiments.serve_benchmark import Workload, run_serving, table
    lines = []
    for label, cfg in plan.models:
        if rep.over_budget():
            lines += [f"### {label}", "", "skipped (budget)", ""]
            continue
        t0 = time.perf_counter()
        L = cfg.n_layers
        kw = dict(plan.serving)
        kw.setdefault("reft_layers", tuple(sorted({L // 8, 3 * L // 8, 5 * L // 8, 7 * L // 8})))
        work = Workload(**kw)
        try:
            model = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, adapter_backend=backend)
            runner = ModelRunner(model)
            del model
            log, parts = [], {}

            def split(n, base, variants, parts=parts):
                """PreFT's cost over base broken down on the timed engines (issue 25.4); a failure
                here is reported in its place, the timed table kept."""
                if rep.over_budget():
                    parts[n] = None
                    return
                from benchmarks.preft_overhead import breakdown
                try:
                    parts[n] = {"base": breakdown(base.engine, base.serve_all),
                                **{k: breakdown(variants[k].engine, variants[k].serve_all)
                                   for k in ("PreFT-LoRA", "PreFT-ReFT")}}
                except Exception as e:       # noqa: BLE001
                    traceback.print_exc()
                    parts[n] = f"FAIL: {_err(e)}"
            base, rows = run_serving(runner, work, plan.serving_counts, deadline=rep.section_deadline,
                                     log=lambda s: (print(s, flush=True), log.append(s)), after=split)
            rep.summary.append(_engine_line(label, work, base, rep))
            lines += [f"### {label} (random weights, bfloat16, adapter backend `{runner.adapter_backend}`)", "",
                      f"{L} layers, d={cfg.d_model}, {cfg.n_heads}/{cfg.n_kv_heads} heads of {cfg.head_dim}, "
                      f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}. Workload: {work.requests} requests, "
                      f"{work.slots} decode slots, prompt {work.prompt_len} tokens, {work.max_tokens} generated "
                      f"(greedy, no early stop), prefill batch {work.prefill_batch}, median of {work.repeats} "
                      f"round-robin runs; LoRA {'/'.join(work.lora_targets)} r={work.lora_rank}, LoReFT "
                      f"r={work.reft_rank} on layers {work.reft_layers}. Section time "
                      f"{time.perf_counter() - t0:.0f} s.", "", *table(base, rows), "",
                      *_breakdown_lines(parts),
                      "<details><summary>log</summary>", "", "```", *log, "```", "</details>", ""]
            del runner
        except Exception as e:               # noqa: BLE001
            traceback.print_exc()
            lines += [f"### {label}", "", f"FAIL: {_err(e)}", ""]
    return lines


# ---- roofline -------------------------------------------------------------------------------
def _roofline_args(plan: Plan, model: str):
    from benchmarks import roofline as rf
    r = plan.roofline
    a = rf.parser().parse_args(["--model", model, "--dtype", r["dtype"]])
    a.rounds, a.round_s, a.max_kv_gb = r["rounds"], r["round_s"], r["max_kv_gb"]
    a.prefill_rows, a.adapters, a.multi_steps = r["prefill_rows"], r["adapters"], r["multi"]
    a.memory_limit = plan.memory_limit                  # cases that would not fit the device are skipped
    return a


def roofline_section(plan: Plan, rep: Report):
    """Decode / prefill / components of benchmarks.roofline in priority order, each item only while
    the section's time lasts. If the paged-attention kernel fails to run, the rest (and the serving
    section) use the gather path (PREFT_JAX_DECODE_ATTENTION=gather), and the report says so."""
    from benchmarks import roofline as rf
    from preft_jax.paged_kv import ATTENTION_ENV
    r = plan.roofline
    dtype = rf.DTYPES[r["dtype"]]
    hw = rep.hardware
    lines = [f"- {hw.line()}", ""]
    rows, notes, comps, trace = [], [], None, []
    log = lambda m: print(m, flush=True)          # noqa: E731
    runners = {}

    def runner(model):
        if model not in runners:
            runners.clear()                           # one model on the device at a time
            gc.collect()                              # (its arrays may sit in reference cycles)
            t0 = time.perf_counter()
            runners[model] = rf.build(model, dtype)
            log(f"  built {model} in {time.perf_counter() - t0:.1f} s")
        return runners[model]

    def decode(model, specs):
        run, shape = runner(model)
        args = _roofline_args(plan, model)
        got, skipped = rf.decode_rows(run, shape, dtype, specs, args, log, deadline=rep.section_deadline)
        failed = [x for x in skipped if "FAIL" in x]
        if failed and not os.environ.get(ATTENTION_ENV) and not got:
            os.environ[ATTENTION_ENV] = "gather"         # the kernel path failed: measure the gather path
            rep.notes.append(f"- decode attention kernel failed here ({failed[0][:200]}); the figures below use "
                             f"{ATTENTION_ENV}=gather")
            got, skipped = rf.decode_rows(run, shape, dtype, specs, args, log, deadline=rep.section_deadline)
        notes.extend(f"{model}: {x}" for x in skipped)
        for row in got:
            rep.summary.append(rf.fraction_line(model, r["dtype"], row, hw))
            row.label = f"{cm.MODEL_NAMES[model]} {row.label}"
            rows.append(row)

    head_model, head_specs = r["head"]
    steps = [("decode", lambda: decode(head_model, head_specs))]
    if r["second"]:
        steps.append(("decode", lambda: decode(*r["second"])))
    if r["more"]:
        steps.append(("decode", lambda: decode(head_model, r["more"])))

    def prefill():
        run, shape = runner(head_model)
        got = rf.prefill_rows(run, shape, dtype, r["prefill"], _roofline_args(plan, head_model), log,
                              deadline=rep.section_deadline, failed=notes)
        for row in got:
            rep.summary.append(rf.fraction_line(head_model, r["dtype"], row, hw))
            row.label = f"{cm.MODEL_NAMES[head_model]} {row.label}"
            rows.append(row)

    def components():
        nonlocal comps, trace
        run, shape = runner(head_model)
        why = rf.components_over_memory(run, r["components"], dtype, plan.memory_limit)
        if why:
            notes.append(why)
            return
        comps = rf.component_rows(run, shape, dtype, r["components"], _roofline_args(plan, head_model), log,
                                  deadline=rep.section_deadline)
        trace = rf.trace_ops(run, dtype, r["components"])
    steps.append(("prefill", prefill))
    if r["components"]:
        steps.append(("components", components))
    for what, fn in steps:
        if rep.over_budget():
            notes.append(f"{what}: skipped (budget)")
            continue
        try:
            fn()
        except rf.DeadlineSkipped as e:           # the budget ran out mid-way: not a failure
            notes.append(f"{what}: skipped (budget): {e}")
        except Exception as e:                    # noqa: BLE001  (report, keep going)
            traceback.print_exc()
            notes.append(f"{what}: FAIL {_err(e)}")
    runners.clear()
    gc.collect()
    lines += rf.table(rows, hw)
    if comps:
        B, ctx = r["components"]
        lines += ["", f"{cm.MODEL_NAMES[head_model]} decode step at B={B}, context {ctx}, by component (ablation on "
                  "the real step; differences are medians of paired per-round differences):", ""]
        lines += rf.component_table(comps, hw)
    if trace:
        lines += ["", *trace]
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return lines


# ---- training -------------------------------------------------------------------------------
def training_section(plan: Plan, rep: Report):
    """benchmarks.train_mfu: SFT step, GRPO update, GRPO forward / forward + backward, x W vs dY W^T."""
    from benchmarks import train_mfu as tm
    t = plan.training
    chosen = chunk_attention.resolve("auto", jnp.bfloat16 if t["dtype"] == "bf16" else jnp.float32)
    why = "" if chosen == "xla" else chunk_attention.self_check(chosen)
    if why:                                     # the kernel lowers but does not compile or compute: time xla
        rep.notes.append(f"- chunk attention {chosen} failed its check here ({why[:200]}); the training "
                         f"figures below use xla")
    elif chosen != "xla":
        rep.notes.append(f"- chunk attention {chosen}: compiled, ran and matched the xla reference here "
                         f"(output and q/k/v gradients, chunk_attention.self_check)")
    args = tm.finish_args(tm.parser().parse_args(
        ["--model", t["model"], "--dtype", t["dtype"], "--batch", str(t["batch"]), "--seq", str(t["seq"]),
         "--prompt-len", str(t["prompt_len"]), "--rank", str(t["rank"]), "--rounds", "2", "--no-measure",
         # the SFT step again with the other chunk attention, on the same weights, last (skipped first when
         # the budget runs out): flash kernel vs the XLA reference side by side (tiny: the GPU kernel, interpreted
         # on a CPU host)
         "--attention", "auto,flash:gpu" if plan.tiny else "xla" if why else "auto,xla",
         # and with the layers' projections kept for the backward (fewer FLOPs, 45 GiB planned at 8 x 1024)
         "--remat", "full,save_projections"]))
    args.orientation, args.ratio_tasks, args.variant_tasks = True, ["grpo"], ["sft"]
    res = tm.run(args, lambda m: print(m, flush=True), hw=rep.hardware, deadline=rep.section_deadline)
    lines = tm.report(args, res)
    for name, ts in res["times"].items():
        if ts and ("step" in name or "update" in name):
            rep.summary.append(f"{cm.MODEL_NAMES[t['model']]} {t['dtype']} {name}, batch {t['batch']} x seq "
                               f"{t['seq']}: {statistics.median(ts) * 1e3:.0f} ms, "
                               f"MFU {100 * res['flops'][name] / statistics.median(ts) / rep.hardware.peak:.0f}%")
    for line in lines:
        if "backward / forward" in line or " the time (per round" in line:
            rep.summary.append(f"{cm.MODEL_NAMES[t['model']]} {line.lstrip('- ')}")
    return lines


def versions() -> str:
    import importlib.metadata as md
    out = [f"python {pyplatform.python_version()}"]
    for pkg in ("jax", "jaxlib", "flax", "optax", "qwix"):
        try:
            out.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            out.append(f"{pkg} (not installed)")
    return ", ".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", "--tiny", dest="tiny", action="store_true",
                    help="tiny shapes, Pallas interpret mode (default on CPU): the same sections as the device "
                    "run, as a smoke test (about a minute of CPU time)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "device_check.md"))
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 330 s; tiny: 600 s)")
    ap.add_argument("--sections", default=None, help=f"comma-separated from {SECTIONS} (default {DEFAULT_SECTIONS})")
    ap.add_argument("--models", default=None, help=f"serving models, comma-separated from {list(MODELS)}")
    ap.add_argument("--adapters", default=None, help="numbers of adapters (timing default 1,64,512; serving 64,512)")
    ap.add_argument("--backend", default="auto", choices=("auto", "jnp", "xla", "pallas"),
                    help="adapter backend of the serving section")
    ap.add_argument("--no-cache", action="store_true", help="no persistent compilation cache")
    args = ap.parse_args(argv)
    sections = (args.sections or DEFAULT_SECTIONS).split(",")
    bad = [x for x in sections if x not in SECTIONS]
    if bad:
        ap.error(f"--sections: unknown {bad}; choose from {SECTIONS}")
    with WarningLog() as log:
        return _main(args, argv, sections, log)


def _main(args, argv, sections: list[str], log: WarningLog) -> int:
    fraction_chosen = MEM_FRACTION_ENV in os.environ
    os.environ.setdefault(MEM_FRACTION_ENV, MEM_FRACTION)     # read when the GPU backend starts: next line
    platform = jax.default_backend()
    tiny = args.tiny or platform == "cpu"
    cache = None
    if not args.no_cache:
        from preft_jax.cache.compilation import enable_compilation_cache
        try:
            cache = enable_compilation_cache()
        except Exception as e:  # noqa: BLE001 - unwritable home, or a cache option this jax lacks: run without it
            print(f"compilation cache off: {type(e).__name__}: {e}", flush=True)
    plan = make_plan(tiny, args.models.split(",") if args.models else None,
                     [int(n) for n in args.adapters.split(",")] if args.adapters else None)
    rep = Report(pathlib.Path(args.out), args.budget_s or (600.0 if tiny else 330.0))
    rep.warnings = log
    from benchmarks import roofline as rf
    rep.hardware = rf.hardware(jnp.float32 if tiny else jnp.bfloat16)
    plan = rep.plan = dataclasses.replace(plan, memory_limit=rep.hardware.memory)
    dev = jax.devices()[0]
    rep.header = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                  f"- device: {dev.platform} / {getattr(dev, 'device_kind', '?')} x {jax.device_count()}; "
                  f"{versions()}",
                  f"- command: `python scripts/device_check.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
                  f"- mode: {'tiny shapes, Pallas interpret mode (a smoke run, not a measurement)' if tiny else 'full shapes, compiled kernels'}",
                  f"- adapter backend `auto` resolves to `{resolve_backend('auto', platform)}` here; Pallas kernels "
                  f"{'lower' if pallas_lowers_on(platform) else 'do not lower'} on {platform}; a bfloat16 model's "
                  f"chunk attention (training, unpaged prefill) `auto` resolves to "
                  f"`{chunk_attention.resolve('auto', jnp.bfloat16, platform)}`",
                  f"- {rep.hardware.line()}" + ("" if rep.hardware.memory is None or platform == "cpu" else
                                                 f" ({MEM_FRACTION_ENV}={os.environ[MEM_FRACTION_ENV]}"
                                                 f"{'' if fraction_chosen else ', set by this script'})"),
                  f"- compilation cache: {cache or 'off'}"]
    print("\n".join(rep.header), flush=True)
    runs = {"kernels": lambda: kernel_checks(plan, rep, platform), "timing": lambda: timing(plan, rep, platform),
            "serving": lambda: serving(plan, rep, args.backend), "roofline": lambda: roofline_section(plan, rep),
            "training": lambda: training_section(plan, rep)}
    titles = {"kernels": "Kernels vs references", "timing": "Adapter op timing",
              "serving": "Serving benchmark (bfloat16)", "roofline": "Roofline: decode, prefill, components",
              "training": "Training MFU (SFT step, GRPO update)"}
    order = [x for x in ("roofline", "serving", "training", "kernels", "timing") if x in sections]
    for k, name in enumerate(order):
        t0 = time.perf_counter()
        left = [SHARE[x] for x in order[k:]]
        rep.section_deadline = t0 + (rep.deadline - t0) * SHARE[name] / sum(left)
        title = f"{k + 1}. {titles[name]}"
        if rep.over_budget():
            rep.section(title, 0.0, ["skipped (budget)"])
            continue
        try:
            lines = runs[name]()
        except Exception as e:               # noqa: BLE001  (a section failing leaves the others)
            traceback.print_exc()
            lines = [f"FAIL: {_err(e)}"]
        rep.section(title, time.perf_counter() - t0, lines)
        gc.collect()          # a section's models, engines and pools (reference cycles too) leave the device
    rep.write()               # with the warnings raised since the last section's write
    failed = any("FAIL" in line for _, _, lines in rep.sections for line in lines)
    print(f"\nwrote {rep.out} in {time.perf_counter() - rep.t0:.0f} s; {'FAILURES' if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
