"""GGUF loading through the weight cache (preft_jax.cache): dequantize once, memory-read afterwards.

The key is `<SHA-256 of the GGUF file>-<dtype>`; the entry holds the canonical params, the
ModelConfig and the serialized Tokenizer, so a hit needs neither the GGUF parser nor dequantization.
`LOADER_VERSION` is part of the store path: bump it when the GGUF -> canonical conversion changes.
"""
from __future__ import annotations

import os
import pathlib

import numpy as np

from preft_jax.config import ModelConfig
from preft_jax.tokenizer import Tokenizer

LOADER_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"


def gguf_cache_key(path: str | os.PathLike, dtype) -> str:
    from preft_jax.cache.content_hash import content_hash
    from preft_jax.cache.weights import dtype_name
    return f"{content_hash(path)}-{dtype_name(dtype)}"


def default_store():
    from preft_jax.cache.location import weights_dir
    from preft_jax.cache.weights import VERSION, WeightStore
    return WeightStore(weights_dir() / f"v{VERSION}-gguf{LOADER_VERSION}")


def load_gguf_cached(path: pathlib.Path, dtype=np.float32, progress: bool | None = None, store=None
                     ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """Like `load_gguf`, served from / written to the weight cache."""
    from preft_jax.loading.gguf_loader import load_gguf

    store = default_store() if store is None else store
    key = gguf_cache_key(path, dtype)
    hit = store.load(key)
    if hit is not None:
        try:
            cfg = ModelConfig.from_dict(hit.meta["config"])
            tok = Tokenizer.from_json(hit.files[TOKENIZER_FILE])
            return cfg, hit.arrays, tok
        except (KeyError, TypeError, ValueError):
            from preft_jax.cache.atomic import discard_dir
            discard_dir(hit.path)              # written by an incompatible version: rebuild
    cfg, params, tok = load_gguf(path, dtype=dtype, progress=progress)
    store.store(key, params, files={TOKENIZER_FILE: tok.to_json().encode("utf-8")},
                meta={"source": str(path), "dtype": np.dtype(dtype).name, "config": cfg.to_dict()})
    return cfg, params, tok
