"""Weight loading: GGUF files and HF safetensors folders -> (ModelConfig, canonical params, Tokenizer)."""
from __future__ import annotations

import os

import numpy as np

from preft_jax.loading.default_model import default_model_path, resolve_model_path
from preft_jax.loading.weight_names import (CANONICAL_NAMES, MissingWeightError, WeightNameError,
                                            canonical_shapes)

__all__ = ["load_model", "load_gguf", "load_hf_folder", "default_model_path", "resolve_model_path",
           "canonical_shapes", "CANONICAL_NAMES", "MissingWeightError", "WeightNameError"]


def load_gguf(path=None, dtype=np.float32):
    from preft_jax.loading.gguf_loader import load_gguf as _load
    return _load(path, dtype=dtype)


load_gguf.__doc__ = "See preft_jax.loading.gguf_loader.load_gguf."


def load_hf_folder(folder, dtype=np.float32):
    from preft_jax.loading.hf_safetensors import load_hf_folder as _load
    return _load(folder, dtype=dtype)


load_hf_folder.__doc__ = "See preft_jax.loading.hf_safetensors.load_hf_folder."


def load_model(path: str | os.PathLike | None = None, dtype=np.float32):
    """(ModelConfig, params, Tokenizer) from a .gguf file, an HF folder, or (None) the default model."""
    p = resolve_model_path(path)
    if p.is_dir():
        return load_hf_folder(p, dtype=dtype)
    return load_gguf(p, dtype=dtype)
