"""Training-step MFU: one LoRA SFT step and one GRPO update through the real trainers, against peak FLOPs.

    python -m benchmarks.train_mfu [--model llama-3.1-8b] [--task sft,grpo] [--seq 1024] [--batch 8]
                                   [--rank 16] [--dtype bf16] [--rounds 3] [--peak TFLOP/s] [--explain] [--profile]
                                   [--attention auto[,xla]] [--remat full[,save_projections]]

Random base weights of the model's shape in `--dtype` (the activations' dtype), LoRA r16 on
q/k/v/o/gate/up/down of every layer (float32 adapter params and AdamW state, the trainers' own), a
synthetic batch of `--batch` sequences of `--seq` random tokens (prompt = the first `--prompt-len`,
loss / response on the rest). What is timed, round-robin, median (min-max) over `--rounds`:

* sft:  `train.sft.SFTTrainer.step` - forward, backward, optimizer (jitted, state donated);
* grpo: `train.grpo.GRPOTrainer.update` on a rollout batch - the reference (base) log-prob
  forward (`prepare`) then one optimizer step of the clipped surrogate + KL (rollouts are not part
  of the update and are not timed here; `benchmarks.roofline` times decode);
* for each task also the loss forward alone and forward + backward (no optimizer): jax.jit of the
  trainer's own `loss` and of `jax.value_and_grad` of it, so backward / forward =
  (t(fwd+bwd) - t(fwd)) / t(fwd).

FLOPs (`benchmarks.cost_model.lora_train_flops`, stated convention): the frozen base's matmuls cost
2 N T forward and 2 N T backward (activation gradients only; no weight gradients), so a step is
~4 N T, not 6 N T; the adapter 6 P T; causal attention forward 4 x pairs x layers x q_dim and twice
that backward; the LM head counted over every position. Recomputation (the LM head chunks are
rematerialized) is not counted: MFU = model FLOPs / (time x peak). The GRPO update adds the
reference forward (2 N T + the LM head + attention).

Variants (each further value of `--attention` or `--remat`): the step of each task again, on the
same weights, with that chunk attention (preft_jax.chunk_attention: e.g. `auto,xla` - the flash
kernel against the XLA reference) or that remat policy (TrainerConfig.remat: e.g.
`full,save_projections`), timed round-robin with the rest and printed as `<what> X / Y = N.NNx the
time`; they run last, so a deadline skips them first.

Why a backward costs what it does (`--explain`): the same forward / forward + backward with the LM
head unchunked (`logit_chunk=None`: no rematerialized vocab projection in the backward), and the
largest projection's forward product x W against its activation gradient dY W^T (same FLOPs; the
backward's matmuls contract the weight's minor dimension). `--profile` prints the ops of the
forward and of forward + backward by time (jax.profiler; on CPU use a small model: the trace of
a 30-layer step exceeds the profiler's 2 GB limit).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cost_model as cm
from preft_jax.lowering import error_line
from benchmarks.roofline import DTYPES, hardware, run_cli

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def synthetic_batch(cfg, batch: int, seq: int, prompt_len: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    plen = np.full((batch,), prompt_len, np.int32)
    mask = (np.arange(seq)[None, :] >= prompt_len).astype(np.float32) * np.ones((batch, 1), np.float32)
    return {"tokens": tokens, "prompt_lengths": plen, "loss_mask": mask}


def trainers(model: str, dtype, tasks, rank: int, batch: int, seq: int, backend: str = "auto",
             logit_chunk: int | None = 64, chunk_attention: str | None = None, base=None,
             remat: bool | str = True):
    """{task: trainer} on one random base model of `model`'s shape (`logit_chunk`: the trainers' LM
    head chunking; None = one unchunked, not rematerialized projection; `chunk_attention`: the
    model's, preft_jax.chunk_attention; `base`: an earlier call's runner whose weights are reused;
    `remat`: the trainers' TrainerConfig.remat)."""
    from flax import nnx

    from preft_jax import chunk_attention as ca
    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    from train.config import AdapterSpec, OptimizerConfig
    from train.grpo import GRPOConfig, GRPOTrainer
    from train.sft import SFTConfig, SFTTrainer
    cfg = cm.MODEL_CONFIGS[model]
    if base is None:
        runner = ModelRunner(Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype, adapter_backend=backend,
                                   chunk_attention=chunk_attention))
    else:                                       # the same weights (no copy), another attention
        m = nnx.merge(base.graphdef, base.state)
        m.chunk_attention = ca.resolve(chunk_attention, m.dtype)
        runner = ModelRunner(m)
    spec = AdapterSpec(kind="lora", rank=rank, mode="prefill", targets=TARGETS)
    out = {}
    if "sft" in tasks:
        out["sft"] = SFTTrainer(cfg, runner.graphdef, runner.state, SFTConfig(
            adapter=spec, optimizer=OptimizerConfig(lr=1e-4), batch_size=batch, seq_len=seq, steps=1000,
            log_every=0, logit_chunk=logit_chunk, remat=remat))
    if "grpo" in tasks:
        out["grpo"] = GRPOTrainer(cfg, runner, GRPOConfig(
            adapter=spec, optimizer=OptimizerConfig(lr=1e-4), steps=1000, prompts_per_step=1, group_size=batch,
            log_every=0, logit_chunk=logit_chunk, remat=remat), reward_fn=lambda c, a: 0.0, stop_token_ids=(-1,))
    return cfg, runner, out


class Case:
    """A timed callable `n` times back to back (blocked at the end); `state` threads donated state."""

    def __init__(self, fn, state=None):
        self.fn, self.state = fn, state

    def __call__(self, n: int):
        s = self.state
        for _ in range(n):
            s, out = self.fn(s)
        jax.block_until_ready((s, out))
        self.state = s


def orientation_cases(cfg, dtype, tokens: int) -> dict:
    """The largest projection's forward product x W and its activation gradient dY W^T (contracting
    W's minor dimension), same FLOPs: their time ratio is what the backward pays per FLOP."""
    d, f = cfg.d_model, cfg.ffn_dim
    x = jax.random.normal(jax.random.key(0), (tokens, d), dtype)
    w = jax.random.normal(jax.random.key(1), (d, f), dtype)
    dy = jax.random.normal(jax.random.key(2), (tokens, f), dtype)
    fw = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype))
    bw = jax.jit(lambda g, w: jnp.dot(g, w.T, preferred_element_type=jnp.float32).astype(dtype))
    return {f"matmul x W [{tokens}x{d}]x[{d}x{f}]": Case(lambda s: (s, fw(x, w))),
            f"matmul dY W^T [{tokens}x{f}]x[{d}x{f}]^T": Case(lambda s: (s, bw(dy, w)))}


def build_cases(task: str, tr, cfg, batch: int, seq: int, prompt_len: int, label: str = "",
                ratio: bool = True, step_label: str = "") -> dict:
    host = synthetic_batch(cfg, batch, seq, prompt_len)
    if task == "grpo":
        host["advantages"] = np.random.default_rng(1).normal(size=(batch,)).astype(np.float32)
    dev = tr.put_batch(host)
    loss_batch = dict(dev, ref_logp=jnp.zeros((batch, seq), jnp.float32)) if task == "grpo" else dev
    params = tr.init_state().params
    base = tr.base_state                 # an argument, as in the trainer's step (not baked in as constants)
    fwd = jax.jit(lambda p, bs, b: tr.loss(p, bs, b)[0])
    fwdbwd = jax.jit(jax.value_and_grad(lambda p, bs, b: tr.loss(p, bs, b)[0]))
    cases = {} if not ratio else {
        f"{task} forward (loss){label}": Case(lambda s: (s, fwd(params, base, loss_batch))),
        f"{task} forward + backward{label}": Case(lambda s: (s, fwdbwd(params, base, loss_batch))),
    }
    if label:
        return cases
    if task == "sft":
        cases[f"sft step (SFTTrainer.step){step_label}"] = Case(lambda s: tr.step(s, dev), tr.init_state())
    else:
        cases[f"grpo update (GRPOTrainer.update: reference forward + step){step_label}"] = Case(
            lambda s: tr.update(s, host), tr.init_state())
    return cases


def profile_ops(case: Case, steps: int = 2, top: int = 15) -> list[str]:
    from benchmarks.step_profile import op_table
    case(1)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            case(steps)
        files = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)
        data = json.load(gzip.open(files[0])) if files else {"traceEvents": []}
    events = data["traceEvents"] if isinstance(data, dict) else data
    skip = ("ThunkExecutor", "PjitFunction", "PjRt", "ParseArguments", "Execute")
    table = {k: v for k, v in op_table(events, steps).items() if not k.startswith(skip)}
    return [f"| {k[:70]} | {ms:.1f} | {n:g} |" for k, (ms, n) in list(table.items())[:top]]


def run(args, log=print, hw=None, deadline: float | None = None) -> dict:
    """Times every case (see the module docstring). A case whose first call fails (e.g. out of
    memory) is reported in 'failed' and left out; nothing new starts after `deadline`."""
    dtype = DTYPES[args.dtype]
    hw = hw or hardware(dtype, None, args.peak and args.peak * 1e12, measure=not args.no_measure)
    log(f"# {hw.line()}")
    t0 = time.perf_counter()
    from preft_jax import chunk_attention as ca
    from preft_jax.config import remat_from_word
    remat = remat_from_word(args.remat[0])
    cfg, runner, trs = trainers(args.model, dtype, args.task, args.rank, args.batch, args.seq, args.backend,
                                chunk_attention=args.attention[0], remat=remat)
    log(f"# {args.model} {args.dtype} built in {time.perf_counter() - t0:.1f} s; tasks {list(trs)}; "
        f"chunk attention {runner.chunk_attention}; remat {args.remat[0]}")
    shape = cm.shape(args.model)
    cases, flops, extra = {}, {}, {}
    f = cm.lora_train_flops(shape, args.batch, args.seq, TARGETS, args.rank)
    ref_fwd = f["forward"] - 2 * f["lora_params"] * f["tokens"]
    for task, tr in trs.items():
        c = build_cases(task, tr, cfg, args.batch, args.seq, args.prompt_len,
                        ratio=task in getattr(args, "ratio_tasks", args.task))
        if args.explain:
            _, _, plain = trainers(args.model, dtype, [task], args.rank, args.batch, args.seq, args.backend,
                                   logit_chunk=None, base=runner, chunk_attention=runner.chunk_attention, remat=remat)
            c.update(build_cases(task, plain[task], cfg, args.batch, args.seq, args.prompt_len,
                                 label=", LM head unchunked (no remat)"))
        for name in c:
            flops[name] = (f["forward"] if "forward (loss)" in name else
                           f["total"] + (ref_fwd if task == "grpo" and "update" in name else 0))
        cases.update(c)
    # the step of each task again on the same weights, with each further attention, then each further remat
    variants = [(f"attention {a}", dict(chunk_attention=a, remat=remat)) for a in args.attention[1:]]
    variants += [(f"remat {r}", dict(chunk_attention=runner.chunk_attention, remat=remat_from_word(r)))
                 for r in args.remat[1:]]
    seen = {(runner.chunk_attention, remat)}
    for label, kw in variants:
        attention = ca.resolve(kw["chunk_attention"], dtype)
        if (attention, kw["remat"]) in seen:                   # e.g. auto,xla on a CPU: nothing new
            continue
        seen.add((attention, kw["remat"]))
        if label.startswith("attention"):
            label = f"attention {attention}"
        tasks = getattr(args, "variant_tasks", args.task)     # the device check: the SFT step only
        _, _, more = trainers(args.model, dtype, tasks, args.rank, args.batch, args.seq, args.backend,
                              base=runner, chunk_attention=attention, remat=kw["remat"])
        for task, tr in more.items():
            c = build_cases(task, tr, cfg, args.batch, args.seq, args.prompt_len, ratio=False, step_label=f", {label}")
            for name in c:
                flops[name] = f["total"] + (ref_fwd if task == "grpo" else 0)
            extra.update(c)
    if args.explain or getattr(args, "orientation", False):
        c = orientation_cases(cfg, dtype, args.batch * args.seq)
        for name in c:
            flops[name] = 2 * args.batch * args.seq * cfg.d_model * cfg.ffn_dim
        cases.update(c)
    cases.update(extra)                      # last: skipped first when the deadline comes
    failed = []
    for name, case in list(cases.items()):
        if deadline is not None and time.perf_counter() > deadline:
            failed.append(f"{name}: skipped (budget)")
            del cases[name]
            continue
        t0 = time.perf_counter()
        try:
            case(1)
        except Exception as e:                   # noqa: BLE001  (e.g. out of memory: report it, go on)
            line = error_line(e)
            failed.append(f"{name}: FAIL {line}")
            log(f"  FAIL {name}: {line.split(': ', 1)[1]}")
            del cases[name]
            continue
        log(f"  warm {name}: {time.perf_counter() - t0:.1f} s")
    times = {k: [] for k in cases}
    for r in range(args.rounds):
        if r and deadline is not None and time.perf_counter() > deadline:
            break
        for name, case in cases.items():
            t0 = time.perf_counter()
            case(args.iters)
            times[name].append((time.perf_counter() - t0) / args.iters)
    prof = {}
    if args.profile:
        for name in cases:
            if "forward" in name:
                prof[name] = profile_ops(cases[name])
    return {"hardware": hw, "times": times, "flops": flops, "profile": prof, "cost": f, "failed": failed,
            "attention": runner.chunk_attention}


def report(args, res) -> list[str]:
    hw, times, flops = res["hardware"], res["times"], res["flops"]
    f = res["cost"]
    out = [f"- {hw.line()}",
           f"- {cm.MODEL_NAMES[args.model]} shape, random weights, {args.dtype} base/activations, LoRA r{args.rank} on "
           f"{'/'.join(TARGETS)} ({f['lora_params'] / 1e6:.1f} M params, float32, AdamW float32), batch "
           f"{args.batch} x seq {args.seq} (prompt {args.prompt_len}); model FLOPs per step "
           f"{f['total'] / 1e12:.3g} T (forward {f['forward'] / 1e12:.3g} T, backward {f['backward'] / 1e12:.3g} T); "
           f"chunk attention {res['attention']} (preft_jax.chunk_attention), remat {args.remat[0]}",
           "", "| what | ms: median (min-max) | model TFLOPs | MFU |", "|---|---:|---:|---:|"]
    for name, ts in times.items():
        t = statistics.median(ts)
        out.append(f"| {name} | {t * 1e3:.4g} ({min(ts) * 1e3:.4g}-{max(ts) * 1e3:.4g}) | {flops[name] / 1e12:.3g} "
                   f"| {100 * flops[name] / t / hw.peak:.1f}% |")
    out.append("")
    for task in args.task:
        for label in ("", ", LM head unchunked (no remat)"):
            fw, fb = f"{task} forward (loss){label}", f"{task} forward + backward{label}"
            if fw in times and fb in times:
                ratios = [(b - a) / a for a, b in zip(times[fw], times[fb])]
                out.append(f"- {task}{label}: backward / forward = {statistics.median(ratios):.2f}x (per round "
                           f"{min(ratios):.2f}-{max(ratios):.2f}x; model-FLOP ratio "
                           f"{f['backward'] / f['forward']:.2f}x, + the LM head recomputed: "
                           f"{(f['backward'] + f['head']) / f['forward']:.2f}x)")
    for what, mine in (("attention", res["attention"]), ("remat", args.remat[0])):
        for name in [k for k in times if f", {what} " in k]:
            main = name.split(f", {what} ")[0]
            if main in times:
                r = [b / a for a, b in zip(times[main], times[name])]
                out.append(f"- {main}: {what} {name.split(f', {what} ')[1]} / {mine} = "
                           f"{statistics.median(r):.2f}x the time (per round {min(r):.2f}-{max(r):.2f}x)")
    mm = [k for k in times if k.startswith("matmul")]
    if len(mm) == 2:
        r = [b / a for a, b in zip(times[mm[0]], times[mm[1]])]
        out.append(f"- activation-gradient matmul dY W^T / forward x W, same FLOPs: {statistics.median(r):.2f}x "
                   f"({min(r):.2f}-{max(r):.2f}x)")
    if res.get("failed"):
        out += ["", *[f"- {x}" for x in res["failed"]]]
    for name, lines in res["profile"].items():
        out += ["", f"| op ({name}) | thread-ms per call | calls |", "|---|---:|---:|", *lines]
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="llama-3.1-8b", choices=list(cm.MODEL_CONFIGS))
    ap.add_argument("--task", type=lambda s: s.split(","), default=["sft", "grpo"])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=None, help="default seq / 4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default=None, choices=("f32", "bf16"), help="default: f32 on CPU, bf16 elsewhere")
    ap.add_argument("--backend", default="auto", choices=("auto", "jnp", "xla", "pallas"))
    ap.add_argument("--attention", type=lambda s: s.split(","), default=None,
                    help="the model's chunk attention (preft_jax.chunk_attention: auto, xla, flash, flash:gpu, "
                         "flash:tpu; default: $PREFT_JAX_CHUNK_ATTENTION, else auto); more than one, comma-separated: "
                         "each task's step again with each further one, on the same weights, timed side by side "
                         "(e.g. auto,xla)")
    ap.add_argument("--remat", type=lambda s: s.split(","), default=["full"],
                    help="the trainers' TrainerConfig.remat: full, off, save_qkvo, save_projections "
                         "(preft_jax.config.REMAT_POLICIES); more than one: each further one timed as --attention's")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=1, help="calls per round per case")
    ap.add_argument("--peak", type=float, default=None, help="TFLOP/s (default: stated / measured)")
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--profile", action="store_true", help="op tables of the forward and forward + backward")
    ap.add_argument("--explain", action="store_true", help="also: forward / backward with the LM head unchunked "
                    "(no rematerialization), and x W vs dY W^T at the largest projection")
    return ap


def finish_args(args):
    if args.dtype is None:
        args.dtype = "f32" if jax.default_backend() == "cpu" else "bf16"
    if args.prompt_len is None:
        args.prompt_len = args.seq // 4
    bad = [t for t in args.task if t not in ("sft", "grpo")]
    if bad:
        raise SystemExit(f"--task: unknown {bad}; choose from sft, grpo")
    from preft_jax.config import REMAT_WORDS
    bad = [r for r in args.remat if r not in REMAT_WORDS]
    if bad:
        raise SystemExit(f"--remat: unknown {bad}; choose from {', '.join(REMAT_WORDS)}")
    from preft_jax.chunk_attention import CHOICES
    args.attention = args.attention or [None]
    bad = [a for a in args.attention if a is not None and a not in CHOICES]
    if bad:
        raise SystemExit(f"--attention: unknown {bad}; choose from {', '.join(CHOICES)}")
    return args


def main(argv=None) -> int:
    return run_cli("benchmarks.train_mfu", parser, finish_args, run, report, argv)


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
