"""Independent float64 numpy Llama forward (no cache, no scan) with per-token adapters.

Used as the test oracle: each token t of sequence b gets the adapter of slot `idx[b, t]`
(0 = none), LoRA as an explicit per-token (x A) B delta and ReFT as an explicit per-token edit.
"""
from __future__ import annotations

import numpy as np

NAMES = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, positions, inv_freq):
    ang = positions[:, :, None, None] * inv_freq[None, None, None, :]
    x1, x2 = np.split(x, 2, -1)
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def reference_logits(cfg, params, tokens, idx=None, loras=None, refts=None):
    """tokens, idx: int [B, T]; loras: {slot: LoraWeights}; refts: {slot: ReftWeights}. -> [B, T, V]."""
    from preft_jax.rope import inverse_frequencies
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    idx = np.zeros((B, T), int) if idx is None else np.asarray(idx)
    loras, refts = loras or {}, refts or {}
    inv_freq = inverse_frequencies(cfg)
    pos = np.broadcast_to(np.arange(T), (B, T)).astype(np.float64)
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def proj(x, layer, target):
        y = x @ p[NAMES[target]][layer]
        for slot, w in loras.items():
            if target in w.config.targets:
                A = np.asarray(w.A[target][layer], np.float64)
                Bm = np.asarray(w.B[target][layer], np.float64)
                delta = (x @ A) @ Bm * w.config.scale
                y = y + delta * (idx == slot)[..., None]
        return y

    h = p["embed"][tokens]
    causal = np.tril(np.ones((T, T), bool))
    for layer in range(cfg.n_layers):
        x = _rms(h, p["attn_norm"][layer], cfg.rms_eps)
        q = _rope(proj(x, layer, "q").reshape(B, T, H, hd), pos, inv_freq)
        k = _rope(proj(x, layer, "k").reshape(B, T, KV, hd), pos, inv_freq)
        v = proj(x, layer, "v").reshape(B, T, KV, hd)
        k = np.repeat(k, H // KV, axis=2)
        v = np.repeat(v, H // KV, axis=2)
        s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        attn = np.einsum("bhts,bshd->bthd", s, v).reshape(B, T, H * hd)
        h = h + proj(attn, layer, "o")
        x = _rms(h, p["mlp_norm"][layer], cfg.rms_eps)
        g, u = proj(x, layer, "gate"), proj(x, layer, "up")
        h = h + proj(g / (1 + np.exp(-g)) * u, layer, "down")
        for slot, w in refts.items():
            if layer not in w.config.layers:
                continue
            R = np.asarray(w.R[layer], np.float64)
            W = np.asarray(w.W[layer], np.float64)
            b = np.asarray(w.b[layer], np.float64)
            sub = 1.0 if w.config.kind == "loreft" else 0.0
            edit = (h @ W.T + b - sub * (h @ R.T)) @ R
            h = h + edit * (idx == slot)[..., None]
    h = _rms(h, p["final_norm"], cfg.rms_eps)
    head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
    return h @ head


def random_params(cfg, seed=0):
    """Canonical params with random non-zero values (norm scales away from 1)."""
    from preft_jax.loading.weight_names import canonical_shapes
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in canonical_shapes(cfg).items():
        if "norm" in name:
            out[name] = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = shape[-2] if len(shape) >= 2 and name != "embed" else 1
            scale = 0.5 if name == "embed" else fan_in ** -0.5
            out[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
    return out
