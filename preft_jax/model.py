"""Llama-family decoder in Flax NNX: RMSNorm, RoPE, GQA attention, SwiGLU MLP, tied embeddings.

Layer parameters are stacked on a leading `n_layers` axis and the forward pass scans over them
(one compiled layer body; fast compiles). Two entry points share the layer body:

* `forward_chunk` - a chunk of T tokens per sequence starting at position 0 (prefill, and the
  teacher-forced training forward); attention is causal within the chunk; K/V can be written
  into cache slots.
* `decode` - one token per cache slot at its own position, attending to the cache.

Adapters enter through a per-token slot index (`token_adapter_idx`, 0 = base) into an
`AdapterBank`; passing `bank=None` compiles the plain base model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preft_jax.adapters.apply import lora_delta, reft_intervene
from preft_jax.adapters.bank import AdapterBank, LayerAdapters
from preft_jax.config import ModelConfig
from preft_jax.kv_cache import KVCache
from preft_jax.rope import apply_rope, inverse_frequencies

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# canonical weight name -> LoRA target short name
PROJECTION_TARGET = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "w_gate": "gate", "w_up": "up",
                     "w_down": "down"}
# Optional q/k/v biases [n_layers, out] (ModelConfig.qkv_bias, e.g. Qwen2), added after the projection.
BIAS_PARAMS = {"wq": "bq", "wk": "bk", "wv": "bv"}


def layer_param_names(cfg: ModelConfig) -> tuple[str, ...]:
    return LAYER_PARAMS + (tuple(BIAS_PARAMS.values()) if cfg.qkv_bias else ())


def rms_norm(x, scale, eps):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * scale.astype(jnp.float32)).astype(x.dtype)


class LayerStack(nnx.Module):
    """All decoder layers' weights, stacked: e.g. wq [n_layers, d_model, n_heads * head_dim]."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        L, d = cfg.n_layers, cfg.d_model
        dims = cfg.projection_dims()

        def dense(shape, fan_in):
            return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * (fan_in ** -0.5))

        self.attn_norm = nnx.Param(jnp.ones((L, d), dtype))
        self.mlp_norm = nnx.Param(jnp.ones((L, d), dtype))
        for name, target in PROJECTION_TARGET.items():
            d_in, d_out = dims[target]
            setattr(self, name, dense((L, d_in, d_out), d_in))
        if cfg.qkv_bias:
            for name, bias in BIAS_PARAMS.items():
                setattr(self, bias, nnx.Param(jnp.zeros((L, dims[PROJECTION_TARGET[name]][1]), dtype)))

    def stacked(self) -> dict:
        names = LAYER_PARAMS + tuple(b for b in BIAS_PARAMS.values() if hasattr(self, b))
        return {name: getattr(self, name)[...] for name in names}


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, adapter_backend: str = "jnp"):
        self.cfg = cfg
        self.dtype = dtype
        self.adapter_backend = adapter_backend
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), dtype) * 0.02)
        self.layers = LayerStack(cfg, rngs=rngs, dtype=dtype)
        self.final_norm = nnx.Param(jnp.ones((cfg.d_model,), dtype))
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(
                jax.random.normal(rngs.params(), (cfg.d_model, cfg.vocab_size), dtype) * cfg.d_model ** -0.5)
        self._inv_freq = tuple(float(f) for f in inverse_frequencies(cfg))   # static, hashable

    # ---- weights -------------------------------------------------------------------------------
    @classmethod
    def from_params(cls, cfg: ModelConfig, params: dict, dtype=jnp.float32, adapter_backend: str = "jnp"):
        """Builds the model from canonical params (see preft_jax.loading) without random init work."""
        model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, adapter_backend=adapter_backend))
        expected = {"embed", "final_norm", *layer_param_names(cfg)} | (set() if cfg.tie_embeddings else {"lm_head"})
        missing = expected - set(params)
        if missing:
            raise ValueError(f"missing model parameters: {sorted(missing)}")

        def put(holder, name, value):
            ref = getattr(holder, name)
            value = np.asarray(value)
            if tuple(value.shape) != tuple(ref.shape):
                raise ValueError(f"parameter {name}: expected shape {tuple(ref.shape)}, got {value.shape}")
            ref.set_value(jnp.asarray(value, dtype))

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
        return jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)

    def _project(self, x, w, name, adapters: LayerAdapters | None, idx, decode: bool, bias=None):
        y = jnp.einsum("btd,de->bte", x, w)
        if bias is not None:
            y = y + bias.astype(y.dtype)
        target = PROJECTION_TARGET[name]
        if adapters is not None and target in adapters.lora_A:
            B, T, _ = x.shape
            delta = lora_delta(x.reshape(B * T, -1), adapters.lora_A[target], adapters.lora_B[target],
                               idx.reshape(-1), self.adapter_backend, decode)
            y = y + delta.reshape(B, T, -1).astype(y.dtype)
        return y

    def _layer(self, h, p, layer, adapters, reft_subtract, idx, positions, attend, cache, decode):
        """One decoder layer. `attend(layer, q, k, v, cache) -> (out [B, T, H, hd], cache)`."""
        cfg = self.cfg
        B, T, _ = h.shape
        x = rms_norm(h, p["attn_norm"], cfg.rms_eps)
        q = self._project(x, p["wq"], "wq", adapters, idx, decode, p.get("bq"))
        k = self._project(x, p["wk"], "wk", adapters, idx, decode, p.get("bk"))
        v = self._project(x, p["wv"], "wv", adapters, idx, decode, p.get("bv"))
        q = q.reshape(B, T, cfg.n_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.n_kv_heads, cfg.head_dim)
        q = apply_rope(q, positions, self._inv_freq)
        k = apply_rope(k, positions, self._inv_freq)
        attn, cache = attend(layer, q, k, v, cache)
        h = h + self._project(attn.reshape(B, T, cfg.q_dim), p["wo"], "wo", adapters, idx, decode)
        x = rms_norm(h, p["mlp_norm"], cfg.rms_eps)
        gate = self._project(x, p["w_gate"], "w_gate", adapters, idx, decode)
        up = self._project(x, p["w_up"], "w_up", adapters, idx, decode)
        h = h + self._project(jax.nn.silu(gate) * up, p["w_down"], "w_down", adapters, idx, decode)
        if adapters is not None and adapters.reft_R is not None:
            # ReFT edits the residual stream after this layer (zero R = identity for other layers).
            h = reft_intervene(h.reshape(B * T, -1), adapters.reft_R, adapters.reft_W, adapters.reft_b,
                               reft_subtract, idx.reshape(-1), self.adapter_backend).reshape(B, T, -1)
        return h, cache

    def _attention(self, q, k, v, mask):
        """q: [B, T, H, hd]; k, v: [B, S, KV, hd]; mask: bool [B, T, S] -> [B, T, H, hd]."""
        cfg = self.cfg
        B, T, H, hd = q.shape
        groups = H // cfg.n_kv_heads
        q = q.reshape(B, T, cfg.n_kv_heads, groups, hd)
        scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
        return out.reshape(B, T, H, hd).astype(q.dtype)

    def _scan_layers(self, h, bank: AdapterBank | None, idx, positions, attend, cache, decode: bool):
        """Scans the layer body over the stacked weights, carrying the cache (updated in place)."""
        xs = (jnp.arange(self.cfg.n_layers), self.layers.stacked(), None if bank is None else bank.per_layer())
        reft_subtract = None if bank is None else bank.reft_subtract

        def body(carry, x):
            h, cache = carry
            layer, p, adapters = x
            h, cache = self._layer(h, p, layer, adapters, reft_subtract, idx, positions, attend, cache, decode)
            return (h, cache), None

        (h, cache), _ = jax.lax.scan(body, (h, cache), xs)
        return h, cache

    # ---- entry points --------------------------------------------------------------------------
    def forward_chunk(self, tokens, token_adapter_idx=None, bank: AdapterBank | None = None,
                      cache: KVCache | None = None, slot_ids=None):
        """tokens: int [B, T] at positions 0..T-1 (right-padded). Returns (hidden [B, T, d], cache).

        Attention is causal within the chunk. If `cache` is given, sequence b's K/V are written to
        cache slot `slot_ids[b]` at positions 0..T-1 (padding positions too: they are never attended
        before decode overwrites them).
        """
        B, T = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
        idx = self._adapter_idx(token_adapter_idx, bank, (B, T))
        slots = None if cache is None else jnp.asarray(slot_ids, jnp.int32)[:, None]

        def attend(layer, q, k, v, c):
            if c is not None:
                c = KVCache(c.k.at[layer, slots, positions].set(k.astype(c.k.dtype), mode="drop"),
                            c.v.at[layer, slots, positions].set(v.astype(c.v.dtype), mode="drop"))
            return self._attention(q, k, v, causal), c

        h = self.embed[...][tokens].astype(self.dtype)
        return self._scan_layers(h, bank, idx, positions, attend, cache, decode=False)

    def decode(self, tokens, positions, cache: KVCache, token_adapter_idx=None, bank: AdapterBank | None = None):
        """tokens, positions: int [n_slots]; one new token per cache slot, written at its position.

        Returns (logits [n_slots, V] float32, cache)."""
        n = tokens.shape[0]
        positions = jnp.asarray(positions, jnp.int32)
        mask = (jnp.arange(cache.max_len)[None, :] <= positions[:, None])[:, None, :]   # [n, 1, S]
        idx = self._adapter_idx(None if token_adapter_idx is None else token_adapter_idx[:, None], bank, (n, 1))
        rows = jnp.arange(n)

        def attend(layer, q, k, v, c):
            kk = c.k.at[layer, rows, positions].set(k[:, 0].astype(c.k.dtype), mode="drop")
            vv = c.v.at[layer, rows, positions].set(v[:, 0].astype(c.v.dtype), mode="drop")
            out = self._attention(q, kk[layer].astype(q.dtype), vv[layer].astype(q.dtype), mask)
            return out, KVCache(kk, vv)

        h = self.embed[...][tokens[:, None]].astype(self.dtype)
        h, cache = self._scan_layers(h, bank, idx, positions[:, None], attend, cache, decode=True)
        return self.logits(h[:, 0]), cache

    def _adapter_idx(self, token_adapter_idx, bank, shape):
        if bank is None:
            return None
        if token_adapter_idx is None:
            raise ValueError("a bank needs token_adapter_idx")
        return jnp.asarray(token_adapter_idx, jnp.int32).reshape(shape)
