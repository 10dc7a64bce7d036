"""One command for an accelerator (GPU or TPU): are the kernels right there, how fast are they, and what
does PreFT buy when serving at the paper's shapes. Writes a markdown report (default docs/device_check.md).

    python scripts/device_check.py            # GPU/TPU: full shapes, budgeted to < 8 min on one H200
    python scripts/device_check.py --tiny     # tiny shapes, Pallas interpret mode (CI; automatic on CPU)

Sections (each prints its wall time; every item checks the time budget first and is skipped, and
listed as skipped, once the budget is spent; the report is rewritten after every section):
  1. kernels   every Pallas kernel compiled with interpret=False (lora_sgmv, lora_bgmv, reft_apply;
               their backward passes run the grouped outer-product kernel) at the paper's layer
               shapes in float32 and bfloat16, forward and gradients checked against a float32 jnp
               reference (random group sizes, empty groups included); the same for the `xla`
               adapter backend (ragged_dot grouped / per-token gather); and slot isolation on every
               backend (NaN/Inf weights in one slot must not change any other row).
  2. timing    one layer's adapter op, round-robin timed, median per call (min-max over rounds):
               prefill LoRA (SGMV vs xla ragged_dot), decode LoRA (BGMV vs xla gather), prefill
               ReFT (Pallas vs xla ragged_dot), for 1, 64 and 512 adapters.
  3. serving   serve.benchmark's engine benchmark in bfloat16 on random-weight models shaped like
               Qwen2.5-0.5B and Llama-3.1-8B: base vs all-token LoRA vs PreFT-LoRA vs PreFT-ReFT
               with 1, 64 and 512 adapters, adapter backend `auto`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import pathlib
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))             # this checkout's packages, not an installed copy

import jax                                 # noqa: E402
import jax.numpy as jnp                    # noqa: E402
import numpy as np                         # noqa: E402

from preft_jax.adapters import apply       # noqa: E402
from preft_jax.adapters.context import AdapterContext, pallas_lowers_on, resolve_backend   # noqa: E402
from preft_jax.config import ModelConfig   # noqa: E402

QWEN_05B = ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, head_dim=64,
                       ffn_dim=4864, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=True, max_seq_len=512)
LLAMA_8B = ModelConfig(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                       ffn_dim=14336, rope_theta=5e5, rms_eps=1e-5, tie_embeddings=False, max_seq_len=512)
TINY = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   tie_embeddings=True, max_seq_len=64)
MODELS = {"qwen2.5-0.5b": QWEN_05B, "llama-3.1-8b": LLAMA_8B}
TOL = {"float32": 1e-2, "bfloat16": 3e-2}   # max |err| / max |ref|; f32 matmuls may run as TF32 on GPUs


@dataclasses.dataclass(frozen=True)
class Plan:
    tiny: bool
    interpret: bool
    kernel_shapes: tuple             # (label, T prefill, T decode, d_in, d_out, rank, N)
    kernel_dtypes: tuple
    timing_dims: tuple               # (label, d) of the projection / residual stream
    timing_tokens: tuple             # (prefill tokens, decode tokens)
    adapter_counts: tuple
    timing_calls: int
    timing_rounds: int
    models: tuple                    # (label, ModelConfig)
    serving: dict                    # Workload fields


def make_plan(tiny: bool, models: list[str] | None, adapters: list[int] | None) -> Plan:
    if tiny:
        return Plan(True, True, (("tiny", 24, 6, 32, 48, 4, 5),), ("float32",), (("tiny", 64),), (24, 4), (2,), 1, 1,
                    (("tiny", TINY),), dict(slots=2, requests=2, prefill_batch=2, prompt_len=4, max_tokens=2,
                                            repeats=1, lora_rank=4, reft_rank=2, reft_layers=(1,)))
    counts = tuple(adapters or (1, 64, 512))
    return Plan(False, False,
                (("qwen q-proj", 1024, 64, 896, 896, 16, 64), ("llama q-proj", 1024, 64, 4096, 4096, 16, 64)),
                ("float32", "bfloat16"),
                (("qwen2.5-0.5b", 896), ("llama-3.1-8b", 4096)), (2048, 64), counts, 20, 5,
                tuple((m, MODELS[m]) for m in (models or list(MODELS))),
                dict(slots=64, requests=64, prefill_batch=16, prompt_len=64, max_tokens=64, repeats=2,
                     lora_rank=16, reft_rank=8))


class Report:
    def __init__(self, out: pathlib.Path, budget_s: float):
        self.out, self.t0, self.budget_s = out, time.perf_counter(), budget_s
        self.deadline = self.t0 + budget_s
        self.sections: list[tuple[str, float, list[str]]] = []
        self.header: list[str] = []

    def over_budget(self) -> bool:
        return time.perf_counter() > self.deadline

    def section(self, title, seconds, lines):
        self.sections.append((title, seconds, lines))
        print(f"\n## {title} ({seconds:.0f} s)\n" + "\n".join(lines), flush=True)
        self.write()

    def write(self):
        total = time.perf_counter() - self.t0
        text = ["# Device check", "", *self.header, f"- total wall time: {total:.0f} s (budget {self.budget_s:.0f} s)",
                ""]
        for title, seconds, lines in self.sections:
            text += [f"## {title}", "", f"_section wall time {seconds:.0f} s_", "", *lines, ""]
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("\n".join(text))


def _err(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return f"{type(e).__name__}: {first[:160]}".replace("|", "/")


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
            cases = {
                "LoRA prefill (SGMV)": ("grouped", idx_p, lora, (x, A, B)),
                "LoRA decode (BGMV)": ("gather", idx_d, lora, (xd, A, B)),
                "ReFT prefill": ("grouped", idx_p, reft, (x, R, b, sub)),
            }
            for op, (mode, idx, fn, args) in cases.items():
                fns = {}
                try:
                    fns["xla"] = (fn, (AdapterContext.build(idx, s, "xla", mode), *args))
                    if pallas_ok:
                        fns["pallas"] = (fn, (AdapterContext.build(idx, s, "pallas", mode), *args))
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
def serving(plan: Plan, rep: Report, backend: str):
    from flax import nnx

    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from serve.benchmark import Workload, run_serving, table
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
            log = []
            base, rows = run_serving(runner, work, plan.adapter_counts, deadline=rep.deadline,
                                     log=lambda s: (print(s, flush=True), log.append(s)))
            lines += [f"### {label} (random weights, bfloat16, adapter backend `{runner.adapter_backend}`)", "",
                      f"{L} layers, d={cfg.d_model}, {cfg.n_heads}/{cfg.n_kv_heads} heads of {cfg.head_dim}, "
                      f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}. Workload: {work.requests} requests, "
                      f"{work.slots} decode slots, prompt {work.prompt_len} tokens, {work.max_tokens} generated "
                      f"(greedy, no early stop), prefill batch {work.prefill_batch}, median of {work.repeats} "
                      f"round-robin runs; LoRA {'/'.join(work.lora_targets)} r={work.lora_rank}, LoReFT "
                      f"r={work.reft_rank} on layers {work.reft_layers}. Section time "
                      f"{time.perf_counter() - t0:.0f} s.", "", *table(base, rows), "",
                      "<details><summary>log</summary>", "", "```", *log, "```", "</details>", ""]
            del runner
        except Exception as e:               # noqa: BLE001
            traceback.print_exc()
            lines += [f"### {label}", "", f"FAIL: {_err(e)}", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, Pallas interpret mode (default on CPU)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "device_check.md"))
    ap.add_argument("--budget-s", type=float, default=None, help="time budget (default 420 s; tiny: 600 s, a smoke run)")
    ap.add_argument("--sections", default="kernels,timing,serving")
    ap.add_argument("--models", default=None, help=f"serving models, comma-separated from {list(MODELS)}")
    ap.add_argument("--adapters", default=None, help="numbers of adapters (default 1,64,512)")
    ap.add_argument("--backend", default="auto", choices=("auto", "jnp", "xla", "pallas"),
                    help="adapter backend of the serving section")
    args = ap.parse_args(argv)
    platform = jax.default_backend()
    tiny = args.tiny or platform == "cpu"
    plan = make_plan(tiny, args.models.split(",") if args.models else None,
                     [int(n) for n in args.adapters.split(",")] if args.adapters else None)
    rep = Report(pathlib.Path(args.out), args.budget_s or (600.0 if tiny else 420.0))
    dev = jax.devices()[0]
    rep.header = [f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                  f"- device: {dev.platform} / {getattr(dev, 'device_kind', '?')} x {jax.device_count()}; "
                  f"jax {jax.__version__}",
                  f"- mode: {'tiny shapes, Pallas interpret mode (a smoke run, not a measurement)' if tiny else 'full shapes, compiled kernels'}",
                  f"- adapter backend `auto` resolves to `{resolve_backend('auto', platform)}` here; Pallas kernels "
                  f"{'lower' if pallas_lowers_on(platform) else 'do not lower'} on {platform}"]
    print("\n".join(rep.header), flush=True)
    sections = args.sections.split(",")
    for name, fn in (("kernels", lambda: kernel_checks(plan, rep, platform)),
                     ("timing", lambda: timing(plan, rep, platform)),
                     ("serving", lambda: serving(plan, rep, args.backend))):
        if name not in sections:
            continue
        t0 = time.perf_counter()
        title = {"kernels": "1. Kernels vs references", "timing": "2. Adapter op timing",
                 "serving": "3. Serving benchmark (bfloat16)"}[name]
        if rep.over_budget():
            rep.section(title, 0.0, ["skipped (budget)"])
            continue
        lines = fn()
        rep.section(title, time.perf_counter() - t0, lines)
    failed = any("FAIL" in line for _, _, lines in rep.sections for line in lines)
    print(f"\nwrote {rep.out} in {time.perf_counter() - rep.t0:.0f} s; {'FAILURES' if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
