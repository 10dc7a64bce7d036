"""Roofline accounting: the real jitted steps timed beside their hardware bounds.

    python -m benchmarks.roofline [--model tiny|smollm2-135m|qwen2.5-0.5b|llama-3.1-8b] [--dtype f32|bf16]
                                  [--batches 1,16,64,256] [--contexts 128,2048] [--prefill 512,2048]
                                  [--bandwidth GB/s] [--peak TFLOP/s] [--components] [--engine] [--trace]

Random weights of the model's shape (nothing is loaded). What is timed (each variant compiled and
warmed first, then every variant timed round-robin, `--rounds` rounds; a round runs `iters` calls
back to back - as many as fill `--round-s` - and ends with one block_until_ready; median per call
and min-max over rounds):

* decode: `preft_jax.paged_step` on B rows, each attending to `context` cached tokens (its own
  blocks, random K/V), greedy, base weights (= PreFT decode), the KV pool donated and fed back,
  the sampled tokens fed back as the next inputs (the serving dependency);
* prefill: `paged_step` on one chunk of T tokens (`--prefill-rows` rows of T / rows), base and
  PreFT-LoRA (q/k/v/o/gate/up/down r16, each row on another of `--adapters` adapters);
* engine: `serve.engine.Engine.generate` on `--engine-requests` requests x `--engine-prompt`
  random tokens -> `--engine-tokens` greedy tokens (no stop), after one untimed run;
* components (`--components`), for one decode case (`--component-case B,context`), by ablation on
  the real step: the sampler (paged_step - paged_logits), the LM head (model.logits alone),
  attention over the cached context (context - context 0), the KV writes alone as the step makes
  them (the gather path: paged_kv.write_kv, one scatter; the kernel path: write_token_layer per
  layer in a layer scan on the carried pool), the layer stack at context 0 (what is left: projections, MLP, norms), the host time
  between device calls (a paged_step loop vs `paged_decode_steps`: N steps in one call), the
  round trip when the host waits for each step, and pool-size sensitivity (the same live context
  in a pool 4x larger, or 3x or 2x where 4x does not fit the device: a step that copies the pool
  gets slower, or runs out of memory, which its row then says);
* memory: each decode case's need (`decode_need`) is checked against the device's memory
  (`device_memory`, `--device-memory-gib`; not on CPU) before it allocates: one that cannot fit is
  listed as skipped with its need;
* `--trace`: one decode call of the component case under jax.profiler, its ops by device time.

Bounds (`benchmarks.cost_model`, analytic): bytes = weights read once + KV read (B x (context + 1)
tokens) + KV written; FLOPs = 2 x matmul weights x tokens + causal attention. bound = max(bytes /
bandwidth, FLOPs / peak); the fraction printed is bound / measured ("62% of HBM bound" when bytes
bind, "% of peak FLOPs" when FLOPs do). Bandwidth and peak: stated per device (H200 4.8 TB/s, 989
TFLOP/s dense bf16; `cost_model.HARDWARE`) or, on CPU / unknown devices, measured here (a stream
copy, a large matmul in the run's dtype); `--bandwidth` / `--peak` override. The analytic count
is cross-checked against XLA's `cost_analysis()` of the same step compiled for a 1-layer model
(XLA counts a while-loop body once, so the full model's figure would miss L - 1 layers; custom
calls such as the Pallas attention kernel are not counted by XLA at all).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cost_model as cm
from preft_jax.lowering import error_line

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "float32": jnp.float32, "bfloat16": jnp.bfloat16}
BLOCK = 16
GiB = 2 ** 30
HEADROOM = 2 * GiB     # a decode case's memory beside the weights, its pool and its logits: activations,
                       # compiler workspace (a plan, not a measurement: benchmarks.memory_plan measures)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


# ------------------------------------------------------------------------------------ hardware
@dataclasses.dataclass
class Hardware:
    device: str
    bandwidth: float               # bytes / s used for the bound
    peak: float                    # FLOP / s used for the bound
    measured_bandwidth: float | None
    measured_peak: float | None
    source: str                    # where bandwidth / peak come from
    memory: int | None = None      # bytes this process may allocate on the device (`device_memory`)

    def line(self) -> str:
        m = ""
        if self.measured_bandwidth:
            m = (f"; measured here: stream copy {self.measured_bandwidth / 1e9:.1f} GB/s, matmul "
                 f"{self.measured_peak / 1e12:.3f} TFLOP/s")
        if self.memory:
            m += (f"; {'host memory planned against' if self.device.startswith('cpu') else 'device memory for this process'}"
                  f" {self.memory / GiB:.1f} GiB")
        return (f"{self.device}: bound from {self.bandwidth / 1e9:.1f} GB/s and {self.peak / 1e12:.3f} TFLOP/s "
                f"({self.source}){m}")


HOST_MEMORY_SHARE = 0.8           # CPU: the share of the host's available memory a run plans against


def host_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """CPU "device" memory: HOST_MEMORY_SHARE of the host's available memory now (MemAvailable),
    None where it cannot be read (then cases are not checked, as before)."""
    try:
        with open(meminfo) as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return int(HOST_MEMORY_SHARE * kib * 1024)


def device_memory(dev=None) -> int | None:
    """Bytes this process may allocate on `dev` (default: the first device): `memory_stats()`'s
    bytes_limit - on a GPU the share XLA's allocator took (XLA_PYTHON_CLIENT_MEM_FRACTION, 75% by
    default); on CPU `host_memory` (a 24 GiB machine ran out of memory in the components' 4x pool
    case at B=64, context 2048, when nothing was checked). None where neither is known."""
    dev = dev or jax.devices()[0]
    if dev.platform == "cpu":
        return host_memory()
    try:
        stats = dev.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def measure_bandwidth(nbytes: int, calls: int = 5) -> float:
    """Stream copy: x <- x * 2 over a float32 array of `nbytes`, donated (no allocation per call):
    read + write = 2 x nbytes per call. Best round of 3 (the machine may be shared)."""
    f = jax.jit(lambda x: x * 2.0, donate_argnums=0)
    x = f(jnp.ones((nbytes // 4,), jnp.float32))
    x = f(x)
    jax.block_until_ready(x)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            x = f(x)
        jax.block_until_ready(x)
        best = min(best, (time.perf_counter() - t0) / calls)
    del x
    return 2 * nbytes / best


def measure_peak(n: int, dtype, calls: int = 3) -> float:
    """A large n x n matmul in `dtype` (float32 accumulation for bf16): 2 n^3 FLOPs per call; best
    round of 3."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(dtype))
    jax.block_until_ready(f(a, b))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = f(a, b)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 2 * n ** 3 / best


def hardware(dtype, bandwidth: float | None = None, peak: float | None = None, measure: bool = True) -> Hardware:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    cpu = dev.platform == "cpu"
    mb = mp = None
    if measure:
        mb = measure_bandwidth((256 if cpu else 2048) << 20)
        mp = measure_peak(1024 if cpu else 8192, dtype)
    stated = cm.stated_hardware(kind)
    if stated is not None and not cpu:
        (bw, pk), source = stated[1], f"stated for {kind} ({stated[0]})"
        if jnp.dtype(dtype) == jnp.float32:
            source += ", bf16 peak (float32 matmuls may run as TF32)"
    else:
        bw, pk, source = mb, mp, "measured here"
    if bandwidth:
        bw, source = bandwidth, "--bandwidth/--peak"
    if peak:
        pk, source = peak, "--bandwidth/--peak"
    return Hardware(f"{dev.platform} / {kind}", bw, pk, mb, mp, source, device_memory(dev))


# --------------------------------------------------------------------------------- the model
def build(model: str, dtype):
    """(ModelRunner, cost_model.Shape) of random weights of `model`'s shape."""
    from flax import nnx

    from preft_jax.generation import ModelRunner
    from preft_jax.model import Llama
    cfg = cm.MODEL_CONFIGS[model]
    runner = ModelRunner(Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype, adapter_backend="auto"))
    return runner, cm.shape(model)


def decode_batch(cfg, rows: int, context: int, *, attention: str | None = None, seed: int = 0, steps: int = 1):
    """(tokens [R, 1], PagedBatch) for R rows each with `context` cached tokens in its own blocks
    (1 + r * nb ...), room for `steps` new ones; no pool."""
    from preft_jax.paged_kv import PagedBatch, choose_attention
    nb = -(-(context + steps) // BLOCK)
    rng = np.random.default_rng(seed)
    bt = (1 + np.arange(rows * nb, dtype=np.int32)).reshape(rows, nb)
    widx = (bt[:, context // BLOCK] * BLOCK + context % BLOCK)[:, None].astype(np.int32)
    batch = PagedBatch(jnp.asarray(bt), jnp.full((rows,), context, jnp.int32), jnp.ones((rows,), jnp.int32),
                       jnp.asarray(widx), attention or choose_attention(cfg, BLOCK))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (rows, 1)), jnp.int32)
    return tokens, batch


def decode_inputs(cfg, rows: int, context: int, dtype, *, pool_factor: int = 1, attention: str | None = None,
                  seed: int = 0, steps: int = 1):
    """(tokens [R, 1], PagedBatch, PagedKVCache): `decode_batch` and a pool of pool_factor x the
    blocks the rows need, + the reserved block 0."""
    from preft_jax.paged_kv import PagedKVCache
    tokens, batch = decode_batch(cfg, rows, context, attention=attention, seed=seed, steps=steps)
    NB = pool_factor * batch.block_tables.shape[0] * batch.block_tables.shape[1] + 1
    cache = PagedKVCache.create(cfg, NB, BLOCK, dtype, fill=0.1)             # non-zero K/V, made once
    return tokens, batch, cache


def greedy_rows(rows: int):
    z = jnp.zeros((rows,), jnp.float32)
    return z, jnp.ones((rows,), jnp.float32), jnp.zeros((rows,), jnp.int32), jax.random.key(0)


class DecodeLoop:
    """`iters` greedy decode steps back to back through paged_step, tokens and the donated pool fed back."""

    def __init__(self, runner, rows, context, dtype, pool_factor=1, sync=False, multi: int = 0):
        self.runner, self.rows, self.context, self.sync, self.multi = runner, rows, context, sync, multi
        self.args = (rows, context, dtype, pool_factor)
        self.state = None

    def setup(self):
        self.tokens, self.batch, self.cache = decode_inputs(self.runner.cfg, *self.args[:3],
                                                            pool_factor=self.args[3], steps=max(1, self.multi))
        jax.block_until_ready(self.cache)

    def teardown(self):
        self.cache = self.tokens = self.batch = None

    def __call__(self, iters: int):
        from preft_jax.paged_step import paged_decode_steps, paged_step
        r = self.runner
        temp, top_p, top_k, key = greedy_rows(self.rows)
        plen = jnp.ones((self.rows,), jnp.int32)
        tok, cache = self.tokens, self.cache
        if self.multi:
            for _ in range(max(1, iters // self.multi)):
                toks, cache = paged_decode_steps(r.graphdef, r.state, tok, self.batch, cache, None, None, plen,
                                                 temp, top_p, top_k, key, num_steps=self.multi)
                tok = toks[:, -1:]
            calls = max(1, iters // self.multi) * self.multi
        else:
            for _ in range(iters):
                nxt, cache = paged_step(r.graphdef, r.state, tok, self.batch, cache, None, None, plen, temp, top_p,
                                        top_k, key)
                tok = nxt[:, None]
                if self.sync:
                    np.asarray(nxt)                      # the host reads every step's tokens
            calls = iters
        jax.block_until_ready((tok, cache))
        self.tokens, self.cache = tok, cache
        return calls


class Calls:
    """`iters` calls of fn(state) -> state (a donated state threaded through), blocked at the end."""

    def __init__(self, make: Callable[[], tuple], fn: Callable):
        self.make, self.fn, self.state = make, fn, None

    def setup(self):
        self.state = self.make()
        jax.block_until_ready(self.state)

    def teardown(self):
        self.state = None

    def __call__(self, iters: int):
        s = self.state
        for _ in range(iters):
            s = self.fn(s)
        jax.block_until_ready(s)
        self.state = s
        return iters


DEADLINE_SKIP = "skipped (deadline before its first call)"


class DeadlineSkipped(RuntimeError):
    """A measurement left out because its deadline passed (a budget outcome, not a failure)."""


def time_round_robin(cases: dict, rounds: int, round_s: float, log=print, max_iters: int = 200,
                     deadline: float | None = None, failed: list | None = None) -> dict:
    """{name: case with setup(), __call__(iters) -> calls made, teardown()} -> {name: [s per call, per round]}.

    Each case is set up (its device arrays made) for its turn and torn down after, so the pools of
    all cases need not fit at once; the first call of each compiles and sizes `iters` (untimed). A
    case whose first calls raise is dropped (with `failed` given: listed there, else re-raised); no
    case is warmed (compiled) and no round starts after `deadline` (time.perf_counter()): a case
    not warmed by then is dropped and listed as skipped."""
    iters, out = {}, {}

    def drop(name, e):
        """A case that raised (first calls or a later round, e.g. out of memory): listed in `failed`
        as '<name>: FAIL <error>' and left out, its earlier rounds too."""
        if failed is None:
            raise e
        line = error_line(e)
        failed.append(f"{name}: FAIL {line}")
        log(f"  FAIL {name}: {line}")
        del cases[name]
        out.pop(name, None)

    for name, case in list(cases.items()):
        if deadline is not None and time.perf_counter() > deadline:      # compiling it would overrun
            if failed is not None:
                failed.append(f"{name}: {DEADLINE_SKIP}")
            log(f"  deadline: {name} not warmed")
            del cases[name]
            continue
        try:
            case.setup()
            t0 = time.perf_counter()
            case(1)
            t_first = time.perf_counter() - t0
            t0 = time.perf_counter()
            n = case(1)
            one = (time.perf_counter() - t0) / n
        except Exception as e:               # noqa: BLE001  (a variant that does not run here)
            drop(name, e)
            continue
        finally:
            case.teardown()
        iters[name] = int(min(max_iters, max(1, round_s / max(one, 1e-6))))
        out[name] = []
        log(f"  warm {name}: first call {t_first:.2f} s, then {one * 1e3:.2f} ms; {iters[name]} per round")
    for r in range(rounds):
        if r and deadline is not None and time.perf_counter() > deadline:
            log(f"  deadline: {r} rounds")
            break
        for name, case in list(cases.items()):
            try:
                case.setup()
                case(1)                                         # untimed: re-touch after setup
                t0 = time.perf_counter()
                n = case(iters[name])
                out[name].append((time.perf_counter() - t0) / n)
            except Exception as e:           # noqa: BLE001
                drop(name, e)
            finally:
                case.teardown()
    return out


# -------------------------------------------------------------------------------- the figures
@dataclasses.dataclass
class Row:
    kind: str                      # "decode" | "prefill" | "engine" | "component"
    label: str
    times: list                    # seconds per call (per round)
    bytes: float = 0.0
    flops: float = 0.0
    note: str = ""
    batch: int | None = None
    context: int | None = None
    suffix: str = ""               # decode: ", N steps per call"

    @property
    def t(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")

    def bound(self, hw: Hardware) -> tuple[float, str]:
        t_mem, t_flop = self.bytes / hw.bandwidth, self.flops / hw.peak
        return (t_mem, "HBM bound" if hw.device.startswith(("gpu", "tpu")) else "memory bound") if t_mem >= t_flop \
            else (t_flop, "peak FLOPs")

    def fraction(self, hw: Hardware) -> float:
        return self.bound(hw)[0] / self.t


def _ms(ts) -> str:
    med = statistics.median(ts) * 1e3
    return f"{med:.3g} ({min(ts) * 1e3:.3g}-{max(ts) * 1e3:.3g})"


def _kv_bytes(cfg, rows, context, dtype, pool_factor=1) -> int:
    nb = -(-(context + 1) // BLOCK)
    return (pool_factor * rows * nb + 1) * BLOCK * cfg.n_layers * 2 * cfg.kv_dim * jnp.dtype(dtype).itemsize


def resident_bytes(runner) -> int:
    """The model's weights on the device (every array of its state; a flax that keeps its
    Variables as leaves: their values)."""
    return sum(int(getattr(getattr(x, "value", x), "nbytes", 0)) for x in jax.tree.leaves(runner.state))


def decode_need(runner, rows: int, context: int, dtype, pool_factor: int = 1, steps: int = 1,
                resident: int | None = None) -> dict:
    """What a decode case holds on the device at once: the weights, its KV pool (`decode_inputs`'s
    size), its logits (float32, with the sampler's copy) and `HEADROOM`; bytes, and 'total'."""
    need = {"weights": resident_bytes(runner) if resident is None else resident,
            "KV pool": _kv_bytes(runner.cfg, rows, context + steps - 1, dtype, pool_factor),
            "logits": 2 * rows * steps * runner.cfg.vocab_size * 4, "headroom": HEADROOM}
    need["total"] = sum(need.values())
    return need


def over_memory(need: dict, limit: int | None) -> str | None:
    """None when `need` (decode_need) fits `limit` bytes (None: no limit known), else why not."""
    if limit is None or need["total"] <= limit:
        return None
    parts = " + ".join(f"{k} {v / GiB:.1f}" for k, v in need.items() if k != "total")
    return f"needs ~{need['total'] / GiB:.1f} GiB ({parts}) > the device's {limit / GiB:.1f} GiB"


def decode_rows(runner, shape, dtype, specs, args, log, deadline: float | None = None) -> tuple[list[Row], list[str]]:
    """Decode figures for specs [(B, context, steps per call)] (steps 0: one paged_step per call, N:
    paged_decode_steps with N steps per call). A case whose first call fails (e.g. a kernel that
    does not compile here) is reported and left out; so is one whose pool exceeds --max-kv-gb or
    that would not fit the device's memory (`args.memory_limit`, bytes; None: not checked)."""
    cases, meta, skipped = {}, {}, []
    nbytes = jnp.dtype(dtype).itemsize
    resident = resident_bytes(runner)
    for B, ctx, multi in specs:
        need = decode_need(runner, B, ctx, dtype, steps=max(multi, 1), resident=resident)
        name = f"decode B={B} context {ctx}" + (f", {multi} steps per call" if multi else "")
        if need["KV pool"] > args.max_kv_gb * 1e9:
            skipped.append(f"{name}: KV pool {need['KV pool'] / 1e9:.1f} GB > --max-kv-gb {args.max_kv_gb}")
            continue
        why = over_memory(need, getattr(args, "memory_limit", None))
        if why:
            skipped.append(f"{name}: {why}")
            continue
        cases[name] = DecodeLoop(runner, B, ctx, dtype, multi=multi)
        meta[name] = (B, ctx, multi, cm.decode_cost(shape, B, ctx, nbytes))
    log(f"# decode: {len(cases)} cases")
    times = time_round_robin(cases, args.rounds, args.round_s, log, deadline=deadline, failed=skipped)
    return [Row("decode", k, times[k], m[3]["bytes"], m[3]["flops"], batch=m[0], context=m[1],
                suffix=f", {m[2]} steps per call" if m[2] else "")
            for k, m in meta.items() if times.get(k)], skipped


def decode_specs(batches, contexts, multi: int = 0) -> list[tuple[int, int, int]]:
    return [(B, c, m) for c in contexts for B in batches for m in ((0, multi) if multi else (0,))]


def _prefill_case(runner, T, rows, dtype, adapters: int):
    from preft_jax.adapters.bank import empty_bank
    from preft_jax.paged_kv import PagedBatch, PagedKVCache
    from preft_jax.paged_step import paged_step
    cfg = runner.cfg
    C = T // rows
    nb = -(-C // BLOCK)
    bank = ids = None
    if adapters:
        bank = empty_bank(cfg, adapters + 1, LORA_TARGETS, 16, dtype=dtype)
        bank = jax.tree.map(lambda x: x + jnp.asarray(0.01, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                            else x, bank)
        ids = jnp.asarray(1 + np.arange(rows) % adapters, jnp.int32)
    bt = (1 + np.arange(rows * nb, dtype=np.int32)).reshape(rows, nb)
    pos = np.arange(C)
    widx = (bt[:, pos // BLOCK] * BLOCK + pos % BLOCK).astype(np.int32)
    # no cached context: the table the chunk attends through is one block wide, as the engine's first
    # chunk's (its width follows the context, not the chunk; the writes go through write_index)
    batch = PagedBatch(jnp.asarray(bt[:, :1]), jnp.zeros((rows,), jnp.int32), jnp.full((rows,), C, jnp.int32),
                       jnp.asarray(widx), "gather")
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (rows, C)), jnp.int32)
    temp, top_p, top_k, key = greedy_rows(rows)
    plen = jnp.full((rows,), C, jnp.int32)

    def make():
        return PagedKVCache.create(cfg, rows * nb + 1, BLOCK, dtype)

    def fn(cache):
        _, cache = paged_step(runner.graphdef, runner.state, tokens, batch, cache, bank, ids, plen, temp, top_p,
                              top_k, key)
        return cache
    return Calls(make, fn)


def prefill_rows(runner, shape, dtype, sizes, args, log, deadline: float | None = None,
                 failed: list | None = None) -> list[Row]:
    cases, meta = {}, {}
    nbytes = jnp.dtype(dtype).itemsize
    for T in sizes:
        rows = min(args.prefill_rows, T)
        for adapters in ((0, args.adapters) if args.adapters else (0,)):
            label = f"prefill {T} tokens ({rows} x {T // rows})" + (f" PreFT-LoRA N={adapters}" if adapters else " base")
            cases[label] = _prefill_case(runner, T, rows, dtype, adapters)
            targets = LORA_TARGETS if adapters else ()
            meta[label] = cm.prefill_cost(shape, rows, T // rows, 0, nbytes, targets, 16, min(adapters, rows))
    log(f"# prefill: {len(cases)} cases")
    times = time_round_robin(cases, args.rounds, args.round_s, log, max_iters=50, deadline=deadline, failed=failed)
    return [Row("prefill", k, times[k], m["bytes"], m["flops"]) for k, m in meta.items() if times.get(k)]


def engine_row(runner, shape, dtype, args, log) -> Row:
    """Engine.generate end to end; its bound = prefill FLOPs / peak + per-step decode bytes / bandwidth."""
    from preft_jax.sampling import SamplingParams
    from serve.engine import Engine, EngineConfig
    from serve.registry import AdapterRegistry
    R, P, G = args.engine_requests, args.engine_prompt, args.engine_tokens
    eng = Engine(runner, AdapterRegistry(runner.cfg, 0), EngineConfig(
        max_num_seqs=R, max_model_len=P + G, max_prefill_seqs=min(R, 16),
        max_num_batched_tokens=R + min(R, 16) * P, enable_prefix_cache=False))
    sp = SamplingParams(max_new_tokens=G, stop_token_ids=(-1,))

    def run(seed):
        prompts = [np.random.default_rng(seed * 1000 + i).integers(0, runner.cfg.vocab_size, P).tolist()
                   for i in range(R)]
        t0 = time.perf_counter()
        res = eng.generate([(p, None, sp) for p in prompts])
        dt = time.perf_counter() - t0
        assert all(len(r.tokens) == G for r in res)
        return dt
    t0 = time.perf_counter()
    run(0)                                                    # untimed: compiles every shape it uses
    log(f"  warm engine: {time.perf_counter() - t0:.1f} s")
    times = [run(1 + r) for r in range(args.rounds)]
    nbytes = jnp.dtype(dtype).itemsize
    pre = cm.prefill_cost(shape, R, P, 0, nbytes)
    dec = [cm.decode_cost(shape, R, P + i, nbytes) for i in range(G - 1)]
    row = Row("engine", f"engine {R} requests x {P} -> {G} tokens", times,
              bytes=sum(d["bytes"] for d in dec), flops=pre["flops"] + sum(d["flops"] for d in dec), batch=R,
              context=P)
    row.note = (f"{R * G / row.t:.1f} tok/s; decode attention {eng.step_runner.decode_attention}"
                + (", native CPU decode" if eng.step_runner.native is not None else ""))
    row.prefill_flops = pre["flops"]
    return row


def engine_bound(row: Row, hw: Hardware) -> float:
    """Prefill at peak FLOPs plus every decode step at max(bytes / bandwidth, FLOPs / peak) summed as
    one: a lower bound on the workload's time."""
    pre = getattr(row, "prefill_flops", 0.0)
    return pre / hw.peak + max(row.bytes / hw.bandwidth, (row.flops - pre) / hw.peak)


# ------------------------------------------------------------------------------- components
def components_over_memory(runner, case, dtype, limit: int | None) -> str | None:
    """Why the components and the trace of decode `case` (B, context) cannot run in `limit` bytes
    (its step's `decode_need`), or None when they can."""
    why = over_memory(decode_need(runner, *case, dtype), limit)
    return why and f"components and trace of decode B={case[0]} context {case[1]}: {why}"


def pool_factor(runner, rows: int, context: int, dtype, limit: int | None, factors=(4, 3, 2)) -> int | None:
    """The largest of `factors` whose decode case (pool that many times the live context's) fits
    `limit` bytes of device memory (None: no limit, the first); None when none does."""
    resident = resident_bytes(runner)
    return next((f for f in factors
                 if over_memory(decode_need(runner, rows, context, dtype, f, resident=resident), limit) is None), None)


def kv_writes(attention: str):
    """(label, jitted fn(cache, new [L, R, 1, KV, hd], write_index [R, 1]) -> cache, the pool donated):
    a decode step's KV writes alone, as the step with `attention` makes them: the gather path one
    scatter after the layer scan (`paged_kv.write_kv`), the kernel path each layer's K and V into
    the carried pool inside the layer scan (`paged_kv.write_token_layer`)."""
    from preft_jax.paged_kv import PagedKVCache, write_kv, write_token_layer
    if not attention.startswith("kernel"):
        return "KV writes (write_kv alone)", jax.jit(lambda c, new, w: write_kv(c, new, new, w), donate_argnums=(0,))

    def layer_writes(cache, new, widx):
        def body(pools, layer):
            k, v = pools
            return (write_token_layer(k, layer, new[layer], widx), write_token_layer(v, layer, new[layer], widx)), None
        (k, v), _ = jax.lax.scan(body, (cache.k, cache.v), jnp.arange(new.shape[0]))
        return PagedKVCache(k, v)
    return "KV writes (write_token_layer per layer, in a layer scan)", jax.jit(layer_writes, donate_argnums=(0,))


def component_rows(runner, shape, dtype, case, args, log, deadline: float | None = None) -> list[Row]:
    """Per-component times of one decode case by ablation (see the module docstring). The pool-size
    case takes the largest pool (4x, 3x, 2x the live context's) that fits the device's memory
    (`args.memory_limit`), and is left out when none does."""
    from preft_jax.paged_step import paged_logits
    from flax import nnx
    B, ctx = case
    cfg = runner.cfg
    factor = pool_factor(runner, B, ctx, dtype, getattr(args, "memory_limit", None))
    larger = f"step, pool {factor}x larger"
    model = nnx.merge(runner.graphdef, runner.state)
    n_multi = args.multi_steps

    def logits_case():
        tokens, batch = decode_batch(cfg, B, ctx)

        def make():
            return decode_inputs(cfg, B, ctx, dtype)[2]

        def fn(cache):
            _, cache = paged_logits(runner.graphdef, runner.state, tokens, batch, cache)
            return cache
        return Calls(make, fn)

    head = jax.jit(lambda h: model.logits(h))
    h0 = jax.random.normal(jax.random.key(3), (B, cfg.d_model), dtype)

    def head_case():
        return Calls(lambda: h0, lambda h: head(h)[:, :cfg.d_model].astype(dtype))

    L, KV, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    _, write_batch = decode_batch(cfg, B, ctx)                  # no pool held here: each case makes its own
    write_label, kv_write = kv_writes(write_batch.attention)

    def write_case():
        new = jnp.ones((L, B, 1, KV, hd), dtype)

        def make():
            return decode_inputs(cfg, B, ctx, dtype)[2]
        return Calls(make, lambda c: kv_write(c, new, write_batch.write_index))

    cases = {
        "step": DecodeLoop(runner, B, ctx, dtype),
        "step, context 0": DecodeLoop(runner, B, 0, dtype),
        "forward + LM head (no sampler)": logits_case(),
        "LM head alone": head_case(),
        "KV writes alone": write_case(),
        f"{n_multi} steps in one call (paged_decode_steps)": DecodeLoop(runner, B, ctx, dtype, multi=n_multi),
        "step, host reads each step's tokens": DecodeLoop(runner, B, ctx, dtype, sync=True),
    }
    if factor:
        cases[larger] = DecodeLoop(runner, B, ctx, dtype, pool_factor=factor)
    else:
        log("  no pool-size case: a pool 2x the live context's does not fit the device's memory")
    log(f"# components of decode B={B} context {ctx}: {len(cases)} cases")
    failed = []
    times = time_round_robin(cases, args.rounds, args.round_s, log, deadline=deadline, failed=failed)
    lost = [f for f in failed if not f.startswith(f"{larger}:")]
    if lost:                                  # the ablation needs every other case
        late = all(f.endswith(DEADLINE_SKIP) for f in lost)
        raise (DeadlineSkipped if late else RuntimeError)(f"decode components: {lost[0]}")
    # the larger pool alone may not run (out of memory: a step that copies the pool): an outcome
    # this row reports, not a failure of the run
    pool_note = (f"did not run: {failed[0].split(': FAIL ', 1)[-1]}" if failed else
                 "~0 when the step moves the live context's bytes, not the pool's")

    def diff(a, *bs):
        """Per-round paired difference a - sum(bs) (the variants of one round ran back to back)."""
        return [x - sum(y) for x, *y in zip(times[a], *(times[b] for b in bs))]
    multi = f"{n_multi} steps in one call (paged_decode_steps)"
    nbytes = jnp.dtype(dtype).itemsize
    d = cm.decode_cost(shape, B, ctx, nbytes)
    d0 = cm.decode_cost(shape, B, 0, nbytes)
    head_bytes = shape.d * shape.vocab * nbytes
    sampler = diff("step", "forward + LM head (no sampler)")
    return [
        Row("component", "whole step", times["step"], d["bytes"], d["flops"]),
        Row("component", "sampler (step - forward + LM head)", sampler, note="argmax / sampling on the logits"),
        Row("component", "LM head (alone)", times["LM head alone"], head_bytes, 2 * head_bytes / nbytes * B),
        Row("component", "attention over the context (step - step at context 0)", diff("step", "step, context 0"),
            d["kv_read"] - d0["kv_read"], d["flops"] - d0["flops"]),
        Row("component", write_label, times["KV writes alone"], 2 * d["kv_write"]),
        Row("component", "layer stack at context 0 (projections, MLP, norms: step at context 0 - LM head - sampler)",
            [c0 - h - max(0.0, sm) for c0, h, sm in zip(times["step, context 0"], times["LM head alone"], sampler)],
            d0["weights"] - head_bytes, d0["flops"] - 2 * head_bytes / nbytes * B),
        Row("component", f"host time between device calls (step - {n_multi} steps in one call, per step)",
            diff("step", multi), note="dispatch and Python per call, not overlapped with the device"),
        Row("component", "host round trip (step reading its tokens - step)",
            diff("step, host reads each step's tokens", "step")),
    ] + ([] if not factor else
         [Row("component", f"pool {factor}x larger (same live context) - step",
              [float("nan")] if failed else diff(larger, "step"), note=pool_note)])


def trace_ops(runner, dtype, case, steps: int = 5, top: int = 12) -> list[str]:
    """jax.profiler trace of `steps` decode calls: the ops by time per step (device ops where the
    trace has a device, else host threads)."""
    from benchmarks.step_profile import op_table
    loop = DecodeLoop(runner, case[0], case[1], dtype)
    loop.setup()
    loop(2)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            loop(steps)
        files = glob.glob(f"{d}/**/*perfetto_trace.json.gz", recursive=True)
        if not files:
            return ["(jax.profiler wrote no perfetto trace)"]
        data = json.load(gzip.open(files[0]))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    dev = {p for p, n in names.items() if any(k in n for k in ("GPU", "TPU", "/device:"))}
    if dev:
        events = [e for e in events if e.get("pid") in dev]
    table = op_table(events, steps)
    out = [f"| op ({'device' if dev else 'host threads'}; decode B={case[0]} context {case[1]}) | ms per step "
           "| calls per step |", "|---|---:|---:|"]
    out += [f"| {k[:80]} | {ms:.3f} | {n:g} |" for k, (ms, n) in list(table.items())[:top]]
    return out


# ------------------------------------------------------------------------------ cost analysis
def cost_analysis_check(model: str, dtype, rows: int, context: int) -> tuple[dict, dict]:
    """(XLA cost_analysis of the decode step compiled for a 1-layer model of the same shape, the
    analytic count for that 1-layer model). Compiled from shapes only (nothing allocated)."""
    from flax import nnx

    from preft_jax.model import Llama
    from preft_jax.paged_kv import PagedBatch, PagedKVCache, choose_attention
    from preft_jax.paged_step import paged_step
    cfg = dataclasses.replace(cm.MODEL_CONFIGS[model], n_layers=1)
    model_ = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype, chunk_attention="xla"))
    graphdef, state = nnx.split(model_)
    nb = -(-(context + 1) // BLOCK)
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pool = sds((1, cfg.n_kv_heads, rows * nb + 1, BLOCK, cfg.head_dim), dtype)
    batch = PagedBatch(sds((rows, nb), i32), sds((rows,), i32), sds((rows,), i32), sds((rows, 1), i32),
                       choose_attention(cfg, BLOCK))
    f32 = sds((rows,), jnp.float32)
    compiled = paged_step.trace(graphdef, state, sds((rows, 1), i32), batch, PagedKVCache(pool, pool), None, None,
                                sds((rows,), i32), f32, f32, sds((rows,), i32), jax.random.key(0)).lower().compile()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    s1 = cm.Shape.from_config("1-layer", cfg)
    return ({"bytes": float(ca.get("bytes accessed", float("nan"))), "flops": float(ca.get("flops", float("nan")))},
            cm.decode_cost(s1, rows, context, jnp.dtype(dtype).itemsize))


# ---------------------------------------------------------------------------------- report
def fraction_line(model: str, dtype_name: str, row: Row, hw: Hardware) -> str:
    """One line per figure: model, B=, context, time, 'NN% of HBM bound'."""
    bound, kind = row.bound(hw)
    figure = f"decode B={row.batch} context {row.context}{row.suffix}" if row.kind == "decode" else row.label
    return (f"{cm.MODEL_NAMES.get(model, model)} {dtype_name} {figure}: {row.t * 1e3:.3g} ms "
            f"(bound {bound * 1e3:.3g} ms): {100 * bound / row.t:.0f}% of {kind}")


def table(rows: list[Row], hw: Hardware) -> list[str]:
    out = ["| figure | measured ms: median (min-max) | bytes (analytic) | FLOPs (analytic) | bound ms | fraction |",
           "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.kind == "engine":
            b = engine_bound(r, hw)
            out.append(f"| {r.label} ({r.note}) | {_ms(r.times)} | {r.bytes / 1e9:.3g} GB (decode) | "
                       f"{r.flops / 1e9:.3g} G | {b * 1e3:.3g} | {100 * b / r.t:.0f}% of the roofline |")
            continue
        bound, what = r.bound(hw)
        out.append(f"| {r.label} | {_ms(r.times)} | {r.bytes / 1e6:.4g} MB | {r.flops / 1e9:.4g} G | "
                   f"{bound * 1e3:.3g} | {100 * bound / r.t:.0f}% of {what} |")
    return out


def component_table(rows: list[Row], hw: Hardware) -> list[str]:
    step = rows[0].t
    out = ["| component | ms per step | share of the step | its own bound ms | note |", "|---|---:|---:|---:|---|"]
    for r in rows:
        b = max(r.bytes / hw.bandwidth, r.flops / hw.peak) if (r.bytes or r.flops) else None
        out.append(f"| {r.label} | {r.t * 1e3:.3g} | {100 * r.t / step:.0f}% | "
                   f"{'' if b is None else f'{b * 1e3:.3g}'} | {r.note} |")
    return out


def run(args, log=print) -> dict:
    """Every figure asked for by `args` (see `parser`): {'hardware', 'rows', 'components', 'lines', ...}."""
    dtype = DTYPES[args.dtype]
    dtype_name = "bf16" if dtype == jnp.bfloat16 else "f32"
    hw = hardware(dtype, args.bandwidth and args.bandwidth * 1e9, args.peak and args.peak * 1e12,
                  measure=not args.no_measure)
    args.memory_limit = int(args.device_memory_gib * GiB) if args.device_memory_gib else hw.memory
    log(f"# {hw.line()}")
    t0 = time.perf_counter()
    runner, shape = build(args.model, dtype)
    log(f"# {args.model} ({shape.params() / 1e6:.1f} M parameters, {dtype_name}, random weights) built in "
        f"{time.perf_counter() - t0:.1f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    res = {"hardware": hw, "rows": [], "components": [], "skipped": [], "trace": [], "cost_check": None}
    if args.batches and args.contexts:
        rows, skipped = decode_rows(runner, shape, dtype, decode_specs(args.batches, args.contexts, args.decode_multi),
                                    args, log)
        res["rows"] += rows
        res["skipped"] += skipped
    if args.prefill:
        res["rows"] += prefill_rows(runner, shape, dtype, args.prefill, args, log)
    if args.engine:
        res["rows"].append(engine_row(runner, shape, dtype, args, log))
    why = components_over_memory(runner, args.component_case, dtype, args.memory_limit)
    if why and (args.components or args.trace):
        res["skipped"].append(why)
    else:
        if args.components:
            res["components"] = component_rows(runner, shape, dtype, args.component_case, args, log)
        if args.trace:
            res["trace"] = trace_ops(runner, dtype, args.component_case)
    if args.cost_check:
        B, ctx = args.component_case
        res["cost_check"] = cost_analysis_check(args.model, dtype, B, ctx) + ((B, ctx),)
    res["lines"] = [fraction_line(args.model, dtype_name, r, hw) for r in res["rows"] if r.kind != "engine"]
    return res


def report(args, res: dict) -> list[str]:
    hw = res["hardware"]
    out = [f"- {hw.line()}", ""] + table(res["rows"], hw)
    if res["skipped"]:
        out += ["", "Skipped: " + "; ".join(res["skipped"])]
    if res["components"]:
        B, ctx = args.component_case
        out += ["", f"Components of the decode step at B={B}, context {ctx} (by ablation on the real step; a "
                "difference is the median over rounds of the paired per-round differences, so a small "
                "component can read slightly negative):", ""]
        out += component_table(res["components"], hw)
    if res["cost_check"]:
        xla, ana, (B, ctx) = res["cost_check"]
        out += ["", f"Cross-check, decode B={B} context {ctx} compiled for a 1-layer model: XLA cost_analysis "
                f"{xla['bytes'] / 1e6:.4g} MB, {xla['flops'] / 1e6:.4g} MFLOP; analytic {ana['bytes'] / 1e6:.4g} MB, "
                f"{ana['flops'] / 1e6:.4g} MFLOP (ratio {xla['bytes'] / ana['bytes']:.2f}x bytes, "
                f"{xla['flops'] / ana['flops']:.2f}x FLOPs). The bounds above use the analytic count."]
    if res["trace"]:
        out += [""] + res["trace"]
    out += ["", *[f"    {line}" for line in res["lines"]]]
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()] if s else []


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2-135m", choices=list(cm.MODEL_CONFIGS))
    ap.add_argument("--dtype", default=None, choices=("f32", "bf16"), help="default: f32 on CPU, bf16 elsewhere")
    ap.add_argument("--batches", type=_ints, default=[1, 16, 64, 256])
    ap.add_argument("--contexts", type=_ints, default=[128, 2048])
    ap.add_argument("--decode-multi", type=int, default=0, help="also time each decode case as N steps per "
                    "call (paged_decode_steps: no host sync between them); 0: off")
    ap.add_argument("--prefill", type=_ints, default=[512, 2048], help="prefill chunk sizes in tokens")
    ap.add_argument("--prefill-rows", type=int, default=16,
                    help="rows of a prefill chunk, each on another adapter (an engine's prefill of 16 sequences)")
    ap.add_argument("--adapters", type=int, default=64, help="PreFT-LoRA prefill: adapters in the bank")
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--engine-requests", type=int, default=64)
    ap.add_argument("--engine-prompt", type=int, default=128)
    ap.add_argument("--engine-tokens", type=int, default=32)
    ap.add_argument("--components", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--component-case", type=_ints, default=None, help="B,context (default: 64 and the largest "
                    "context that fits, else the largest batch)")
    ap.add_argument("--multi-steps", type=int, default=8, help="steps per paged_decode_steps call (components)")
    ap.add_argument("--trace", action="store_true", help="profile one decode call of the component case")
    ap.add_argument("--cost-check", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s for the bound (default: stated / measured)")
    ap.add_argument("--peak", type=float, default=None, help="TFLOP/s for the bound (default: stated / measured)")
    ap.add_argument("--no-measure", action="store_true", help="skip the stream-copy / matmul measurement")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-s", type=float, default=0.5, help="seconds of calls per variant per round")
    ap.add_argument("--device-memory-gib", type=float, default=None, help="plan the decode cases against this many "
                    "GiB of device memory (default: what jax reports for the device; none on CPU)")
    ap.add_argument("--max-kv-gb", type=float, default=None, help="skip decode cases whose KV pool is larger "
                    "(default 1.5 on CPU, 80 elsewhere)")
    return ap


def finish_args(args):
    cpu = jax.default_backend() == "cpu"
    if args.dtype is None:
        args.dtype = "f32" if cpu else "bf16"
    if args.max_kv_gb is None:
        args.max_kv_gb = 1.5 if cpu else 80.0
    if args.component_case is None:
        cfg = cm.MODEL_CONFIGS[args.model]
        dt = DTYPES[args.dtype]
        fits = [(B, c) for c in sorted(args.contexts or [128], reverse=True) for B in sorted(args.batches or [1],
                                                                                            reverse=True)
                if _kv_bytes(cfg, B, c, dt) <= args.max_kv_gb * 1e9]
        pref = [bc for bc in fits if bc[0] == 64]
        args.component_case = (pref or fits or [(1, 128)])[0]
    args.component_case = tuple(args.component_case)
    return args


def run_cli(module: str, parse: Callable, finish: Callable, run_fn: Callable, report_fn: Callable, argv=None) -> int:
    """A benchmark's main: parse and finish its args, echo the command, run (progress to stdout), print the report."""
    args = finish(parse().parse_args(argv))
    print(f"# python -m {module} {' '.join(sys.argv[1:] if argv is None else argv)}", flush=True)
    res = run_fn(args, lambda s: print(s, flush=True))
    print("\n".join(report_fn(args, res)))
    return 0


def main(argv=None) -> int:
    return run_cli("benchmarks.roofline", parser, finish_args, run, report, argv)


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
