"""Trainable single-adapter parameters and their differentiable view as a 2-slot AdapterBank.

Training optimizes one adapter: slot 0 is the base (constant zeros), slot 1 is built from the
trainable pytree on every step, so gradients flow only into the adapter.

LoRA params:  {"A": {target: [L, d_in, r]}, "B": {target: [L, r, d_out]}}  (PEFT init: A uniform
    +-1/sqrt(d_in), B = 0, so the adapter starts as the identity)
ReFT params:  {"R": [L, r, d], "W": [L, r, d], "b": [L, r]}. LoReFT uses orthonormal rows
    R = QR-orthonormalized(params["R"]) in every forward; it starts with W = R, b = 0 (identity).
    DiReFT uses R as is and starts with W = 0.
Layers outside the config's `layers` are masked to zero: their gradient is exactly zero (never NaN).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.adapters.bank import AdapterBank, BankLayout, slot_update, stack_slots
from preft_jax.adapters.config import LoraConfig, LoraWeights, ReftConfig, ReftWeights
from preft_jax.config import PROJECTION_AXES, ModelConfig


def _layer_mask(cfg: ModelConfig, layers) -> np.ndarray:
    mask = np.zeros(cfg.n_layers, np.float32)
    chosen = range(cfg.n_layers) if layers is None else layers
    for i in chosen:
        if not 0 <= i < cfg.n_layers:
            raise ValueError(f"adapter layer {i} out of range 0..{cfg.n_layers - 1}")
        mask[i] = 1.0
    return mask


def _two_slot_bank(cfg: ModelConfig, weights: LoraWeights | ReftWeights, dtype) -> AdapterBank:
    """The 2-slot bank (slot 0 base, slot 1 `weights`) through the bank's one slot writer, kept
    traced (jnp) so gradients flow into the adapter."""
    layout = BankLayout.fitting(cfg, [weights])
    return stack_slots([slot_update(layout, None, jnp, dtype), slot_update(layout, weights, jnp, dtype)], jnp)


def param_axes(params: dict) -> dict:
    """The logical axes (preft_jax.sharding) of every array of a trainable params dict, same structure.
    LoRA A / B follow the input / output dimension of their projection; ReFT R / W the residual."""
    if set(params) == {"A", "B"}:
        def axes(t, i):
            if t not in PROJECTION_AXES:
                raise ValueError(f"adapter params: no logical axes for LoRA target {t!r}")
            return ("layers", PROJECTION_AXES[t][0], "rank") if i == 0 else ("layers", "rank", PROJECTION_AXES[t][1])
        return {"A": {t: axes(t, 0) for t in params["A"]}, "B": {t: axes(t, 1) for t in params["B"]}}
    if set(params) == {"R", "W", "b"}:
        return {"R": ("layers", "rank", "embed"), "W": ("layers", "rank", "embed"), "b": ("layers", "rank")}
    raise ValueError(f"adapter params: no logical axes for a dict with keys {sorted(params)} "
                     f"(LoRA {{'A', 'B'}} or ReFT {{'R', 'W', 'b'}})")


# ---- LoRA ----------------------------------------------------------------------------------
def init_lora(cfg: ModelConfig, config: LoraConfig, key, dtype=jnp.float32) -> dict:
    dims = cfg.projection_dims()
    mask = _layer_mask(cfg, config.layers)[:, None, None]
    keys = jax.random.split(key, len(config.targets))
    A, B = {}, {}
    for k, t in zip(keys, config.targets):
        d_in, d_out = dims[t]
        bound = 1.0 / np.sqrt(d_in)
        A[t] = jax.random.uniform(k, (cfg.n_layers, d_in, config.rank), dtype, -bound, bound) * mask
        B[t] = jnp.zeros((cfg.n_layers, config.rank, d_out), dtype)
    return {"A": A, "B": B}


def lora_bank(cfg: ModelConfig, config: LoraConfig, params: dict) -> AdapterBank:
    mask = jnp.asarray(_layer_mask(cfg, config.layers))[:, None, None]
    weights = LoraWeights(config, A={t: params["A"][t] * mask for t in config.targets},
                          B={t: params["B"][t] * mask for t in config.targets})
    return _two_slot_bank(cfg, weights, params["A"][config.targets[0]].dtype)


def lora_weights(config: LoraConfig, params: dict, cfg: ModelConfig) -> LoraWeights:
    mask = _layer_mask(cfg, config.layers)[:, None, None]
    return LoraWeights(config,
                       A={t: np.asarray(params["A"][t], np.float32) * mask for t in config.targets},
                       B={t: np.asarray(params["B"][t], np.float32) * mask for t in config.targets})


# ---- ReFT ----------------------------------------------------------------------------------
def orthonormal_rows(R):
    """[..., r, d] -> rows orthonormalized by QR (differentiable), signs fixed to match R."""
    q, r = jnp.linalg.qr(jnp.swapaxes(R, -1, -2))
    sign = jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))
    sign = jnp.where(sign == 0, 1.0, sign)
    return jnp.swapaxes(q * sign[..., None, :], -1, -2)


def init_reft(cfg: ModelConfig, config: ReftConfig, key, dtype=jnp.float32) -> dict:
    if config.rank > cfg.d_model:
        raise ValueError(f"ReFT rank {config.rank} > d_model {cfg.d_model}")
    mask = _layer_mask(cfg, config.layers)
    R = orthonormal_rows(jax.random.normal(key, (cfg.n_layers, config.rank, cfg.d_model), jnp.float32))
    R = (R * mask[:, None, None]).astype(dtype)
    W = R if config.kind == "loreft" else jnp.zeros_like(R)
    return {"R": R, "W": W, "b": jnp.zeros((cfg.n_layers, config.rank), dtype)}


def effective_reft(cfg: ModelConfig, config: ReftConfig, params: dict):
    """(R, W, b) as the model uses them: LoReFT's R orthonormalized, layers outside config.layers zero.

    For LoReFT the unused layers' R is replaced by a fixed orthonormal matrix (rows of the identity)
    *before* the QR: their stored R is all zero, where the QR's gradient is NaN (and masking after
    the QR would give 0 * NaN = NaN). With `where` on a constant mask those layers get an exactly
    zero gradient, like every parameter of an unused layer."""
    mask = jnp.asarray(_layer_mask(cfg, config.layers))
    R = params["R"]
    if config.kind == "loreft":
        used = mask[:, None, None] > 0
        eye = jnp.eye(R.shape[-2], R.shape[-1], dtype=jnp.float32)
        R = orthonormal_rows(jnp.where(used, R.astype(jnp.float32), eye)).astype(params["R"].dtype)
    return R * mask[:, None, None], params["W"] * mask[:, None, None], params["b"] * mask[:, None]


def reft_bank(cfg: ModelConfig, config: ReftConfig, params: dict) -> AdapterBank:
    R, W, b = effective_reft(cfg, config, params)
    return _two_slot_bank(cfg, ReftWeights(config, R, W, b), R.dtype)


def reft_weights(config: ReftConfig, params: dict, cfg: ModelConfig) -> ReftWeights:
    R, W, b = effective_reft(cfg, config, params)
    return ReftWeights(config, np.asarray(R, np.float32), np.asarray(W, np.float32), np.asarray(b, np.float32))


def adapter_bank(cfg: ModelConfig, config: LoraConfig | ReftConfig, params: dict) -> AdapterBank:
    return (lora_bank if isinstance(config, LoraConfig) else reft_bank)(cfg, config, params)


def init_adapter(cfg: ModelConfig, config: LoraConfig | ReftConfig, key, dtype=jnp.float32) -> dict:
    return (init_lora if isinstance(config, LoraConfig) else init_reft)(cfg, config, key, dtype)


def adapter_weights(cfg: ModelConfig, config: LoraConfig | ReftConfig, params: dict):
    if isinstance(config, LoraConfig):
        return lora_weights(config, params, cfg)
    return reft_weights(config, params, cfg)
