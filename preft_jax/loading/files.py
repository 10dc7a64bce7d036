"""A model path -> (ModelConfig, canonical params on the host, Tokenizer): GGUF files (through the
weight cache) and HF safetensors folders. `preft_jax.loading` re-exports these; modules inside the
package (placement, quantized) import them from here."""
from __future__ import annotations

import os

import numpy as np

from preft_jax.loading.default_model import resolve_model_path


def load_gguf(path=None, dtype=np.float32, progress=None):
    from preft_jax.loading.gguf_loader import load_gguf as _load
    return _load(path, dtype=dtype, progress=progress)


load_gguf.__doc__ = "See preft_jax.loading.gguf_loader.load_gguf."


def load_hf_folder(folder, dtype=np.float32, progress=None):
    from preft_jax.loading.hf_safetensors import load_hf_folder as _load
    return _load(folder, dtype=dtype, progress=progress)


load_hf_folder.__doc__ = "See preft_jax.loading.hf_safetensors.load_hf_folder."


def load_model(path: str | os.PathLike | None = None, dtype=np.float32, *, cache: bool | None = None,
               progress: bool | None = None):
    """(ModelConfig, params, Tokenizer) from a .gguf file, an HF folder, or (None) the default model.

    cache: GGUF weights are dequantized once and then read from the weight cache (see preft_jax.cache;
    keyed by the file's SHA-256 and the dtype). None = on unless PREFT_JAX_NO_CACHE is set. HF
    safetensors folders are memory-mapped directly and never cached.
    progress: tqdm bar for first-run dequantization / HF tensor loading (None = only when stderr is a terminal).
    """
    p = resolve_model_path(path)
    if p.is_dir():
        return load_hf_folder(p, dtype=dtype, progress=progress)
    if cache is None:
        from preft_jax.cache.location import cache_disabled_by_env
        cache = not cache_disabled_by_env()
    if cache:
        from preft_jax.loading.cached import load_gguf_cached
        return load_gguf_cached(p, dtype=dtype, progress=progress)
    return load_gguf(p, dtype=dtype, progress=progress)
