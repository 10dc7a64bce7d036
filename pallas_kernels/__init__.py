"""Pallas kernels for multi-adapter LoRA (grouped prefill/training SGMV, per-token decode BGMV)
and batched ReFT interventions, each with a Mosaic TPU and a Pallas Triton (GPU) variant, a
plain-jnp reference and a custom_vjp whose backward also runs on kernels.

Public API
  lora_sgmv(x, A, B, adapter_idx, *, block_tokens=None, block_out=None, interpret=None,
            platform=None, metadata=None)
  lora_bgmv(x, A, B, adapter_idx, *, interpret=None, platform=None)
  reft_apply(h, R, W, b, subtract, adapter_idx, *, block_tokens=None, interpret=None,
             platform=None, metadata=None)
  make_group_metadata(adapter_idx, num_groups, block_tokens=16) -> GroupMetadata
  TilingError (ValueError): a traced variant cannot tile the shapes (raised at trace time)
  references: lora_sgmv_reference, lora_bgmv_reference, reft_apply_reference

The variant follows the platform the call is lowered for (tpu -> Mosaic, cuda/rocm -> Triton,
cpu -> TPU variant in interpret mode); platform="tpu"|"gpu" forces one (see dispatch.py).
Layout: metadata.py. Kernels: tpu/, gpu/. Custom VJPs: sgmv.py, bgmv.py, reft.py, outer.py.
"""
from .bgmv import lora_bgmv
from .dispatch import VARIANTS
from .errors import TilingError
from .metadata import GroupMetadata, make_group_metadata, padded_rows
from .reference import lora_bgmv_reference, lora_sgmv_reference, reft_apply_reference
from .reft import reft_apply
from .sgmv import lora_sgmv

__all__ = ["lora_sgmv", "lora_bgmv", "reft_apply", "make_group_metadata", "GroupMetadata",
           "padded_rows", "TilingError", "VARIANTS", "lora_sgmv_reference",
           "lora_bgmv_reference", "reft_apply_reference"]
