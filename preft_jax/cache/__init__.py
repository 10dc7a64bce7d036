"""Caches that make a second start fast: dequantized weights and compiled XLA programs.

    from preft_jax.cache import enable_compilation_cache
    enable_compilation_cache()          # before the first jit compile (serve / CLI start-up)
    # or fast_start(): the same, plus flax imported without its ~0.4 s IPython probe

Weights: `preft_jax.loading.load_model` caches what it dequantizes from a GGUF file under
`<cache root>/weights` (keyed by the file's SHA-256 and the dtype; see preft_jax.cache.weights).
Location: `cache_root()`; override with PREFT_JAX_CACHE_DIR, disable with PREFT_JAX_NO_CACHE=1.
`python -m preft_jax.cache` lists or clears the caches (the compiled native CPU library included).
`status()` says what the caches do in this process: a cache root that cannot be written degrades to
read-only caches with one log line, never an error (see preft_jax.cache.status).
"""
from preft_jax.cache.compilation import enable_compilation_cache
from preft_jax.cache.content_hash import content_hash, sha256_file
from preft_jax.cache.startup import fast_start, import_flax_quickly, quiet_backend_probe
from preft_jax.cache.status import status
from preft_jax.cache.location import (ENV_CACHE_DIR, ENV_NO_CACHE, cache_disabled_by_env, cache_root,
                                      compilation_dir, weights_dir)
from preft_jax.cache.weights import CorruptEntryError, WeightStore

__all__ = ["enable_compilation_cache", "fast_start", "import_flax_quickly", "quiet_backend_probe", "status", "content_hash", "sha256_file", "cache_root", "compilation_dir",
           "weights_dir", "cache_disabled_by_env", "ENV_CACHE_DIR", "ENV_NO_CACHE", "WeightStore",
           "CorruptEntryError"]
