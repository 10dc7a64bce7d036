"""Load an HF transformers Llama / Mistral / Qwen2 model folder into (ModelConfig, canonical params, Tokenizer).

The folder holds `config.json`, `model.safetensors` (or shards listed in `model.safetensors.index.json`),
and `tokenizer.json` (+ `tokenizer_config.json` / `chat_template.jinja`). Safetensors files are read
with a small parser (numpy has no bfloat16, so BF16 is widened to float32 bitwise, or kept as is for
a bfloat16 target) that reads only the bytes a requested slice covers.

`HFCheckpoint` opens a folder: config, tokenizer, and where every canonical parameter's tensors are,
checked (unknown, missing, mis-shaped tensors) before any weight is read. Two ways to read it:

* `load_hf_folder`: every canonical parameter as one host numpy array (the whole model in host memory).
* `load_hf_sharded`: every parameter straight into its mesh sharding, device shard by device shard:
  each addressable device's slice of the stacked [n_layers, ...] array is read layer by layer from
  the shards' files (only the rows / columns that slice covers) and put on its device, so host memory
  holds one device shard at a time, never the model, and each process of a multi-host run reads
  only what its own devices hold.
"""
from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Any, Iterator

import numpy as np

from preft_jax.config import ModelConfig, RopeScaling
from preft_jax.loading.progress import progress_bar
from preft_jax.loading.weight_names import HF_IGNORED, HF_RULES, LAYERED, ParamAssembler
from preft_jax.tokenizer import Tokenizer

# model_type -> (HF architecture class, q/k/v projections have biases)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", False),      # Llama 1/2/3.x (llama3 rope scaling), SmolLM2, ...
    "mistral": ("MistralForCausalLM", False),  # without sliding-window attention
    "qwen2": ("Qwen2ForCausalLM", True),       # Qwen2 / Qwen2.5 (q/k/v biases)
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


# ---------------------------------------------------------------------------------------- safetensors
class SafetensorsFile:
    """Minimal memory-mapped safetensors reader returning numpy arrays (BF16 -> float32)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"{self.path} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > 100_000_000:
                raise ValueError(f"{self.path} is not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path} is not a safetensors file: bad header ({e})") from e
        self._data_start = 8 + n
        header.pop("__metadata__", None)
        self.header: dict[str, dict] = header
        self._mm = None

    def keys(self) -> list[str]:
        return list(self.header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def _dtype(self, name: str) -> str:
        dt = self.header[name]["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {dt}")
        return dt

    def get(self, name: str) -> np.ndarray:
        """The whole tensor, memory-mapped (BF16 widened to float32)."""
        info = self.header[name]
        dt = self._dtype(name)
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._mm[self._data_start + begin: self._data_start + end]
        arr = raw.view(_ST_DTYPES[dt]).reshape(info["shape"])
        if dt == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        return arr

    def read(self, name: str, index: tuple[slice, ...] | None = None, dtype=np.float32) -> np.ndarray:
        """A copy of tensor[index] (basic slices, step 1) in `dtype`, reading only the rows the slice
        covers through a mapping that is closed before returning (the process keeps no file pages).
        BF16 is widened to float32 bitwise, or kept as is when `dtype` is bfloat16."""
        info = self.header[name]
        dt, shape = self._dtype(name), tuple(info["shape"])
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        target = np.dtype(dtype)
        if not shape or any(b <= a for a, b in bounds):
            return np.zeros([max(0, b - a) for a, b in bounds], target)
        r0, r1 = bounds[0]
        item = np.dtype(_ST_DTYPES[dt]).itemsize
        row = item * int(np.prod(shape[1:], dtype=np.int64))
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + info["data_offsets"][0] + r0 * row,
                       shape=((r1 - r0) * row,))
        try:
            raw = mm.view(_ST_DTYPES[dt]).reshape((r1 - r0,) + shape[1:])[(slice(None),)
                                                                           + tuple(slice(a, b) for a, b in bounds[1:])]
            if dt == "BF16":
                if target == _bfloat16():
                    return raw.view(target).copy()
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
            return raw.astype(target, copy=True)
        finally:
            del mm


def _bfloat16() -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def _safetensors_files(folder: pathlib.Path) -> list[pathlib.Path]:
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        paths = [folder / name for name in files]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"Shard(s) listed in {index} are missing: {missing}")
        return paths
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors"))
    if others:
        return others
    raise FileNotFoundError(f"No model.safetensors, model.safetensors.index.json or *.safetensors in {folder}")


def iter_safetensors(folder: str | os.PathLike) -> Iterator[tuple[str, SafetensorsFile]]:
    """(tensor name, file holding it) for every tensor of the folder's checkpoint."""
    for path in _safetensors_files(pathlib.Path(folder)):
        st = SafetensorsFile(path)
        for name in st.keys():
            yield name, st


# --------------------------------------------------------------------------------------------- config
def _rope_fields(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = hf.get("rope_parameters") or {}          # transformers >= 5
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params else None)
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "llama3":
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    raise ValueError(f"Unsupported rope scaling type {rope_type!r} (supported: default, llama3)")


def check_architecture(hf: dict[str, Any]) -> str:
    """The config's model_type if supported; otherwise a ValueError naming it and the supported ones."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        supported = ", ".join(f"{t} ({a})" for t, (a, _) in ARCHITECTURES.items())
        raise ValueError(f"Unsupported model architecture: model_type={model_type!r}, "
                         f"architectures={hf.get('architectures')}; supported model types: {supported}")
    return model_type


def config_from_hf(hf: dict[str, Any], tokenizer: Tokenizer | None = None,
                   has_lm_head: bool | None = None) -> ModelConfig:
    """ModelConfig from a parsed HF `config.json` (Llama, Mistral and Qwen2 families)."""
    model_type = check_architecture(hf)
    qkv_bias = ARCHITECTURES[model_type][1]
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"config.json sets {flag}=true; biased {model_type} projections are not supported")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"Unsupported hidden_act {act!r} (only silu)")
    _check_sliding_window(hf, model_type)
    if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"Partial rotary embeddings (partial_rotary_factor={hf['partial_rotary_factor']}) "
                         f"are not supported")
    d = int(hf["hidden_size"])
    n_heads = int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or d // n_heads)
    theta, scaling = _rope_fields(hf)
    if "tie_word_embeddings" in hf:
        tie = bool(hf["tie_word_embeddings"])
    else:   # LlamaConfig's default is untied; fall back to what the checkpoint holds
        tie = has_lm_head is False
    bos = hf.get("bos_token_id")
    eos: tuple[int, ...]
    if tokenizer is not None:
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos
        eos = tokenizer.eos_token_ids
    else:
        e = hf.get("eos_token_id")
        eos = tuple(e) if isinstance(e, list) else (() if e is None else (int(e),))
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=int(hf["intermediate_size"]),
        rope_theta=theta, rms_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=tie,
        max_seq_len=int(hf.get("max_position_embeddings", 8192)), rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos), eos_token_ids=tuple(int(i) for i in eos),
        qkv_bias=qkv_bias,
    )


def _check_sliding_window(hf: dict[str, Any], model_type: str) -> None:
    """Reject configs where some layer really attends through a window shorter than the context."""
    window = hf.get("sliding_window")
    if window is None or window >= hf.get("max_position_embeddings", 0):
        return
    if model_type == "qwen2":   # Qwen2 stores a window but only uses it with use_sliding_window=true
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            sliding = "sliding_attention" in layer_types
        else:
            sliding = bool(hf.get("use_sliding_window")) and \
                int(hf.get("max_window_layers", hf["num_hidden_layers"])) < int(hf["num_hidden_layers"])
        if not sliding:
            return
    raise ValueError(f"Sliding-window attention (sliding_window={window}) is not supported")


class HFCheckpoint:
    """An HF model folder, opened: `cfg`, `tokenizer`, and the tensor behind every canonical parameter
    (and layer), checked against the config before any weight is read (unknown names, q/k/v biases the
    architecture does not have, shapes, layer indices, completeness)."""

    def __init__(self, folder: str | os.PathLike):
        folder = pathlib.Path(folder).expanduser()
        if not folder.exists():
            raise FileNotFoundError(f"Model folder does not exist: {folder}")
        if not folder.is_dir():
            raise ValueError(f"{folder} is not a folder (GGUF files go to load_gguf)")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"No config.json in {folder}")
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
        check_architecture(hf)
        self.folder = folder
        tensors = list(iter_safetensors(folder))
        self.tokenizer = Tokenizer.from_hf_folder(folder)
        self.cfg = config_from_hf(hf, self.tokenizer, has_lm_head=any(n == "lm_head.weight" for n, _ in tensors))
        asm = ParamAssembler(self.cfg, HF_RULES, HF_IGNORED, source=str(folder), allocate=False)
        self.shapes = asm.shapes
        self._sources: dict[str, dict] = {k: {} for k in self.shapes}     # canonical -> {layer: (file, name, T)}
        for name, st in tensors:
            hit = asm.locate(name, st.shape(name))
            if hit is not None:
                rule, layer = hit
                if rule.transform not in ("identity", "transpose"):
                    raise ValueError(f"{folder}: {name}: transform {rule.transform!r} cannot be read by slices")
                self._sources[rule.canonical][layer] = (st, name, rule.transform == "transpose")
        asm.check_complete()

    def read(self, canonical: str, index: tuple[slice, ...] | None = None, dtype=np.float32) -> np.ndarray:
        """canonical parameter[index] (basic slices) in `dtype`, assembled layer by layer from only the
        bytes it covers (a transposed weight's slice is read as the matching [out, in] region)."""
        shape = self.shapes[canonical]
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        bounds = [sl.indices(n)[:2] for sl, n in zip(index, shape)]
        out = np.empty([b - a for a, b in bounds], np.dtype(dtype))
        if canonical in LAYERED:
            (l0, l1), inner = bounds[0], [slice(a, b) for a, b in bounds[1:]]
            for i, layer in enumerate(range(l0, l1)):
                out[i] = self._read_one(canonical, layer, inner, dtype)
        else:
            out[...] = self._read_one(canonical, None, [slice(a, b) for a, b in bounds], dtype)
        return out

    def _read_one(self, canonical, layer, index, dtype):
        st, name, transposed = self._sources[canonical][layer]
        if transposed:
            return st.read(name, tuple(index[::-1]), dtype).T
        return st.read(name, tuple(index), dtype)


def load_hf_folder(folder: str | os.PathLike, dtype=np.float32, progress: bool | None = None
                   ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer]:
    """(config, canonical params as host numpy arrays, tokenizer) from an HF model folder (progress: a
    tqdm bar over the parameters; None = only when stderr is a terminal)."""
    ckpt = HFCheckpoint(folder)
    params = {name: ckpt.read(name, dtype=dtype)
              for name in progress_bar(list(ckpt.shapes), progress, desc=f"loading {ckpt.folder.name}", unit="param")}
    return ckpt.cfg, params, ckpt.tokenizer


def load_hf_sharded(folder: str | os.PathLike, shardings, dtype=np.float32, progress: bool | None = None):
    """(config, canonical params as jax.Arrays in their shardings, tokenizer), streamed: see the module
    docstring. `shardings(cfg) -> {canonical name: jax.sharding.Sharding}` (e.g.
    `preft_jax.loading.placement.param_shardings`); host memory peaks at about one device shard of
    the largest parameter."""
    import jax
    ckpt = HFCheckpoint(folder)
    placement = shardings(ckpt.cfg)
    params = {}
    for name in progress_bar(list(ckpt.shapes), progress, desc=f"loading {ckpt.folder.name}", unit="param"):
        params[name] = _stream(ckpt, name, placement[name], dtype, jax)
    return ckpt.cfg, params, ckpt.tokenizer


def _stream(ckpt: HFCheckpoint, name: str, sharding, dtype, jax):
    """One parameter as a global jax.Array: each distinct slice this process's devices hold is read
    once, put on those devices and dropped before the next is read."""
    shape = ckpt.shapes[name]
    groups: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))
        groups.setdefault(key, []).append(device)
    shards = {}
    for key, devices in groups.items():
        host = ckpt.read(name, tuple(slice(a, b) for a, b in key), dtype)
        for d in devices:
            shards[d] = jax.device_put(host, d)
        # device_put is asynchronous: wait for the copies before dropping the host slice, or a busy
        # host lets several slices pile up (the bound above is one slice in flight)
        jax.block_until_ready([shards[d] for d in devices])
        del host
    arrays = [shards[d] for d in sharding.addressable_devices_indices_map(shape)]
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
