"""The native CPU path, behind this one door: the decoder layers and the LM head of a decode step
(one token per row, base weights) run as one pallas_kernels.cpu XLA FFI call on weights packed once
at load. The model (preft_jax/model.py) does not know it exists; the serving engine chooses it
(serve/step_runner.py, `EngineConfig.cpu_decode`).

    why = unsupported_reason(cfg, dtype, mesh, quantization)   "" when the native path can serve this model
    native = pack(model)                              NativeWeights (a pytree: pass it to paged_step)
    logits, greedy, cache = decode_logits(model, native, tokens, batch, cache)

`paged_step(..., native=...)` takes the one-call step for decode calls without a bank (every decode
call of a base or PreFT engine); every other call (prefill chunks, all-token decode) runs on XLA.
Meshes, bfloat16, accelerators and any model feature the native code does not implement keep the
XLA / Pallas paths: `unsupported_reason` checks every `ModelConfig` field against an allow-list
(`NATIVE_FIELDS`), so a field added to the config later falls back to XLA until it is listed here.
Outputs equal `paged_forward`'s up to float32 rounding (same math, another summation order):
tests/test_native_decode.py holds them to the XLA path and to float64. Cost: a second, packed copy
of the layer weights and the LM head in host memory.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import cpu
from preft_jax.config import ModelConfig, RopeScaling
from preft_jax.paged_kv import PagedBatch, PagedKVCache

CPU_DECODE = ("auto", "native", "xla")      # EngineConfig.cpu_decode


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NativeWeights:
    layers: dict            # pallas_kernels.cpu.pack_decoder(...)
    lm_head: jax.Array      # [P, d, 48]: the packed [d, V] output projection
    vocab_size: int = dataclasses.field(metadata=dict(static=True), default=0)


def _any(_value) -> bool:
    return True


# Every ModelConfig field -> (the values the native step implements, what that is). A field that is
# not listed (a new model feature) or a value outside its set sends the model to the XLA path.
NATIVE_FIELDS = {
    "vocab_size": (_any, "any size"),
    "d_model": (_any, "any size"),
    "n_layers": (_any, "any number"),
    "n_heads": (_any, "any number (a multiple of n_kv_heads, as every config)"),
    "n_kv_heads": (_any, "any number"),
    "head_dim": (lambda v: v % 2 == 0, "even (rotate-half RoPE)"),
    "ffn_dim": (_any, "any size"),
    "rope_theta": (_any, "any base (the inverse frequencies are passed in)"),
    "rms_eps": (_any, "any epsilon"),
    "tie_embeddings": (_any, "tied or untied LM head"),
    "max_seq_len": (_any, "any length"),
    "rope_scaling": (lambda v: v is None or type(v) is RopeScaling, "None or llama3 RopeScaling"),
    "bos_token_id": (_any, "not used by the step"),
    "eos_token_ids": (_any, "not used by the step"),
    "qkv_bias": (_any, "with or without q/k/v biases"),
}


def unsupported_reason(cfg: ModelConfig, dtype, mesh=None, quantization: str | None = None) -> str:
    """"" when the native decode step can serve `cfg` in `dtype` here, else why not (naming the
    ModelConfig field, for a model feature the native step does not implement). `quantization`:
    "int8" | "int4" when the base weights are quantized (preft_jax.quantize)."""
    if quantization:
        return (f"the base weights are quantized ({quantization}); the native step packs and reads "
                f"float32 weights")
    if mesh is not None:
        return f"the engine runs on a mesh {dict(mesh.shape)} (the native step is one unsharded CPU device)"
    if jnp.dtype(dtype) != jnp.float32:
        return f"the model dtype is {jnp.dtype(dtype).name} (the native step is float32)"
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name not in NATIVE_FIELDS:
            return f"ModelConfig.{field.name} is a model feature the native step does not implement"
        allowed, what = NATIVE_FIELDS[field.name]
        if not allowed(value):
            return f"ModelConfig.{field.name} = {value!r} (the native step implements {what})"
    return cpu.unavailable_reason()


def logged_by_library(why: str) -> bool:
    """True when `why` (from `unsupported_reason`) is the native library's own failure, which
    pallas_kernels.cpu has already logged in its one line (callers then add none); nothing is built."""
    status = cpu.library_status()
    return status["state"] == "unavailable" and why == status["reason"]


def pack(model) -> NativeWeights:
    """Packs `model`'s (a preft_jax Llama) layer weights and LM head once."""
    cfg = model.cfg
    head = model.embed[...].T if cfg.tie_embeddings else model.lm_head[...]
    return NativeWeights(cpu.pack_decoder(model.layers.stacked()), cpu.pack_panels(head), cfg.vocab_size)


def decode_logits(model, native: NativeWeights, tokens, batch: PagedBatch, cache: PagedKVCache):
    """tokens int [R, 1] at positions batch.context_lens (one per row, base weights) -> (logits [R, V]
    float32, greedy int32 [R] (their argmax), cache with the tokens' K/V written): the contract of
    `paged_forward` for C == 1 without a bank."""
    cfg = model.cfg
    if tokens.shape[1] != 1:
        raise ValueError(f"the native decode step takes one token per row, got chunks of {tokens.shape[1]}")
    h = model.embed[...][tokens[:, 0]].astype(jnp.float32)
    logits, greedy, k, v = cpu.decode_step(
        h, batch.block_tables, batch.context_lens, batch.chunk_lens, batch.write_index[:, 0],
        jnp.asarray(model._inv_freq, jnp.float32), native.layers, model.final_norm[...], native.lm_head,
        native.vocab_size, cache.k, cache.v, cfg.rms_eps)
    return logits, greedy, PagedKVCache(k, v)
