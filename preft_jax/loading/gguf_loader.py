"""Load a llama.cpp GGUF file (Llama architecture) into (ModelConfig, canonical params, Tokenizer).

Quantized tensors (Q4_0/Q4_1/Q8_0/K-quants/...) are dequantized with `gguf.quants.dequantize`; the
result is float32 by default (any numpy dtype, e.g. `jnp.bfloat16`, may be requested).
`read_direct` reads Q8_0 / Q4_0 tensors as their integers and block scales instead (for the
quantized base of preft_jax.quantize: no float round trip).
"""
from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from preft_jax.config import ModelConfig
from preft_jax.loading.default_model import resolve_model_path
from preft_jax.loading.progress import progress_bar
from preft_jax.loading.weight_names import (GGUF_IGNORED, GGUF_RULES, LAYERED, TRANSFORMS, ParamAssembler,
                                            canonical_shapes, match_weight)
from preft_jax.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)


def _open_reader(path: pathlib.Path):
    import gguf

    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a GGUF file (use load_hf_folder for HF folders)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated / corrupt file
        size = path.stat().st_size
        raise ValueError(f"Could not parse GGUF file {path} ({size} bytes: truncated or damaged?): {e}") from e


def _field_value(field) -> Any:
    """Python value of a GGUF metadata field (lists for arrays)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if len(types) == 2:  # flat array of scalars: one 1-element part per item
            return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
        return field.contents()  # nested arrays
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


def read_gguf_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of an open `gguf.GGUFReader` as python values."""
    return {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def _scalar(meta: dict, key: str, default=None, required: bool = False):
    if key not in meta:
        if required:
            raise ValueError(f"GGUF metadata lacks required key {key!r}")
        return default
    v = meta[key]
    if isinstance(v, list):  # per-layer arrays (some files): accept only if uniform
        if len(set(v)) != 1:
            raise ValueError(f"GGUF metadata {key!r} varies per layer ({v}); not supported")
        v = v[0]
    return v


def config_from_gguf(meta: dict, tensor_shapes: dict[str, tuple[int, ...]],
                     tokenizer: Tokenizer | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata. `tensor_shapes` are numpy ([out, in]) shapes by tensor name."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    p = f"{arch}."
    d = int(_scalar(meta, p + "embedding_length", required=True))
    n_layers = int(_scalar(meta, p + "block_count", required=True))
    n_heads = int(_scalar(meta, p + "attention.head_count", required=True))
    n_kv = int(_scalar(meta, p + "attention.head_count_kv", n_heads))
    ffn = int(_scalar(meta, p + "feed_forward_length", required=True))
    head_dim = int(_scalar(meta, p + "attention.key_length", d // n_heads))
    v_dim = int(_scalar(meta, p + "attention.value_length", head_dim))
    if v_dim != head_dim:
        raise ValueError(f"GGUF key_length {head_dim} != value_length {v_dim}: not supported")
    rope_dim = int(_scalar(meta, p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"Partial rotary embeddings (rope.dimension_count={rope_dim}, head_dim={head_dim}) "
                         f"are not supported")
    scaling = _scalar(meta, p + "rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensor_shapes:
        raise ValueError(
            f"GGUF rope scaling ({scaling or 'rope_freqs.weight tensor, i.e. llama3 scaling'}) is not "
            f"supported by the GGUF loader; load the HF safetensors folder instead")
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab = int(tensor_shapes["token_embd.weight"][0])
    n_tokens = meta.get("tokenizer.ggml.tokens")
    if n_tokens is not None and len(n_tokens) > vocab:
        raise ValueError(f"GGUF tokenizer has {len(n_tokens)} tokens but the embedding only {vocab} rows")
    bos = tokenizer.bos_token_id if tokenizer is not None else meta.get("tokenizer.ggml.bos_token_id")
    if tokenizer is not None:
        eos = tokenizer.eos_token_ids
    else:
        e = meta.get("tokenizer.ggml.eos_token_id")
        eos = () if e is None else (int(e),)
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, ffn_dim=ffn,
        rope_theta=float(_scalar(meta, p + "rope.freq_base", 10000.0)),
        rms_eps=float(_scalar(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_shapes,
        max_seq_len=int(_scalar(meta, p + "context_length", 2048)),
        rope_scaling=None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(int(i) for i in eos),
    )


def load_gguf_tokenizer(path: str | os.PathLike | None = None, *, hf_compat: bool = False) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no tensor data is read). See Tokenizer.from_gguf_metadata."""
    reader = _open_reader(resolve_model_path(path))
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(reader), hf_compat=hf_compat)


def load_gguf(path: str | os.PathLike | None = None, dtype=np.float32, progress: bool | None = None
              ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """(config, canonical params, tokenizer) from a GGUF file; `None` loads the default SmolLM2 GGUF.

    progress: show a tqdm bar while dequantizing (None: only when stderr is a terminal). Not cached;
    `preft_jax.loading.load_model` caches the result.
    """
    import gguf.quants

    path = resolve_model_path(path)
    reader = _open_reader(path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape.tolist())) for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    cfg = config_from_gguf(meta, shapes, tokenizer)

    asm = ParamAssembler(cfg, GGUF_RULES, GGUF_IGNORED, dtype=dtype, source=str(path))
    wanted = [t for t in reader.tensors if asm.wants(t.name)]
    for t in progress_bar(wanted, progress, desc=f"dequantizing {path.name}", unit="tensor"):
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        asm.add(t.name, np.asarray(arr, dtype=np.float32).reshape(shapes[t.name]))
    params = asm.finish()
    return cfg, params, tokenizer


# ----------------------------------------------------------------------------- integer blocks
BLOCK_LAYOUTS = {"Q8_0": 34, "Q4_0": 18}      # bytes per block of 32 values: f16 scale + the values
BLOCK = 32


def _blocks(data: np.ndarray, type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 / Q4_0 tensor's raw bytes [rows, n_blocks * block bytes] -> (values int8 [rows, cols],
    scales float32 [rows, cols / 32]) with row value j = values[j] * scales[j // 32] (ggml's math:
    Q8_0 w = d * q; Q4_0 w = d * (q - 8), the nibbles of byte i holding values i and i + 16)."""
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_LAYOUTS[type_name])
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    body = blocks[..., 2:]
    if type_name == "Q8_0":
        values = body.copy().view(np.int8)
    else:
        values = np.concatenate([body & 0x0F, body >> 4], axis=-1).astype(np.int8) - 8
    return values.reshape(rows, -1), scales


def read_direct(path: str | os.PathLike | None, cfg: ModelConfig, type_name: str, names) -> dict:
    """{canonical name: (values int8, scales float32)} of the canonical params in `names` whose every
    GGUF tensor is stored as `type_name` ("Q8_0" or "Q4_0"), in canonical orientation: values have
    the param's canonical shape ([L, d_in, d_out], embed [V, d]), scales the same with the input
    (contraction) dimension divided by 32. Params stored in any other type are left out."""
    import gguf

    if type_name not in BLOCK_LAYOUTS:
        raise ValueError(f"direct GGUF reads take {tuple(BLOCK_LAYOUTS)}, got {type_name!r}")
    path = resolve_model_path(path)
    reader = _open_reader(path)
    want = gguf.GGMLQuantizationType[type_name]
    shapes = canonical_shapes(cfg)
    names = [n for n in names if n in shapes]
    types: dict[str, set] = {}
    parts: dict[str, dict] = {}
    for t in reader.tensors:
        hit = match_weight(t.name, GGUF_RULES, GGUF_IGNORED)
        if hit is None or hit[0].canonical not in names:
            continue
        rule, layer = hit
        types.setdefault(rule.canonical, set()).add(t.tensor_type)
        if t.tensor_type != want:
            continue
        values, scales = _blocks(t.data, type_name)
        transform = TRANSFORMS[rule.transform]      # [out, in] -> canonical; the same on the scale rows
        parts.setdefault(rule.canonical, {})[layer] = (transform(values, cfg), transform(scales, cfg))
    out = {}
    for name, got in parts.items():
        if types[name] != {want}:
            continue                                  # mixed types: the caller requantizes this one
        if name in LAYERED:
            if sorted(got) != list(range(cfg.n_layers)):
                raise ValueError(f"{path}: {name} has layers {sorted(got)}, expected 0..{cfg.n_layers - 1}")
            values = np.stack([got[i][0] for i in range(cfg.n_layers)])
            scales = np.stack([got[i][1] for i in range(cfg.n_layers)])
        else:
            values, scales = got[None]
        if values.shape != shapes[name]:
            raise ValueError(f"{path}: {name} reads as {values.shape}, expected {shapes[name]} from the config")
        out[name] = (values, scales)
    return out
