"""Weight loading: GGUF files and HF safetensors folders -> (ModelConfig, canonical params, Tokenizer)."""
from __future__ import annotations

from preft_jax.loading.default_model import default_model_path, resolve_model_path
from preft_jax.loading.files import load_gguf, load_hf_folder, load_model
from preft_jax.loading.weight_names import (CANONICAL_NAMES, MissingWeightError, WeightNameError,
                                            canonical_shapes)

__all__ = ["load_model", "load_model_sharded", "load_gguf", "load_hf_folder", "default_model_path",
           "resolve_model_path", "canonical_shapes", "CANONICAL_NAMES", "MissingWeightError", "WeightNameError"]


def load_model_sharded(path=None, mesh=None, dtype="float32", *, cache=None, progress=None):
    from preft_jax.loading.placement import load_model_sharded as _load
    return _load(path, mesh, dtype, cache=cache, progress=progress)


load_model_sharded.__doc__ = "See preft_jax.loading.placement.load_model_sharded."
