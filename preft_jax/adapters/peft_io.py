"""Read and write HF PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`).

PEFT stores, per adapted Linear, `lora_A.weight` [r, d_in] and `lora_B.weight` [d_out, r] (torch's
"W @ x" orientation) under keys such as

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
    base_model.model.model.layers.{i}.mlp.down_proj.lora_B.weight

The canonical in-memory layout (see `preft_jax.adapters.config`) is "x @ W" and stacked over every
layer, so A[t] = stack(lora_A.weight.T) [n_layers, d_in, r], B[t] = stack(lora_B.weight.T)
[n_layers, r, d_out]; layers the adapter does not touch hold zeros.

Which modules an adapter touches is resolved from `adapter_config.json` the same way PEFT does
(`target_modules` list / regex / "all-linear", `exclude_modules`, `layers_to_transform`,
`layers_pattern`), and the tensors in the file must match that set exactly.

The adapter's PositionPolicy travels in a small `preft_policy.json` sidecar that PEFT ignores. An
activated (aLoRA) policy is also PEFT's own field: `alora_invocation_tokens` in adapter_config.json
(read into `PositionPolicy(mode="activated", invocation_tokens=...)`, written back on save), so PEFT
loads a saved activated adapter as aLoRA.

Neither torch nor peft is imported here: safetensors files are parsed directly (numpy has no
bfloat16, so BF16 is widened to float32 bitwise) and written with `safetensors.numpy`.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import re
import struct
from typing import Any, Mapping

import numpy as np

from preft_jax.adapters import policy as position_policy
from preft_jax.adapters.config import LORA_TARGETS, LoraConfig, LoraWeights
from preft_jax.adapters.policy import PositionPolicy
from preft_jax.config import ModelConfig

__all__ = [
    "AdapterFormatError", "AdapterFileNotFoundError", "UnsupportedAdapterError",
    "load_peft_lora", "save_peft_lora",
    "PEFT_CONFIG_NAME", "PEFT_WEIGHTS_NAME", "POLICY_NAME", "PEFT_MODULES",
]

PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
POLICY_NAME = "preft_policy.json"
POLICY_FORMAT_VERSION = 1

# short target name -> (parent module, HF module name) inside a Llama decoder layer
PEFT_MODULES: dict[str, tuple[str, str]] = {
    "q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
    "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
    "down": ("mlp", "down_proj"),
}
_SHORT_OF_PROJ = {proj: short for short, (_, proj) in PEFT_MODULES.items()}
_SUPPORTED_PROJS = tuple(proj for _, proj in PEFT_MODULES.values())


# ------------------------------------------------------------------------------------------ errors
class AdapterFormatError(ValueError):
    """An adapter folder or file is malformed, or does not fit the model it is loaded for."""


class AdapterFileNotFoundError(AdapterFormatError, FileNotFoundError):
    """An adapter folder or a file it must hold does not exist."""


class UnsupportedAdapterError(AdapterFormatError, NotImplementedError):
    """A well-formed adapter uses a feature preft_jax does not implement (DoRA, per-module ranks, ...)."""


# ----------------------------------------------------------------------------- shared file helpers
def _check_folder(folder: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(folder).expanduser()
    if not path.exists():
        raise AdapterFileNotFoundError(f"Adapter folder does not exist: {path}")
    if not path.is_dir():
        raise AdapterFormatError(f"Adapter path is not a folder: {path}")
    return path


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        raise AdapterFileNotFoundError(f"Missing {path.name} in {path.parent}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise AdapterFormatError(f"{path} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise AdapterFormatError(f"{path} is not valid UTF-8 JSON: {e}") from e
    except (RecursionError, ValueError) as e:     # absurd nesting, 5000-digit integers, ...
        raise AdapterFormatError(f"{path} is not a JSON file preft_jax can read: {type(e).__name__}") from e
    if not isinstance(data, dict):
        raise AdapterFormatError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _write_json(path: pathlib.Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}
_ST_FLOATS = ("F64", "F32", "F16", "BF16")


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a float32 numpy array (float dtypes only)."""
    if not path.is_file():
        raise AdapterFileNotFoundError(f"Missing {path.name} in {path.parent}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise AdapterFormatError(f"{path} is not a safetensors file (only {len(head)} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100_000_000):
            raise AdapterFormatError(f"{path} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterFormatError(f"{path} is not a safetensors file: bad header ({e})") from e
        if not isinstance(header, dict):
            raise AdapterFormatError(f"{path} is not a safetensors file: header is not a JSON object")
        header.pop("__metadata__", None)
        data_start = 8 + n
        out: dict[str, np.ndarray] = {}
        for name, info in header.items():
            try:
                dt, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
                if not all(type(v) is int and v >= 0 for v in [*shape, begin, end]) or len(shape) > 8:
                    raise ValueError("shape and data_offsets must be non-negative integers")
            except (KeyError, TypeError, ValueError) as e:
                raise AdapterFormatError(f"{path}: malformed header entry for tensor {name!r}: {info!r}"[:400]) from e
            if dt not in _ST_DTYPES:
                raise AdapterFormatError(f"{path}: tensor {name!r} has unknown dtype {dt}")
            if dt not in _ST_FLOATS:
                raise AdapterFormatError(f"{path}: tensor {name!r} has non-float dtype {dt}")
            itemsize = np.dtype(_ST_DTYPES[dt]).itemsize
            if not (0 <= begin <= end and data_start + end <= size) or end - begin != math.prod(shape) * itemsize:
                raise AdapterFormatError(f"{path}: tensor {name!r} has inconsistent data offsets "
                                         f"{[begin, end]} for shape {shape} {dt} (file truncated?)")
            f.seek(data_start + begin)
            arr = np.frombuffer(f.read(end - begin), dtype=_ST_DTYPES[dt]).reshape(shape)
            if dt == "BF16":
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            out[name] = np.array(arr, dtype=np.float32)
    return out


def _write_safetensors(path: pathlib.Path, tensors: Mapping[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    os.replace(tmp, path)


_policy_to_json = position_policy.to_json


def _policy_from_json(data: Any, where: str) -> PositionPolicy:
    """`policy.from_json` with its errors as AdapterFormatError (the adapter readers' error type)."""
    try:
        return position_policy.from_json(data, where)
    except ValueError as e:
        raise AdapterFormatError(str(e)) from None


def _read_policy_sidecar(folder: pathlib.Path) -> PositionPolicy | None:
    path = folder / POLICY_NAME
    if not path.exists():
        return None
    data = _read_json(path)
    version = data.get("format_version")
    if version != POLICY_FORMAT_VERSION:
        raise AdapterFormatError(f"{path}: unsupported format_version {version!r} "
                                 f"(this preft_jax reads version {POLICY_FORMAT_VERSION})")
    if "policy" not in data:
        raise AdapterFormatError(f"{path}: missing required key 'policy'")
    return _policy_from_json(data["policy"], str(path))


def _write_policy_sidecar(folder: pathlib.Path, policy: PositionPolicy) -> None:
    _write_json(folder / POLICY_NAME, {"preft_format": "position_policy", "format_version": POLICY_FORMAT_VERSION,
                                       "policy": _policy_to_json(policy)})


def _as_int(value: Any, what: str, where: str) -> int:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value)) or value != int(value)):
        raise AdapterFormatError(f"{where}: {what} must be an integer, got {value!r}"[:400])
    return int(value)


# ----------------------------------------------------------------------- PEFT module-set resolution
def _module_key(prefix: str, layer: int, target: str) -> str:
    parent, proj = PEFT_MODULES[target]
    return f"{prefix}layers.{layer}.{parent}.{proj}"


def _matches_list(spec: list[str], key: str) -> bool:
    return key in spec or any(key.endswith(f".{s}") for s in spec)


def _as_name_list(value: Any, field: str, where: str) -> list[str] | str | None:
    """A PEFT module-name field: None, a (regex) string, or a list of names (sets arrive as lists)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise AdapterFormatError(f"{where}: {field} must be a string or a list of strings, got {value!r}")


def _resolve_targets(cfg: dict[str, Any], prefix: str, n_layers: int, where: str) -> dict[tuple[int, str], str]:
    """(layer, short target) -> module key, for every module the config adapts (PEFT's matching rules)."""
    targets = _as_name_list(cfg.get("target_modules"), "target_modules", where)
    if not targets:
        raise AdapterFormatError(f"{where}: target_modules is empty or missing")
    exclude = _as_name_list(cfg.get("exclude_modules"), "exclude_modules", where)

    layers_to_transform = cfg.get("layers_to_transform")
    if layers_to_transform is not None:
        if isinstance(layers_to_transform, (list, tuple)):
            layers_to_transform = [_as_int(i, "layers_to_transform entry", where) for i in layers_to_transform]
        else:
            layers_to_transform = [_as_int(layers_to_transform, "layers_to_transform", where)]
        bad = [i for i in layers_to_transform if not 0 <= i < n_layers]
        if bad:
            raise AdapterFormatError(f"{where}: layers_to_transform index {bad} out of range for a model "
                                     f"with {n_layers} layers")
        if not layers_to_transform:
            layers_to_transform = None
    layers_pattern = cfg.get("layers_pattern") or None
    if isinstance(layers_pattern, str):
        layers_pattern = [layers_pattern]

    all_keys = {(i, t): _module_key(prefix, i, t) for i in range(n_layers) for t in LORA_TARGETS}

    if isinstance(targets, str):
        if layers_to_transform is not None:
            raise AdapterFormatError(f"{where}: layers_to_transform cannot be used when target_modules is a "
                                     f"string (regex) {targets!r}")
        if targets == "all-linear":      # PEFT: every Linear but the output layer
            matched = dict(all_keys)
        elif targets in _SUPPORTED_PROJS:  # a single bare name (PEFT would regex-fullmatch; be lenient)
            matched = {k: v for k, v in all_keys.items() if v.endswith(f".{targets}")}
        else:
            try:
                rx = re.compile(targets)
            except re.error as e:
                raise AdapterFormatError(f"{where}: target_modules regex {targets!r} is invalid: {e}") from e
            matched = {k: v for k, v in all_keys.items() if rx.fullmatch(v)}
            if not matched:
                raise AdapterFormatError(f"{where}: target_modules regex {targets!r} matches none of the supported "
                                         f"modules {list(_SUPPORTED_PROJS)} (e.g. {all_keys[(0, 'q')]!r})")
    else:
        if "all-linear" in targets:
            raise AdapterFormatError(f"{where}: 'all-linear' must be the whole target_modules string, not a list item")
        unknown = [s for s in targets if not any(_matches_list([s], v) for v in all_keys.values())]
        if unknown:
            raise AdapterFormatError(f"{where}: unknown target module(s) {unknown}; supported: "
                                     f"{list(_SUPPORTED_PROJS)} (and 'all-linear')")
        matched = {k: v for k, v in all_keys.items() if _matches_list(targets, v)}
        if layers_to_transform is not None:
            keep = {}
            for (i, t), key in matched.items():
                if layers_pattern is None:
                    m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
                else:
                    m = None
                    for pat in layers_pattern:
                        m = re.match(rf"(?:^|.*?\.){pat}\.(?P<idx>\d+)\.", key)
                        if m is not None:
                            break
                if m is not None and int(m.group("idx")) in layers_to_transform:
                    keep[(i, t)] = key
            matched = keep

    if exclude:
        if isinstance(exclude, str):
            matched = {k: v for k, v in matched.items() if not re.fullmatch(exclude, v)}
        else:
            matched = {k: v for k, v in matched.items() if not _matches_list(exclude, v)}
    if not matched:
        raise AdapterFormatError(f"{where}: the adapter config targets no module of this model "
                                 f"(target_modules={cfg.get('target_modules')!r}, "
                                 f"layers_to_transform={cfg.get('layers_to_transform')!r})")
    return matched


def _uniform_pattern_value(pattern: Any, default: float, keys: list[str], field: str, where: str) -> float:
    """The single value a rank_pattern / alpha_pattern gives every adapted module (PEFT's get_pattern_key)."""
    if not pattern:
        return default
    if not isinstance(pattern, dict):
        raise AdapterFormatError(f"{where}: {field} must be a JSON object, got {pattern!r}")
    values: dict[float, list[str]] = {}
    for key in keys:
        value = default
        for pat, v in pattern.items():
            try:
                hit = re.match(rf"(.*\.)?({pat})$", key)
            except (re.error, TypeError) as e:
                raise AdapterFormatError(f"{where}: {field} key {pat!r} is not a valid regex: {e}"[:400]) from e
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise AdapterFormatError(f"{where}: {field} value for {pat!r} must be a finite number, got {v!r}"[:400])
            if hit:
                value = v
                break
        values.setdefault(value, []).append(key)
    if len(values) > 1:
        detail = ", ".join(f"{v} for {len(ks)} module(s) e.g. {ks[0]!r}" for v, ks in values.items())
        raise UnsupportedAdapterError(f"{where}: {field} gives adapted modules different values ({detail}); "
                                      f"preft_jax supports one {field.split('_')[0]} for every module")
    return next(iter(values))


# ----------------------------------------------------------------------------------- tensor names
_TENSOR_RE = re.compile(
    r"^(?P<prefix>(?:model\.)?)layers\.(?P<layer>\d+)\.(?P<parent>[A-Za-z_]+)\.(?P<proj>[A-Za-z_]+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


def _unexpected_hint(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return " (DoRA magnitude vector; DoRA is not supported)"
    if "modules_to_save" in name:
        return " (modules_to_save copy; only LoRA A/B tensors are supported)"
    if "lora_embedding" in name or "embed_tokens" in name or "lm_head" in name:
        return " (embedding / output-layer adapter; not supported)"
    if name.endswith(".bias"):
        return " (bias tensor; only bias='none' is supported)"
    return ""


def _fmt_list(items: list[str], n: int = 5) -> str:
    return ", ".join(repr(s) for s in items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _alora_policy(tokens: Any, model_config: ModelConfig, where: str) -> PositionPolicy | None:
    """adapter_config.json's `alora_invocation_tokens` -> the activated policy (None when absent)."""
    if tokens is None:
        return None
    if (not isinstance(tokens, list) or not tokens
            or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens)):
        raise AdapterFormatError(f"{where}: alora_invocation_tokens must be a non-empty list of token ids, "
                                 f"got {tokens!r}"[:400])
    bad = [t for t in tokens if not 0 <= t < model_config.vocab_size]
    if bad:
        raise AdapterFormatError(f"{where}: alora_invocation_tokens {bad[:5]} are outside this model's vocabulary "
                                 f"(0..{model_config.vocab_size - 1})")
    return PositionPolicy.activated(tokens)


# ------------------------------------------------------------------------------------------- load
def load_peft_lora(folder: str | os.PathLike, model_config: ModelConfig,
                   policy: PositionPolicy | None = None) -> LoraWeights:
    """LoraWeights (canonical, float32, stacked over all layers) from an HF PEFT LoRA adapter folder.

    `policy` overrides the position policy; when None, an aLoRA adapter (`alora_invocation_tokens` in
    adapter_config.json) gets its activated policy, others the `preft_policy.json` sidecar's if
    present, else PositionPolicy() (prefill mode).
    Raises AdapterFileNotFoundError / AdapterFormatError (ValueError) for missing or malformed files
    and UnsupportedAdapterError (also NotImplementedError) for PEFT features preft_jax lacks.
    """
    path = _check_folder(folder)
    cfg_path, st_path = path / PEFT_CONFIG_NAME, path / PEFT_WEIGHTS_NAME
    if not cfg_path.is_file():
        raise AdapterFileNotFoundError(f"Missing {PEFT_CONFIG_NAME} in {path} (not a PEFT adapter folder?)")
    where = str(cfg_path)
    cfg = _read_json(cfg_path)
    if not st_path.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterFormatError(f"{path} holds adapter_model.bin (pickled torch); only {PEFT_WEIGHTS_NAME} is "
                                     f"supported -- re-save it with PEFT's save_pretrained(safe_serialization=True)")
        raise AdapterFileNotFoundError(f"Missing {PEFT_WEIGHTS_NAME} in {path}")

    # ---- config fields
    for key in ("peft_type", "r", "lora_alpha", "target_modules"):
        if key not in cfg:
            raise AdapterFormatError(f"{where}: missing required key {key!r}")
    if cfg["peft_type"] != "LORA":
        raise AdapterFormatError(f"{where}: peft_type is {cfg['peft_type']!r}; only 'LORA' adapters are supported")
    r = _as_int(cfg["r"], "r", where)
    alpha = cfg["lora_alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise AdapterFormatError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if r <= 0:
        raise AdapterFormatError(f"{where}: r must be positive, got {r}")
    if not math.isfinite(alpha):
        raise AdapterFormatError(f"{where}: lora_alpha must be finite, got {alpha!r}")
    use_rslora = cfg.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterFormatError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")

    if cfg.get("use_dora"):
        raise UnsupportedAdapterError(f"{where}: use_dora=true (DoRA) is not supported; only plain LoRA")
    if cfg.get("bias", "none") != "none":
        raise UnsupportedAdapterError(f"{where}: bias={cfg['bias']!r} is not supported; only bias='none'")
    if cfg.get("lora_bias"):
        raise UnsupportedAdapterError(f"{where}: lora_bias=true is not supported")
    if cfg.get("modules_to_save"):
        raise UnsupportedAdapterError(f"{where}: modules_to_save={cfg['modules_to_save']!r} is not supported "
                                      f"(only LoRA A/B tensors can be loaded)")
    for key, what in (("layer_replication", "layer replication"), ("target_parameters", "parameter targeting"),
                      ("trainable_token_indices", "trainable tokens")):
        if cfg.get(key):
            raise UnsupportedAdapterError(f"{where}: {key} ({what}) is not supported")
    alora = _alora_policy(cfg.get("alora_invocation_tokens"), model_config, where)

    # ---- tensors: parse names first (the module prefix they use decides what the config matches)
    tensors = _read_safetensors(st_path)
    if not tensors:
        raise AdapterFormatError(f"{st_path} holds no tensors")
    n_layers = model_config.n_layers
    parsed: dict[tuple[int, str, str], tuple[str, np.ndarray]] = {}
    unexpected: list[str] = []
    prefixes: set[str] = set()
    adapters: set[str | None] = set()
    for name, arr in tensors.items():
        short = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
        m = _TENSOR_RE.match(short)
        target = _SHORT_OF_PROJ.get(m.group("proj")) if m else None
        if m is None or target is None or PEFT_MODULES[target][0] != m.group("parent"):
            unexpected.append(name + _unexpected_hint(name))
            continue
        layer = int(m.group("layer"))
        if layer >= n_layers:
            raise AdapterFormatError(f"{st_path}: tensor {name!r} has layer index {layer}, out of range for a model "
                                     f"with {n_layers} layers")
        slot = (layer, target, m.group("ab"))
        if slot in parsed:
            raise AdapterFormatError(f"{st_path}: tensors {parsed[slot][0]!r} and {name!r} hold the same weight")
        parsed[slot] = (name, arr)
        prefixes.add(m.group("prefix"))
        adapters.add(m.group("adapter"))
    if unexpected:
        raise AdapterFormatError(f"{st_path}: unexpected tensor(s) {_fmt_list(unexpected)}; only LoRA lora_A/lora_B "
                                 f"weights of {list(_SUPPORTED_PROJS)} in decoder layers are supported")
    if len(prefixes) > 1:
        raise AdapterFormatError(f"{st_path}: tensors mix module prefixes {sorted(prefixes)} "
                                 f"('model.layers...' vs 'layers...')")
    if len(adapters) > 1:
        raise AdapterFormatError(f"{st_path}: tensors of several adapters {sorted(map(str, adapters))}; "
                                 f"one adapter per folder")

    # ---- which modules the config adapts; the tensors must be exactly those
    targeted = _resolve_targets(cfg, prefixes.pop(), n_layers, where)
    keys = list(targeted.values())
    r = _as_int(_uniform_pattern_value(cfg.get("rank_pattern"), r, keys, "rank_pattern", where), "rank", where)
    alpha = _uniform_pattern_value(cfg.get("alpha_pattern"), alpha, keys, "alpha_pattern", where)

    stray = sorted(name for (i, t, _), (name, _) in parsed.items() if (i, t) not in targeted)
    if stray:
        raise AdapterFormatError(f"{st_path}: tensor(s) {_fmt_list(stray)} belong to modules adapter_config.json "
                                 f"does not target (target_modules={cfg.get('target_modules')!r}, "
                                 f"layers_to_transform={cfg.get('layers_to_transform')!r})")
    missing = [f"{key}.lora_{ab}.weight" for (i, t), key in sorted(targeted.items())
               for ab in "AB" if (i, t, ab) not in parsed]
    if missing:
        raise AdapterFormatError(f"{st_path}: missing tensor(s) for targeted modules: {_fmt_list(missing)}")

    dims = model_config.projection_dims()
    if r <= 0 or not math.isfinite(float(alpha)) or isinstance(alpha, bool):
        raise AdapterFormatError(f"{where}: rank_pattern / alpha_pattern give an invalid rank {r} or alpha {alpha!r}")
    for (i, t, ab), (name, arr) in parsed.items():     # every shape checked before anything is allocated
        d_in, d_out = dims[t]
        expected = (r, d_in) if ab == "A" else (d_out, r)
        if tuple(arr.shape) != expected:
            raise AdapterFormatError(f"{st_path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {expected} "
                                     f"(r={r}, {t}: d_in={d_in}, d_out={d_out} for this model)")
    targets = tuple(t for t in LORA_TARGETS if any(tt == t for _, tt in targeted))
    A = {t: np.zeros((n_layers, dims[t][0], r), np.float32) for t in targets}
    B = {t: np.zeros((n_layers, r, dims[t][1]), np.float32) for t in targets}
    for (i, t, ab), (name, arr) in parsed.items():
        (A if ab == "A" else B)[t][i] = arr.T

    layer_set = sorted({i for i, _ in targeted})
    layers = None if layer_set == list(range(n_layers)) else tuple(layer_set)
    if policy is None:
        sidecar = _read_policy_sidecar(path)
        if alora is not None and sidecar is not None and sidecar != alora:
            raise AdapterFormatError(f"{path / POLICY_NAME} holds position policy {sidecar.describe()!r}, but "
                                     f"{where} makes it an aLoRA adapter ({alora.describe()})")
        if alora is None and sidecar is not None and sidecar.mode == "activated":
            raise AdapterFormatError(f"{path / POLICY_NAME} holds an activated policy, but {where} has no "
                                     f"alora_invocation_tokens (PEFT would load it as a plain LoRA)")
        policy = alora or sidecar or PositionPolicy()
    alpha = float(alpha)
    config = LoraConfig(rank=r, alpha=alpha, targets=targets, layers=layers, use_rslora=use_rslora, policy=policy)
    return LoraWeights(config=config, A=A, B=B)


# ------------------------------------------------------------------------------------------- save
def _check_lora_weights(weights: LoraWeights, model_config: ModelConfig) -> tuple[int, ...]:
    cfg, n = weights.config, model_config.n_layers
    dims = model_config.projection_dims()
    for name, table in (("A", weights.A), ("B", weights.B)):
        if set(table) != set(cfg.targets):
            raise ValueError(f"LoraWeights.{name} has targets {sorted(table)}, config.targets is {cfg.targets}")
    layers = tuple(range(n)) if cfg.layers is None else tuple(sorted(set(cfg.layers)))
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise ValueError(f"LoraConfig.layers {bad} out of range for a model with {n} layers")
    outside = [i for i in range(n) if i not in layers]
    for t in cfg.targets:
        d_in, d_out = dims[t]
        for name, arr, expected in (("A", weights.A[t], (n, d_in, cfg.rank)),
                                    ("B", weights.B[t], (n, cfg.rank, d_out))):
            if tuple(np.shape(arr)) != expected:
                raise ValueError(f"LoraWeights.{name}[{t!r}] has shape {tuple(np.shape(arr))}, expected {expected}")
            if outside and np.any(np.asarray(arr)[outside] != 0):
                raise ValueError(f"LoraWeights.{name}[{t!r}] is non-zero in layer(s) outside config.layers "
                                 f"{cfg.layers}; those values would be lost on save")
    return layers


def save_peft_lora(folder: str | os.PathLike, weights: LoraWeights, model_config: ModelConfig,
                   base_model_name_or_path: str = "") -> None:
    """Write `weights` as a PEFT-loadable LoRA adapter folder (+ the `preft_policy.json` sidecar).

    Only layers in `weights.config.layers` (all when None) are written; `layers_to_transform` is set
    when that is not every layer. Existing files of the same names are replaced.
    """
    layers = _check_lora_weights(weights, model_config)
    cfg = weights.config
    path = pathlib.Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise AdapterFormatError(f"Adapter path exists and is not a folder: {path}")
    path.mkdir(parents=True, exist_ok=True)

    tensors: dict[str, np.ndarray] = {}
    for i in layers:
        for t in cfg.targets:
            parent, proj = PEFT_MODULES[t]
            key = f"base_model.model.model.layers.{i}.{parent}.{proj}"
            tensors[f"{key}.lora_A.weight"] = np.asarray(weights.A[t][i], np.float32).T
            tensors[f"{key}.lora_B.weight"] = np.asarray(weights.B[t][i], np.float32).T
    alpha = int(cfg.alpha) if float(cfg.alpha).is_integer() else float(cfg.alpha)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": cfg.rank,
        "lora_alpha": alpha,
        "target_modules": [PEFT_MODULES[t][1] for t in LORA_TARGETS if t in cfg.targets],
        "layers_to_transform": list(layers) if len(layers) != model_config.n_layers else None,
        "layers_pattern": None,
        "use_rslora": cfg.use_rslora,
        "use_dora": False,
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
    }
    if cfg.policy.mode == "activated":         # PEFT's own aLoRA field: PEFT loads the folder as aLoRA
        adapter_config["alora_invocation_tokens"] = list(cfg.policy.invocation_tokens)
    _write_safetensors(path / PEFT_WEIGHTS_NAME, tensors)
    _write_json(path / PEFT_CONFIG_NAME, adapter_config)
    _write_policy_sidecar(path, cfg.policy)
