"""The native CPU path: the decoder layers and the LM head of a decode step (one token per row, base
weights) run as one pallas_kernels.cpu XLA FFI call on weights packed once at load; other calls run
their base projections as native matmuls on the same packed weights (`Llama.forward_paged(dense=)`).

    why = unsupported_reason(cfg, dtype, mesh, quantization)   "" when the native path can serve this model
    native = pack(model)                              NativeWeights (a pytree: pass it to paged_step)
    logits, greedy, cache = decode_logits(model, native, tokens, batch, cache)

`paged_step(..., native=...)` takes the one-call step for decode calls without a bank (every decode
call of a base or PreFT engine) and the native projections for the rest (prefill chunks, all-token
decode), where adapters, norms and attention stay XLA's. Meshes, bfloat16 and accelerators keep the
XLA / Pallas paths. Outputs equal `paged_forward`'s up to float32 rounding (same math, another
summation order): tests/test_native_decode.py holds them to the XLA path and to float64. Cost: a
second, packed copy of the layer weights and the LM head in host memory.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import cpu
from preft_jax.config import ModelConfig
from preft_jax.paged_kv import PagedBatch, PagedKVCache

CPU_DECODE = ("auto", "native", "xla")      # EngineConfig.cpu_decode


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NativeWeights:
    layers: dict            # pallas_kernels.cpu.pack_decoder(...)
    lm_head: jax.Array      # [P, d, 48]: the packed [d, V] output projection
    vocab_size: int = dataclasses.field(metadata=dict(static=True), default=0)


def unsupported_reason(cfg: ModelConfig, dtype, mesh=None, quantization: str | None = None) -> str:
    """"" when the native decode step can serve `cfg` in `dtype` here, else why not. `quantization`:
    "int8" | "int4" when the base weights are quantized (preft_jax.quantize)."""
    if quantization:
        return (f"the base weights are quantized ({quantization}); the native step packs and reads "
                f"float32 weights")
    if mesh is not None:
        return f"the engine runs on a mesh {dict(mesh.shape)} (the native step is one unsharded CPU device)"
    if jnp.dtype(dtype) != jnp.float32:
        return f"the model dtype is {jnp.dtype(dtype).name} (the native step is float32)"
    if cfg.head_dim % 2:
        return f"head_dim {cfg.head_dim} is odd"
    return cpu.unavailable_reason()


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
