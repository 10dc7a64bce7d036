"""Llama-family decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied embeddings.

Layer parameters are stacked on a leading `n_layers` axis and the forward pass scans over them
(one compiled layer body; fast compiles). Two entry points share the layer body:

* `forward_chunk` - a chunk of T tokens per sequence starting at position 0 (prefill, and the
  teacher-forced training forward); attention is causal within the chunk; K/V can be written
  into cache slots.
* `decode` - one token per cache slot at its own position, attending to the cache.

Adapters enter through an `AdapterBank` (weights, scanned per layer) and an `AdapterContext`
(the step's token -> slot layout, built once per step by `adapter_context`); each projection makes
one backend-independent call `ctx.lora(x, A, B)`, each layer with ReFT one `ctx.reft(...)`.
Passing `bank=None` compiles the plain base model.

Sharding: every weight declares its logical axes where it is created (`param(value, axes)`, an
nnx.Param with `out_sharding` metadata), and the layer body constrains its activations by logical
axes (`preft_jax.sharding.constrain`: a no-op unless a mesh is set with `jax.set_mesh`); the rules
table in preft_jax.sharding maps both onto the mesh. Returned caches are constrained to their
declared axes.

dtype (float32 | bfloat16) is the weights' and activations' dtype; RMSNorm statistics, RoPE, the
attention softmax, the logits and the LoRA shrink accumulation are float32 whatever the dtype. The
base projections and the embedding may hold int8 / int4 qwix QArrays instead (`from_params` with
`preft_jax.quantize.quantize_params`' output); the model reads them through `quantize.einsum/take`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from preft_jax.adapters.bank import AdapterBank, LayerAdapters
from preft_jax.adapters.context import AdapterContext, resolve_backend
from preft_jax.config import PROJECTION_AXES, REMAT_POLICIES, ModelConfig, remat_policy
from preft_jax import chunk_attention as chunk_attn
from preft_jax import paged_kv
from preft_jax import quantize as quant
from preft_jax import sharding as shd
from preft_jax.kv_cache import KVCache
from preft_jax.paged_kv import PagedBatch, PagedKVCache
from preft_jax.rope import apply_rope, inverse_frequencies

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# canonical weight name -> LoRA target short name
PROJECTION_TARGET = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w_gate": "gate", "w_up": "up",
                     "w_down": "down"}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Logical axes of the activations (preft_jax.sharding.RULES): [B, T, d], [B, T, H, hd], [B, T, ffn].
H_AXES = ("batch", "seq", "act_embed")
Q_AXES = ("batch", "seq", "q_heads", "head_dim")
KV_AXES = ("batch", "seq", "kv_heads", "head_dim")
MLP_AXES = ("batch", "seq", "mlp")
# Optional q/k/v biases [n_layers, out] (ModelConfig.qkv_bias, e.g. Qwen2), added after the projection.
BIAS_PARAMS = {"wq": "bq", "wk": "bk", "wv": "bv"}
# the REMAT_POLICIES name each projection's output is saved under
_SAVE_NAME = {"wq": "qkvo", "wk": "qkvo", "wv": "qkvo", "wo": "qkvo", "w_gate": "mlp", "w_up": "mlp", "w_down": "mlp"}


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    return LAYER_PARAMS + (tuple(BIAS_PARAMS.values()) if cfg.qkv_bias else ())


def model_dtype(dtype):
    """'float32' | 'bfloat16' (or the jnp dtype) -> the jnp dtype; anything else is an error."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    for supported in DTYPES.values():
        if dt == jnp.dtype(supported):
            return supported
    raise ValueError(f"model dtype must be one of {tuple(DTYPES)}, got {dtype!r}")


def param(value, axes: tuple) -> nnx.Param:
    """A weight with the logical name of each dimension declared (see preft_jax.sharding.RULES)."""
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def rms_norm(x, scale, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * scale.astype(jnp.float32)).astype(x.dtype)


class LayerStack(nnx.Module):
    """All decoder layers' weights, stacked: e.g. wq [n_layers, d_model, n_heads * head_dim]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        L, d = cfg.n_layers, cfg.d_model
        dims = cfg.projection_dims()

        def dense(shape, fan_in, axes):
            return param(jax.random.normal(rngs.params(), shape, dtype) * (fan_in ** -0.5), ("layers",) + axes)

        self.attn_norm = param(jnp.ones((L, d), dtype), ("layers", "norm"))
        self.mlp_norm = param(jnp.ones((L, d), dtype), ("layers", "norm"))
        for name, target in PROJECTION_TARGET.items():
            d_in, d_out = dims[target]
            setattr(self, name, dense((L, d_in, d_out), d_in, PROJECTION_AXES[target]))
        if cfg.qkv_bias:
            for name, bias in BIAS_PARAMS.items():
                target = PROJECTION_TARGET[name]
                setattr(self, bias, param(jnp.zeros((L, dims[target][1]), dtype), ("layers", PROJECTION_AXES[target][1])))

    def stacked(self) -> dict:
        names = LAYER_PARAMS + tuple(b for b in BIAS_PARAMS.values() if hasattr(self, b))
        return {name: getattr(self, name)[...] for name in names}


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, adapter_backend: str = "auto",
                 chunk_attention: str | None = None):
        dtype = model_dtype(dtype)
        self.cfg = cfg
        self.dtype = dtype
        self.adapter_backend = resolve_backend(adapter_backend)     # "auto" resolved here, static
        # forward_chunk's causal attention (preft_jax.chunk_attention; None: $PREFT_JAX_CHUNK_ATTENTION
        # or "auto"), resolved here, static
        self.chunk_attention = chunk_attn.resolve(chunk_attention, dtype)
        self.embed = param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), dtype) * 0.02,
                           ("vocab", "embed"))
        self.layers = LayerStack(cfg, rngs=rngs, dtype=dtype)
        self.final_norm = param(jnp.ones((cfg.d_model,), dtype), ("norm",))
        if not cfg.tie_embeddings:
            self.lm_head = param(
                jax.random.normal(rngs.params(), (cfg.d_model, cfg.vocab_size), dtype) * cfg.d_model ** -0.5,
                ("embed", "vocab"))
        self._inv_freq = tuple(float(f) for f in inverse_frequencies(cfg))   # static, hashable

    # ---- weights -------------------------------------------------------------------------------
    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict, dtype=jnp.float32, adapter_backend: str = "auto",
                    chunk_attention: str | None = None):
        """Builds the model from canonical params (see preft_jax.loading) without random init work.
        jax.Arrays in `dtype` are kept as they are placed (`preft_jax.loading.load_model_sharded`)."""
        dtype, adapter_backend = model_dtype(dtype), resolve_backend(adapter_backend)
        chunk_attention = chunk_attn.resolve(chunk_attention, dtype)
        model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, adapter_backend=adapter_backend,
                                           chunk_attention=chunk_attention))
        expected = {"embed", "final_norm", *layer_param_names(cfg)} | (set() if cfg.tie_embeddings else {"lm_head"})
        missing = expected - set(params)
        if missing:
            raise ValueError(f"missing model parameters: {sorted(missing)}")

        def put(holder, name, value):
            ref = getattr(holder, name)
            quantized = quant.is_quantized(value)          # QArrays: preft_jax.quantize
            placed = quantized or isinstance(value, jax.Array)   # e.g. streamed into its sharding: no host round trip
            value = value if placed else np.asarray(value)
            if tuple(value.shape) != tuple(ref.shape):
                raise ValueError(f"parameter {name}: expected shape {tuple(ref.shape)}, got {value.shape}")
            ref.set_value(value if quantized or (placed and value.dtype == dtype) else jnp.asarray(value, dtype))

        for name in layer_param_names(cfg):
            put(model.layers, name, params[name])
        put(model, "embed", params["embed"])
        put(model, "final_norm", params["final_norm"])
        if not cfg.tie_embeddings:
            put(model, "lm_head", params["lm_head"])
        return model

    # ---- pieces --------------------------------------------------------------------------------
    def logits(self, h):
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_eps)
        w = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
        return quant.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)

    def _project(self, x, p, name, adapters: LayerAdapters | None, ctx: AdapterContext | None):
        """Projection `name` of x with the layer's weights p, plus its bias and its adapters' LoRA delta."""
        y = quant.einsum("btd,de->bte", x, p[name])
        bias = p.get(BIAS_PARAMS.get(name, ""))
        if bias is not None:
            y = y + bias.astype(y.dtype)
        target = PROJECTION_TARGET[name]
        if adapters is not None and target in adapters.lora_A:
            y = y + ctx.lora(x, adapters.lora_A[target], adapters.lora_B[target]).astype(y.dtype)
        return checkpoint_name(y, _SAVE_NAME[name])        # what a remat policy may keep (REMAT_POLICIES)

    def _layer(self, h, p, layer, adapters, reft_subtract, ctx, positions, attend, cache):
        """One decoder layer. `attend(layer, q, k, v, cache) -> (out [B, T, H, hd], cache)`; `layer` is
        the scan's per-layer xs entry (the layer index, or (index, extra per-layer inputs)), and `cache`
        any carried state; an attend may return (out, cache, y) to emit a per-layer output y."""
        cfg = self.cfg
        B, T, _ = h.shape
        proj = lambda x, name: self._project(x, p, name, adapters, ctx)   # noqa: E731
        x = rms_norm(h, p["attn_norm"], cfg.rms_eps)
        q, k, v = (proj(x, n) for n in ("wq", "wk", "wv"))
        q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        q = self._constrain(apply_rope(q, positions, self._inv_freq), Q_AXES)
        k = self._constrain(apply_rope(k, positions, self._inv_freq), KV_AXES)
        v = self._constrain(v, KV_AXES)
        res = attend(layer, q, k, v, cache)
        attn, cache = self._constrain(res[0], Q_AXES), res[1]
        y = res[2] if len(res) > 2 else None
        h = self._constrain(h + proj(attn.reshape(B, T, cfg.q_dim), "wo"), H_AXES)
        x = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
        gate, up = (self._constrain(proj(x, n), MLP_AXES) for n in ("w_gate", "w_up"))
        h = self._constrain(h + proj(jax.nn.silu(gate) * up, "w_down"), H_AXES)
        if adapters is not None and adapters.reft_R is not None:
            # ReFT edits the residual stream after this layer (zero R = identity for other layers).
            h = ctx.reft(h, adapters.reft_R, adapters.reft_W, adapters.reft_b, reft_subtract)
        return h, cache, y

    def _constrain(self, x, axes):
        """Activation sharding by logical axes; a no-op without a mesh (`jax.set_mesh`)."""
        return shd.constrain(x, axes, shd.axis_units(self.cfg))

    def _constrain_cache(self, cache):
        return None if cache is None else shd.constrain_tree(cache, shd.axis_units(self.cfg), "cache")

    def _scan_layers(self, h, bank: AdapterBank | None, ctx, positions, attend, cache, layer_xs=None,
                     with_ys: bool = False, remat: bool | str = False):
        """Scans the layer body over the stacked weights, carrying `cache` (updated in place).

        `layer_xs`: extra per-layer inputs (leading axis n_layers) handed to `attend` as
        (layer index, slice); with_ys: also return the stacked per-layer outputs of `attend`;
        remat: the layer body is rematerialized in the backward pass (`remat_policy`: True or
        "full" keeps only each layer's input, "save_qkvo" / "save_projections" also the named
        projections' outputs; False: nothing recomputed)."""
        idx = jnp.arange(self.cfg.n_layers)
        xs = (idx if layer_xs is None else (idx, layer_xs), self.layers.stacked(),
              None if bank is None else bank.per_layer())
        reft_subtract = None if bank is None else bank.reft_subtract

        def body(carry, x):
            h, cache = carry
            layer, p, adapters = x
            h, cache, y = self._layer(h, p, layer, adapters, reft_subtract, ctx, positions, attend, cache)
            return (h, cache), y

        policy = remat_policy(remat)
        if policy is not None:
            names = REMAT_POLICIES[policy]
            body = jax.checkpoint(body, prevent_cse=False,
                                  policy=jax.checkpoint_policies.save_only_these_names(*names) if names else None)
        (h, cache), ys = jax.lax.scan(body, (h, cache), xs)
        return (h, cache, ys) if with_ys else (h, cache)

    # ---- entry points --------------------------------------------------------------------------
    def adapter_context(self, token_slots, bank: AdapterBank | None, mode: str | None = None, row_slots=None):
        """The step's AdapterContext for token_slots int [B, T] (slot per token) with this model's
        adapter backend; None without a bank. row_slots int [B]: each sequence's adapter slot, when
        token (b, t) uses slot 0 or row_slots[b] (`token_adapter_index`'s output always does). mode
        None: the layout `AdapterContext.build` picks (gather for one token per sequence)."""
        if bank is None:
            return None
        if token_slots is None:
            raise ValueError("a bank needs token -> slot indices")
        return AdapterContext.build(token_slots, bank.n_slots, self.adapter_backend, mode, row_slots)

    def forward_chunk(self, tokens, bank: AdapterBank | None = None, ctx: AdapterContext | None = None,
                      cache: KVCache | None = None, slot_ids=None, remat: bool | str = False):
        """tokens: int [B, T] at positions 0..T-1 (right-padded). Returns (hidden [B, T, d], cache).

        `ctx` (from `adapter_context`, B * T tokens) is required with a bank. Attention is causal
        within the chunk (`self.chunk_attention`: preft_jax.chunk_attention's reference or a flash
        kernel). If `cache` is given, sequence b's K/V are written to cache slot
        `slot_ids[b]` at positions 0..T-1 (padding positions too: they are never attended before
        decode overwrites them). remat: rematerialize each layer in the backward pass (training;
        True, False or a REMAT_POLICIES name, see `remat_policy`).
        """
        B, T = tokens.shape
        self._check_context(bank, ctx, B * T)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        slots = None if cache is None else jnp.asarray(slot_ids, jnp.int32)[:, None]
        units = shd.axis_units(self.cfg)

        def attend(layer, q, k, v, c):
            if c is not None:
                c = KVCache(c.k.at[layer, slots, positions].set(k.astype(c.k.dtype), mode="drop"),
                            c.v.at[layer, slots, positions].set(v.astype(c.v.dtype), mode="drop"))
            return chunk_attn.causal_attention(q, k, v, self.chunk_attention, units), c

        h = self._constrain(quant.take(self.embed[...], tokens).astype(self.dtype), H_AXES)
        h, cache = self._scan_layers(h, bank, ctx, positions, attend, cache, remat=remat)
        return h, self._constrain_cache(cache)

    def decode(self, tokens, positions, cache: KVCache, bank: AdapterBank | None = None,
               ctx: AdapterContext | None = None):
        """tokens, positions: int [n_slots]; one new token per cache slot, written at its position.

        `ctx` (n_slots tokens, normally gather mode) is required with a bank.
        Returns (logits [n_slots, V] float32, cache)."""
        n = tokens.shape[0]
        self._check_context(bank, ctx, n)
        positions = jnp.asarray(positions, jnp.int32)
        mask = (jnp.arange(cache.max_len)[None, :] <= positions[:, None])[:, None, :]   # [n, 1, S]
        rows = jnp.arange(n)

        def attend(layer, q, k, v, c):
            kk = c.k.at[layer, rows, positions].set(k[:, 0].astype(c.k.dtype), mode="drop")
            vv = c.v.at[layer, rows, positions].set(v[:, 0].astype(c.v.dtype), mode="drop")
            out = chunk_attn.masked_attention(q, kk[layer].astype(q.dtype), vv[layer].astype(q.dtype), mask)
            return out, KVCache(kk, vv)

        h = self._constrain(quant.take(self.embed[...], tokens[:, None]).astype(self.dtype), H_AXES)
        h, cache = self._scan_layers(h, bank, ctx, positions[:, None], attend, cache)
        return self.logits(h[:, 0]), self._constrain_cache(cache)

    def forward_paged(self, tokens, batch: PagedBatch, cache: PagedKVCache, bank: AdapterBank | None = None,
                      ctx: AdapterContext | None = None):
        """tokens int [R, C]: row r's tokens at positions batch.context_lens[r] + [0, C) (valid: the
        first batch.chunk_lens[r]); each attends to its cached context (block table) and causally to
        its own chunk; their K/V are written into the paged pool. Decode is C == 1.
        Returns (hidden [R, C, d], cache)."""
        R, C = tokens.shape
        self._check_context(bank, ctx, R * C)
        positions = batch.positions
        h = self._constrain(quant.take(self.embed[...], tokens).astype(self.dtype), H_AXES)
        if batch.attention.startswith("kernel:"):
            if C != 1:
                raise ValueError("the paged-attention kernels decode one token per row (C == 1)")
            platform = batch.attention.split(":", 1)[1]

            def attend(layer, q, k, v, c):              # c: the whole pool, carried and written in place
                c = PagedKVCache(paged_kv.write_token_layer(c.k, layer, k, batch.write_index),
                                 paged_kv.write_token_layer(c.v, layer, v, batch.write_index))
                out = paged_kv.kernel_decode_attention(q[:, 0], c.k, c.v, layer, batch.block_tables,
                                                       batch.context_lens + batch.chunk_lens, platform)
                return out[:, None], c

            h, cache = self._scan_layers(h, bank, ctx, positions, attend, cache)
            return h, self._constrain_cache(cache)

        def attend(layer, q, k, v, c):
            out = paged_kv.gather_attention(q, k, v, cache.k, cache.v, batch, layer)
            return out, c, (k, v)

        h, _, (k_new, v_new) = self._scan_layers(h, bank, ctx, positions, attend, None, with_ys=True)
        return h, self._constrain_cache(paged_kv.write_kv(cache, k_new, v_new, batch.write_index))

    @staticmethod
    def _check_context(bank, ctx, num_tokens):
        if bank is None:
            return
        if ctx is None:
            raise ValueError("a bank needs an AdapterContext (Llama.adapter_context(token_slots, bank))")
        if ctx.n_slots != bank.n_slots or ctx.num_tokens != num_tokens:
            raise ValueError(f"adapter context for {ctx.num_tokens} tokens / {ctx.n_slots} slots, but the step has "
                             f"{num_tokens} tokens and the bank {bank.n_slots} slots")
