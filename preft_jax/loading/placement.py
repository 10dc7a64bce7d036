"""Where each canonical parameter lives on a mesh, and loading a model straight onto it.

`param_shardings(cfg, mesh, dtype)` reads the logical axes the model declares on its weights
(preft_jax.model / preft_jax.sharding) for every canonical parameter name of preft_jax.loading;
`load_model_sharded` streams an HF folder into those shardings (`hf_safetensors.load_hf_sharded`)
or places a GGUF file's host params one parameter at a time.
"""
from __future__ import annotations

import os

import numpy as np


def param_shardings(cfg, mesh=None, dtype="float32") -> dict:
    """{canonical name: jax.sharding.Sharding} of a `Llama(cfg, dtype)`'s weights on `mesh` (by their
    declared logical axes), or on the default device without a mesh."""
    import jax
    from flax import nnx
    from preft_jax import sharding as shd
    from preft_jax.model import Llama

    state = nnx.state(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype,
                                                           chunk_attention="xla")))   # shapes only
    if mesh is None:
        tree = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), state)
    else:
        tree = shd.model_state_shardings(state, mesh, cfg)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return {shd.path_name(path).rsplit("/", 1)[-1]: s for path, s in flat}


def load_model_sharded(path: str | os.PathLike | None = None, mesh=None, dtype="float32", *,
                       cache: bool | None = None, progress: bool | None = None):
    """(ModelConfig, {canonical name: jax.Array placed by `param_shardings`}, Tokenizer).

    HF folders stream tensor by tensor into the shardings (host memory: about one device shard;
    each process reads only its devices' slices). GGUF files (and None, the default model) are read
    on the host by `load_model` (dequantized, cached) and placed one parameter at a time."""
    import jax
    import jax.numpy as jnp
    from preft_jax.loading.default_model import resolve_model_path
    from preft_jax.loading.files import load_model
    from preft_jax.loading.hf_safetensors import load_hf_sharded

    dt = np.dtype(jnp.dtype(dtype))
    p = resolve_model_path(path)
    if p.is_dir():
        return load_hf_sharded(p, lambda cfg: param_shardings(cfg, mesh, dt), dt, progress)
    cfg, params, tok = load_model(p, cache=cache, progress=progress)
    placement = param_shardings(cfg, mesh, dt)
    return cfg, {k: jax.device_put(np.asarray(params.pop(k), dt), placement[k]) for k in list(params)}, tok
