"""Rotary position embeddings, HF "rotate_half" layout, with optional Llama-3 frequency scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from preft_jax.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies (numpy, computed once per config)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(medium, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq) -> jnp.ndarray:
    """x: [B, T, H, head_dim]; positions: int [B, T]; inv_freq: [head_dim // 2]. Float32 rotation."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
