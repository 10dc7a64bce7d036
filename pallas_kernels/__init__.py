"""Pallas kernels for multi-adapter LoRA (grouped prefill SGMV, per-token decode BGMV) and
batched ReFT interventions. Each has a plain-jnp reference and a custom_vjp. On CPU they run in
Pallas interpret mode; the compiled path targets TPU (scalar prefetch), see sgmv.py for GPU notes.
"""
from ._platform import resolve_interpret
from .bgmv import lora_bgmv
from .reft import reft_apply, reft_apply_reference
from .sgmv import lora_sgmv, lora_sgmv_reference

__all__ = ["lora_sgmv", "lora_sgmv_reference", "lora_bgmv", "reft_apply",
           "reft_apply_reference", "resolve_interpret"]
