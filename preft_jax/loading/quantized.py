"""Quantized base weights from a model path: `preft_jax.quantize.quantize_params`, with the tensors a
GGUF file already stores in a QArray layout (int8: Q8_0, int4: Q4_0; the embedding / LM head: Q8_0)
read as they are instead of requantized from their float round trip.

    params = quantize_model_params(cfg, params, "int4", dtype, path)   # path: the file params came from
"""
from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp

from preft_jax import quantize as quant
from preft_jax.loading.default_model import resolve_model_path


def gguf_source(path) -> pathlib.Path | None:
    """The resolved model path when it is a GGUF file (None: the default SmolLM2 GGUF), else None."""
    p = resolve_model_path(path)
    if not p.is_file():
        return None
    with open(p, "rb") as f:
        return p if f.read(4) == b"GGUF" else None


def direct_tensors(path: str | os.PathLike, cfg, config, names) -> dict:
    """{canonical name: (mode, (values, scales))} of the params in `names` that the GGUF file at
    `path` stores in the block type `config` quantizes them to (`quant.direct_types`)."""
    from preft_jax.loading.gguf_loader import read_direct
    modes = quant.direct_types(config, names)
    by_type: dict[str, list] = {}
    for name, (_, block) in modes.items():
        by_type.setdefault(block, []).append(name)
    out = {}
    for block, wanted in by_type.items():
        out.update({n: (modes[n][0], v) for n, v in read_direct(path, cfg, block, wanted).items()})
    return out


def quantize_model_params(cfg, params: dict, config, dtype=jnp.float32,
                          path: str | os.PathLike | None = None) -> dict:
    """`quant.quantize_params` of params loaded from `path` (a .gguf file, an HF folder, None: the
    default GGUF): a GGUF file's tensors already in the target layout are taken as they are."""
    if quant.QuantConfig.parse(config) is None:
        return params
    quant.require_qwix()                  # before reading any block
    src = gguf_source(path)
    direct = {} if src is None else direct_tensors(src, cfg, config, list(params))
    return quant.quantize_params(cfg, params, config, dtype, direct=direct)
