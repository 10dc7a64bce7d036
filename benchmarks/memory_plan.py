"""Memory plans by compilation: per-device bytes of the real serving / training steps of 8B-70B models.

    python -m benchmarks.memory_plan --model llama-3.1-8b --mesh tensor=1 --task serve --adapters 512 \\
        --kv-tokens 65536 --device-memory 80GiB
    python -m benchmarks.memory_plan --model llama-3.1-70b --mesh fsdp=8 --task sft --seq 2048 --batch 8
    python -m benchmarks.memory_plan --model llama-3.1-70b --task serve --search tensor --device-memory 80GiB
    (--json FILE writes the plan; see docs/memory.md for the table and what the numbers mean)

Nothing is allocated: the model, KV pool, adapter bank, train state and batches are
`jax.ShapeDtypeStruct`s carrying their mesh shardings (from preft_jax.sharding's rules), and the
very jitted functions the engine and trainers run are lowered and compiled for a mesh of fake CPU
devices (`jax_num_cpu_devices`, set before jax starts). XLA's `memory_analysis()` of each compiled
program gives its per-device argument, output, alias (donated inputs reused as outputs) and
temporary bytes; a program's peak is argument + output - alias + temp, plus what stays resident
without being its argument (the adapter bank during a base-weights decode, the train state during
GRPO rollouts). A plan is the max over the programs a task runs:

  serve  `preft_jax.paged_step.sharded_paged_step` (the engine's step, KV pool donated): the decode
         call (max_num_seqs rows x 1 token, block tables of max_model_len; the bank only in mode
         "all") and the widest prefill call (max_prefill_seqs rows x max_num_batched_tokens, with the
         bank of --adapters slots + the base slot).
  sft    `Trainer.step_function` of `train.sft.SFTTrainer`: loss, gradient, AdamW, the train state
         donated.
  grpo   `train.grpo.GRPOTrainer`: the rollout prefill (`prefill_step`, 2-slot bank) and decode
         (`decode_step`, base weights) on a KV cache of prompts_per_step x group_size rows, the
         reference scoring (`score_function`) and the update (`step_function`).

bfloat16 plans compile as float16, which has the same bytes: XLA:CPU has no bfloat16 scatter or
dot, so it widens a bf16 scatter's whole operand (the donated KV pool: two pool-sized float32
temporaries per step) and every bf16 dot operand to float32, and hoists the widening of the
stacked weights out of the layer scan (+2x the weights) - CPU-only artifacts that GPU/TPU do not
have. float16 scatters in place; its dots still widen each weight operand to float32 inside the
layer, so the plan's temporaries stay above a GPU's by about one layer's projection weights and the
LM head in float32 (for 8B: ~0.9 + 2 GiB). The attention is the "gather" path (the GPU/TPU decode
kernels cannot be compiled for CPU devices) and adapters use the `--backend` (default jnp) layout.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import sys
import time
import unittest.mock

GiB = 1 << 30
TASKS = ("serve", "sft", "grpo")


def parse_bytes(text: str) -> int:
    """'80GiB' / '80GB' / '24g' / '1.5TiB' / '123' -> bytes (GB = 1e9, GiB and a bare G = 2**30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*", str(text), re.IGNORECASE)
    if not m or not m.group(1):
        raise ValueError(f"not a byte size: {text!r} (e.g. 80GiB, 24GB, 1.5TiB)")
    value, unit, i, b = m.groups()
    power = "KMGT".find(unit.upper()) + 1 if unit else 0
    base = 1000 if (unit and b and not i) else 1024
    return int(float(value) * base ** power)


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """What to plan. Serving fields follow serve.engine.EngineConfig, training fields the trainers."""
    model: str = "llama-3.1-8b"           # a preft_jax.config.MODEL_PRESETS name
    task: str = "serve"
    mesh: tuple[int, int, int] = (1, 1, 1)   # (data, fsdp, tensor)
    dtype: str = "bfloat16"               # the base weights' (and KV pool's, bank's) dtype
    backend: str = "jnp"                  # adapter backend (preft_jax.adapters.context)
    quantize: str | None = None           # base weight quantization: "int8" | "int4" (preft_jax.quantize)
    # serving
    adapters: int = 16                    # device adapter slots (the bank holds adapters + 1 with the base)
    lora_rank: int = 16
    kv_tokens: int = 65536
    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    max_prefill_seqs: int = 4
    mode: str = "prefill"                 # "prefill" (PreFT: decode on base weights) | "all"
    # training
    rank: int = 16                        # trained LoRA rank (all 7 projections)
    seq: int = 2048
    batch: int = 8                        # global batch (SFT) / sequences per update (GRPO)
    remat: bool | str = True              # TrainerConfig.remat (a preft_jax.config.REMAT_POLICIES name too)
    logit_chunk: int = 64
    group_size: int = 8                   # GRPO: batch = prompts_per_step * group_size
    max_new_tokens: int = 512             # GRPO rollouts (prompt length = seq - max_new_tokens)

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.task == "grpo" and (self.batch % self.group_size or self.max_new_tokens >= self.seq):
            raise ValueError(f"grpo: batch ({self.batch}) must be a multiple of group_size ({self.group_size}) "
                             f"and max_new_tokens ({self.max_new_tokens}) < seq ({self.seq})")

    @property
    def devices(self) -> int:
        return math.prod(self.mesh)

    def mesh_text(self) -> str:
        return ",".join(f"{a}={n}" for a, n in zip(("data", "fsdp", "tensor"), self.mesh) if n > 1) or "1 device"


@dataclasses.dataclass
class Program:
    """One compiled program's per-device bytes (XLA memory_analysis) and what it holds resident."""
    name: str
    argument: int
    output: int
    alias: int
    temp: int
    resident: int = 0                     # resident bytes that are not arguments of this program
    compile_s: float = 0.0
    gathered: int = 0                     # the largest array an all-gather makes (FSDP: one layer's weight)
    compiled: object = dataclasses.field(default=None, repr=False)   # the executable and its abstract
    args: tuple = dataclasses.field(default=(), repr=False)          # (non-static) arguments: `measure`

    @property
    def peak(self) -> int:
        return self.argument + self.output - self.alias + self.temp + self.resident


@dataclasses.dataclass
class Plan:
    spec: PlanSpec
    parts: dict                           # persistent per-device bytes by role
    programs: list

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)

    @property
    def peak_program(self) -> Program:
        return max(self.programs, key=lambda p: p.peak)

    def fits(self, device_memory: int) -> bool:
        return self.peak <= device_memory

    def to_json(self) -> dict:
        programs = [{f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name not in ("compiled", "args")}
                    for p in self.programs]
        return {"spec": dataclasses.asdict(self.spec), "parts": self.parts, "peak": self.peak,
                "programs": [dict(d, peak=q.peak) for d, q in zip(programs, self.programs)]}


# ------------------------------------------------------------------------------------------ shapes
def shard_bytes(tree) -> int:
    """Per-device bytes of a tree of ShapeDtypeStructs with shardings (the largest shard of each)."""
    import jax
    import numpy as np
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += -(-int(np.prod(shape, dtype=np.int64)) * dtype_bits(x.dtype) // 8)
    return total


def dtype_bits(dtype) -> int:
    """Bits per element (int4 / uint4: 4, as XLA packs them; numpy's itemsize says 1 byte)."""
    import jax.numpy as jnp
    import numpy as np
    dt = np.dtype(dtype)
    return jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) else dt.itemsize * 8


def attach(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays or structs) with `shardings` attached."""
    import jax
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def compile_dtype(spec: PlanSpec):
    """The dtype the plan compiles the model in: float16 stands in for bfloat16 (same bytes; see above)."""
    import jax.numpy as jnp
    return jnp.dtype(jnp.float16 if spec.dtype == "bfloat16" else jnp.float32)


@contextlib.contextmanager
def _stand_in(spec: PlanSpec):
    """While tracing: the adapter layer accepts the float16 stand-in (its dtype check is for real runs)."""
    from preft_jax.adapters import context
    with unittest.mock.patch.object(context, "DTYPES", context.DTYPES + (compile_dtype(spec),)):
        yield


def abstract_model(cfg, spec: PlanSpec):
    """The base model (an nnx Module of ShapeDtypeStructs: nothing allocated) in `compile_dtype`. The one
    place where the plan's base weights are built: a quantized base (issue 27 item 3) plugs in here
    through `spec.quantize`."""
    import jax
    from flax import nnx
    from preft_jax.model import Llama
    # compiled for CPU devices: the XLA reference attention (a GPU's flash kernel keeps no [T, T] scores: less)
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=spec.dtype, adapter_backend=spec.backend,
                                         chunk_attention="xla"))
    dt = compile_dtype(spec)
    if dt != model.dtype:
        graphdef, state = nnx.split(model)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dt), state)
        model = nnx.merge(graphdef, state)
        model.dtype = dt
    if spec.quantize is not None:
        quantize_abstract(model, cfg, spec.quantize, dt)
    return model


def quantize_abstract(model, cfg, mode: str, dtype) -> None:
    """Replaces `model`'s abstract base weights by the abstract qwix QArrays that
    `preft_jax.quantize.quantize_params` makes of them (same function, traced by `jax.eval_shape`:
    int8/int4 values, scales in `dtype`), so the plan's weight bytes are the quantized model's."""
    import jax
    from preft_jax import quantize as quant
    holders = {name: model.layers for name in quant.PROJECTIONS} | {"embed": model, "lm_head": model}
    params = {name: getattr(h, name).get_value() for name, h in holders.items() if hasattr(h, name)}
    qparams = jax.eval_shape(lambda p: quant.quantize_params(cfg, p, mode, dtype), params)
    for name, value in qparams.items():
        getattr(holders[name], name).set_value(value)


def _compile(name, fn, args, kwargs, spec: PlanSpec, mesh, resident: int = 0) -> Program:
    import jax
    from flax import nnx
    t0 = time.perf_counter()
    with jax.set_mesh(mesh), _stand_in(spec):
        lowered = fn.trace(*args, **kwargs).lower()
    compiled = lowered.compile()
    m = compiled.memory_analysis()
    dynamic = tuple(a for a in args if not isinstance(a, nnx.GraphDef))       # static: the model's graphdef
    return Program(name, int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                   int(m.temp_size_in_bytes), resident, time.perf_counter() - t0,
                   max(all_gathers(compiled.as_text()), default=0), compiled, dynamic)


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8}


def all_gathers(hlo_text: str) -> list[int]:
    """Bytes of every array an all-gather produces in an optimized HLO module's text (per device)."""
    out = []
    for m in re.finditer(r"= \(?([^=]*?)\)? all-gather(?:-start)?\(", hlo_text):
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            out.append(math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE.get(dt, 4))
    return out


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        text = f.read()
    return tuple(int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))


def measure(program: Program) -> int:
    """Runs a compiled program for real on zero-filled arguments and returns the process's peak RSS
    growth in bytes, from before its arguments exist to the end of the call - the figure a plan's
    `peak` predicts on a CPU (where device memory is host memory). Resets the peak-RSS mark through
    /proc/self/clear_refs (Linux); OSError where that is not allowed."""
    import ctypes
    import gc
    import jax
    import jax.numpy as jnp
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)        # the compiler's freed heap goes back to the OS
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")                                    # VmHWM := VmRSS
    before = _rss()[0]
    args = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), program.args)
    jax.block_until_ready(program.compiled(*args))
    return _rss()[1] - before


# ------------------------------------------------------------------------------------------- serve
def serve_plan(spec: PlanSpec, mesh, cfg) -> Plan:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from preft_jax import sharding as shd
    from preft_jax.adapters.bank import empty_bank
    from preft_jax.adapters.config import LORA_TARGETS
    from flax import nnx
    from preft_jax.paged_kv import PagedBatch, PagedKVCache
    from preft_jax.paged_step import sharded_paged_step
    from serve.engine import EngineConfig

    dt = compile_dtype(spec)
    ec = EngineConfig(max_num_seqs=spec.max_num_seqs, max_model_len=spec.max_model_len,
                      max_num_batched_tokens=spec.max_num_batched_tokens, max_prefill_seqs=spec.max_prefill_seqs,
                      block_size=spec.block_size, kv_cache_tokens=spec.kv_tokens, mode=spec.mode)
    graphdef, state = nnx.split(abstract_model(cfg, spec))
    state = attach(state, shd.model_state_shardings(state, mesh, cfg))
    nb = ec.num_blocks(PagedKVCache.bytes_per_token(cfg, dt))
    cache = jax.eval_shape(lambda: PagedKVCache.create(cfg, nb, ec.block_size, dt))
    cache_sh = shd.cache_shardings(cache, mesh, cfg)
    cache = attach(cache, cache_sh)
    bank = None
    if spec.adapters:
        bank = jax.eval_shape(lambda: empty_bank(cfg, spec.adapters + 1, LORA_TARGETS, spec.lora_rank, 0, dt))
        bank = attach(bank, shd.bank_shardings(bank, mesh, cfg))
    parts = {"weights": shard_bytes(state), "kv_pool": shard_bytes(cache), "adapter_bank": shard_bytes(bank or ())}
    rep = NamedSharding(mesh, P())

    def s(shape, d=jnp.int32):
        return jax.ShapeDtypeStruct(shape, d, sharding=rep)

    step = sharded_paged_step(mesh, cache_sh)
    width = -(-ec.max_model_len // ec.block_size)

    def call(name, rows, chunk, with_bank, return_logits):
        batch = PagedBatch(s((rows, width)), s((rows,)), s((rows,)), s((rows, chunk)), "gather")
        b = bank if with_bank else None
        args = (graphdef, state, s((rows, chunk)), batch, cache, b, s((rows,)) if with_bank else None, s((rows,)),
                s((rows,), jnp.float32), s((rows,), jnp.float32), s((rows,)), (s((rows, 2), jnp.uint32), s((rows,))),
                None, None)
        resident = 0 if with_bank else parts["adapter_bank"]
        return _compile(name, step, args, {"return_logits": return_logits}, spec, mesh, resident)

    programs = [call(f"decode {ec.max_num_seqs}x1", ec.max_num_seqs, 1, bank is not None and ec.mode == "all", False),
                call(f"prefill {ec.max_prefill_seqs}x{ec.max_num_batched_tokens}", ec.max_prefill_seqs,
                     min(ec.max_num_batched_tokens, ec.max_model_len), bank is not None, True)]
    return Plan(spec, parts, programs)


# ---------------------------------------------------------------------------------------- training
def _trainer_config(spec: PlanSpec, kind: str):
    from train.config import AdapterSpec, MeshConfig
    common = dict(adapter=AdapterSpec(kind="lora", rank=spec.rank), mesh=MeshConfig(*spec.mesh),
                  logit_chunk=spec.logit_chunk, remat=spec.remat)
    if kind == "sft":
        from train.sft import SFTConfig
        return SFTConfig(**common, batch_size=spec.batch, seq_len=spec.seq)
    from train.grpo import GRPOConfig
    return GRPOConfig(**common, prompts_per_step=spec.batch // spec.group_size, group_size=spec.group_size,
                      max_new_tokens=spec.max_new_tokens)


def _batch(mesh, shapes: dict):
    import jax
    from preft_jax import sharding as shd
    out = {k: jax.ShapeDtypeStruct(shape, d) for k, (shape, d) in shapes.items()}
    return attach(out, shd.batch_shardings(out, mesh))


def train_parts(trainer) -> dict:
    st = trainer.setup.abstract_state
    return {"weights": shard_bytes(trainer.base_state), "adapter_params": shard_bytes(st.params),
            "optimizer_state": shard_bytes(st.opt_state)}


def sft_plan(spec: PlanSpec, mesh, cfg) -> Plan:
    import jax.numpy as jnp
    from flax import nnx
    from train.sft import SFTTrainer
    graphdef, state = nnx.split(abstract_model(cfg, spec))
    trainer = SFTTrainer(cfg, graphdef, state, _trainer_config(spec, "sft"), mesh)
    B, T = spec.batch, spec.seq
    batch = _batch(mesh, {"tokens": ((B, T), jnp.int32), "prompt_lengths": ((B,), jnp.int32),
                          "loss_mask": ((B, T), jnp.float32)})
    parts = dict(train_parts(trainer), batch=shard_bytes(batch))
    prog = _compile(f"update {B}x{T}", trainer.step_function(batch),
                    (trainer.setup.abstract_state, trainer.base_state, batch), {}, spec, mesh)
    return Plan(spec, parts, [prog])


def grpo_plan(spec: PlanSpec, mesh, cfg) -> Plan:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from preft_jax import sharding as shd
    from preft_jax.adapters.trainable import adapter_bank
    from preft_jax.generation import ModelRunner, bucket_length, decode_step, prefill_step
    from preft_jax.kv_cache import KVCache
    from train.grpo import GRPOTrainer

    dt = compile_dtype(spec)
    trainer = GRPOTrainer(cfg, ModelRunner(abstract_model(cfg, spec)), _trainer_config(spec, "grpo"), lambda c, a: 0.0, mesh=mesh)
    graphdef, state = trainer.graphdef, trainer.base_state
    ts = trainer.setup.abstract_state
    parts = train_parts(trainer)
    B, G = spec.batch, spec.group_size
    Pn, plen = B // G, spec.seq - spec.max_new_tokens
    T = bucket_length(plen)
    cache_len = T + spec.max_new_tokens
    rep = NamedSharding(mesh, P())

    def s(shape, d=jnp.int32):
        return jax.ShapeDtypeStruct(shape, d, sharding=rep)

    def kv(rows):
        c = jax.eval_shape(lambda: KVCache.create(cfg, rows, cache_len, dt))
        return attach(c, shd.cache_shardings(c, mesh, cfg))

    bank = jax.eval_shape(lambda p: adapter_bank(cfg, trainer.adapter_config, p), ts.params)
    bank = attach(bank, shd.bank_shardings(bank, mesh, cfg))
    train_state = shard_bytes(ts)
    programs = [
        _compile(f"rollout prefill {Pn}x{T}", prefill_step,
                 (graphdef, state, s((Pn, T)), s((Pn,)), s((Pn,)), kv(Pn), bank, s((Pn,))), {}, spec, mesh,
                 train_state),
        _compile(f"rollout decode {B}x1 (cache {cache_len})", decode_step,
                 (graphdef, state, s((B,)), s((B,)), kv(B), None, None, s((B,))), {}, spec, mesh,
                 train_state + shard_bytes(bank)),
    ]
    L = spec.seq
    shapes = {"tokens": ((B, L), jnp.int32), "prompt_lengths": ((B,), jnp.int32),
              "loss_mask": ((B, L), jnp.float32), "advantages": ((B,), jnp.float32)}
    batch = _batch(mesh, shapes)
    programs.append(_compile(f"reference scoring {B}x{L}", trainer.score_function(batch, with_old=False),
                             (ts.params, state, batch), {}, spec, mesh, train_state - shard_bytes(ts.params)))
    batch = _batch(mesh, dict(shapes, ref_logp=((B, L), jnp.float32)))
    parts["batch"] = shard_bytes(batch)
    parts["kv_cache"] = shard_bytes(kv(B))
    programs.append(_compile(f"update {B}x{L}", trainer.step_function(batch), (ts, state, batch), {}, spec, mesh))
    return Plan(spec, parts, programs)


PLANNERS = {"serve": serve_plan, "sft": sft_plan, "grpo": grpo_plan}


def plan(spec: PlanSpec, mesh=None, cfg=None) -> Plan:
    """Compiles the task's programs for `spec.mesh` (over the first devices) and returns their bytes.
    `cfg`: a ModelConfig instead of the `spec.model` preset (tests plan small models)."""
    from preft_jax import sharding as shd
    from preft_jax.config import model_preset
    if mesh is None:
        mesh = shd.make_mesh(*spec.mesh)
    return PLANNERS[spec.task](spec, mesh, model_preset(spec.model) if cfg is None else cfg)


def set_fake_devices(n: int) -> None:
    """n CPU devices for the plans (before jax's backend starts; afterwards there must be >= n)."""
    import jax
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:                      # the backend is up already: it must have the devices
        pass
    if len(jax.devices()) < n:
        raise SystemExit(f"the plan needs {n} devices but jax started with {len(jax.devices())}; run it in a "
                         f"fresh process (python -m benchmarks.memory_plan)")


# ------------------------------------------------------------------------------------------ report
def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def describe(spec: PlanSpec) -> str:
    if spec.task == "serve":
        return (f"N={spec.adapters} adapters (LoRA r{spec.lora_rank}, 7 targets), KV pool {spec.kv_tokens} tokens, "
                f"{spec.max_num_seqs} decode rows x {spec.max_model_len} ctx, prefill {spec.max_prefill_seqs}x"
                f"{spec.max_num_batched_tokens}, mode {spec.mode}")
    extra = f", G={spec.group_size}, {spec.max_new_tokens} new tokens" if spec.task == "grpo" else ""
    return (f"LoRA r{spec.rank} (7 targets), batch {spec.batch} x seq {spec.seq}{extra}, "
            f"remat {_remat_text(spec.remat)}")


def _remat_text(remat) -> str:
    return "on" if remat is True else "off" if remat is False else remat


def report(p: Plan, device_memory: int | None) -> str:
    s = p.spec
    lines = [f"{s.model} {s.task} on {s.mesh_text()} ({s.dtype}, adapter backend {s.backend}): {describe(s)}",
             "  per device, GiB: " + "  ".join(f"{k} {gib(v)}" for k, v in p.parts.items())
             + "  (peak = argument + output - alias + temp + resident; gathered: largest all-gather)",
             f"  {'program':<36} {'argument':>9} {'output':>8} {'alias':>8} {'temp':>8} {'resident':>9} "
             f"{'peak':>8} {'gathered':>9} {'compile':>8}"]
    for q in p.programs:
        lines.append(f"  {q.name:<36} {gib(q.argument):>9} {gib(q.output):>8} {gib(q.alias):>8} {gib(q.temp):>8} "
                     f"{gib(q.resident):>9} {gib(q.peak):>8} {gib(q.gathered):>9} {q.compile_s:>7.1f}s")
    verdict = ""
    if device_memory is not None:
        verdict = (f": fits {gib(device_memory)} GiB (headroom {gib(device_memory - p.peak)})" if p.fits(device_memory)
                   else f": does NOT fit {gib(device_memory)} GiB (over by {gib(p.peak - device_memory)})")
    lines.append(f"  peak per device {gib(p.peak)} GiB ({p.peak_program.name}){verdict}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- CLI
def _parse(argv=None):
    d = PlanSpec()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=d.model, help="llama-3.1-8b | llama-3.1-70b | qwen2.5-0.5b | smollm2-135m")
    ap.add_argument("--task", choices=TASKS, default=d.task)
    ap.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T (default: one device)")
    ap.add_argument("--search", choices=("tensor", "fsdp", "data"), default=None,
                    help="try this mesh axis at 1, 2, 4, 8 (other axes from --mesh) and name the smallest that "
                         "fits --device-memory")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    ap.add_argument("--quantize", choices=("int8", "int4"), default=None,
                    help="base weights quantized (qwix QArrays, preft_jax.quantize; QLoRA for sft/grpo)")
    ap.add_argument("--backend", default=d.backend, help="adapter backend (jnp | xla | pallas)")
    ap.add_argument("--device-memory", type=parse_bytes, default=None, help="e.g. 80GiB, 24GB")
    g = ap.add_argument_group("serving (serve.engine.EngineConfig)")
    g.add_argument("--adapters", type=int, default=d.adapters, help="device adapter slots")
    g.add_argument("--lora-rank", type=int, default=d.lora_rank)
    g.add_argument("--kv-tokens", type=int, default=d.kv_tokens)
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-prefill-seqs", type=int, default=d.max_prefill_seqs)
    g.add_argument("--mode", choices=("prefill", "all"), default=d.mode)
    g = ap.add_argument_group("training")
    g.add_argument("--rank", type=int, default=d.rank, help="trained LoRA rank")
    g.add_argument("--seq", type=int, default=d.seq)
    g.add_argument("--batch", type=int, default=d.batch)
    g.add_argument("--no-remat", dest="remat", action="store_false")
    g.add_argument("--remat", dest="remat", type=_remat_arg, help="full (the default) | off | a remat policy that "
                   "also keeps some projections' outputs: save_qkvo, save_projections (preft_jax.config.REMAT_POLICIES)")
    g.add_argument("--logit-chunk", type=int, default=d.logit_chunk)
    g.add_argument("--group-size", type=int, default=d.group_size)
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--measure", action="store_true",
                    help="also run each program for real on this CPU (zero inputs) and print its peak RSS growth "
                         "next to the plan (small models only: it allocates the plan's bytes)")
    ap.add_argument("--json", default=None, help="write the plan(s) to this file")
    return ap.parse_args(argv)


def _remat_arg(text: str):
    from preft_jax.config import remat_from_word
    try:
        return remat_from_word(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def spec_from_args(a, mesh: tuple[int, int, int]) -> PlanSpec:
    fields = {f.name for f in dataclasses.fields(PlanSpec)} - {"mesh"}
    return PlanSpec(mesh=mesh, **{k: getattr(a, k) for k in fields})


def finish_args(a):
    """Checks the parsed flags (ValueError naming the flag) and adds `a.meshes`, the meshes to plan."""
    from preft_jax.config import MODEL_PRESETS
    from preft_jax.sharding import AXES, parse_mesh
    if a.model not in MODEL_PRESETS:
        raise ValueError(f"unknown --model {a.model!r}; known: {', '.join(MODEL_PRESETS)}")
    try:
        base = parse_mesh(a.mesh)
    except ValueError as e:
        raise ValueError(f"--mesh: {e}") from None
    a.meshes = [tuple(base[x] for x in AXES)]
    if a.search:
        if a.device_memory is None:
            raise ValueError("--search needs --device-memory")
        a.meshes = [tuple(n if x == a.search else base[x] for x in AXES) for n in (1, 2, 4, 8)]
    return a


def main(argv=None) -> int:
    try:
        a = finish_args(_parse(argv))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    meshes = a.meshes
    set_fake_devices(max(math.prod(m) for m in meshes))
    plans = []
    for mesh in meshes:
        try:
            p = plan(spec_from_args(a, mesh))
        except ValueError as e:
            print(f"{a.model} {a.task} mesh {mesh}: {e}", file=sys.stderr)
            return 2
        plans.append(p)
        print(report(p, a.device_memory), flush=True)
        if a.measure:
            for q in p.programs:
                got, want = measure(q), q.peak - q.resident
                print(f"  measured {q.name}: peak RSS growth {gib(got)} GiB vs plan {gib(want)} GiB "
                      f"({got / want - 1:+.1%})", flush=True)
        if a.search and p.fits(a.device_memory):
            print(f"smallest {a.search} that fits {gib(a.device_memory)} GiB: {p.spec.mesh_text()}")
            break
    else:
        if a.search:
            print(f"no {a.search} size up to 8 fits {gib(a.device_memory)} GiB")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump([p.to_json() for p in plans], f, indent=1)
    return 0


if __name__ == "__main__":
    from benchmarks.common import run as _run_main
    raise SystemExit(_run_main(main))
