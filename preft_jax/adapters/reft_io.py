"""Read and write ReFT adapters in preft_jax's own folder format, and detect an adapter folder's kind.

A ReFT folder holds
    reft_config.json        {"preft_format": "reft", "format_version": 1, "kind", "rank", "layers",
                             "n_layers", "d_model", "policy": {"mode", "first_k", "last_k"}}
    reft_model.safetensors  layers.{i}.R [rank, d_model], layers.{i}.W [rank, d_model], layers.{i}.b [rank]
                            for every configured layer i (no other tensors)
In memory the weights are canonical (see `preft_jax.adapters.config`): stacked over all model layers,
zeros in layers without an intervention.
"""
from __future__ import annotations

import os
import pathlib

import numpy as np

from preft_jax.adapters.config import REFT_KINDS, LoraWeights, ReftConfig, ReftWeights
from preft_jax.adapters.policy import PositionPolicy
from preft_jax.adapters.peft_io import (PEFT_CONFIG_NAME, AdapterFileNotFoundError, AdapterFormatError,
                                        _as_int, _check_folder, _policy_from_json, _policy_to_json, _read_json,
                                        _read_safetensors, _write_json, _write_safetensors, load_peft_lora)
from preft_jax.config import ModelConfig

__all__ = ["save_reft", "load_reft", "load_adapter", "adapter_kind", "REFT_CONFIG_NAME", "REFT_WEIGHTS_NAME",
           "REFT_FORMAT_VERSION"]

REFT_CONFIG_NAME = "reft_config.json"
REFT_WEIGHTS_NAME = "reft_model.safetensors"
REFT_FORMAT_VERSION = 1
_PARTS = ("R", "W", "b")


def save_reft(folder: str | os.PathLike, weights: ReftWeights) -> None:
    """Write `weights` (canonical, stacked over all layers) as a ReFT adapter folder.

    Only the configured layers are written; weights must be zero elsewhere (they would be lost).
    """
    cfg = weights.config
    R, W, b = (np.asarray(x) for x in (weights.R, weights.W, weights.b))
    if R.ndim != 3:
        raise ValueError(f"ReftWeights.R must be [n_layers, rank, d_model], got shape {R.shape}")
    n_layers, rank, d_model = R.shape
    for name, arr, expected in (("R", R, (n_layers, cfg.rank, d_model)), ("W", W, (n_layers, cfg.rank, d_model)),
                                ("b", b, (n_layers, cfg.rank))):
        if arr.shape != expected:
            raise ValueError(f"ReftWeights.{name} has shape {arr.shape}, expected {expected} (rank={cfg.rank})")
    layers = sorted(set(cfg.layers))
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"ReftConfig.layers {bad} out of range for weights stacked over {n_layers} layers")
    outside = [i for i in range(n_layers) if i not in layers]
    for name, arr in (("R", R), ("W", W), ("b", b)):
        if outside and np.any(arr[outside] != 0):
            raise ValueError(f"ReftWeights.{name} is non-zero in layer(s) outside config.layers {tuple(layers)}; "
                             f"those values would be lost on save")

    path = pathlib.Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise AdapterFormatError(f"Adapter path exists and is not a folder: {path}")
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in layers:
        tensors[f"layers.{i}.R"], tensors[f"layers.{i}.W"], tensors[f"layers.{i}.b"] = R[i], W[i], b[i]
    _write_safetensors(path / REFT_WEIGHTS_NAME, tensors)
    _write_json(path / REFT_CONFIG_NAME, {
        "preft_format": "reft", "format_version": REFT_FORMAT_VERSION, "kind": cfg.kind, "rank": cfg.rank,
        "layers": layers, "n_layers": n_layers, "d_model": d_model, "policy": _policy_to_json(cfg.policy),
    })


def load_reft(folder: str | os.PathLike, model_config: ModelConfig,
              policy: PositionPolicy | None = None) -> ReftWeights:
    """ReftWeights (canonical float32, stacked over all layers) from a folder written by save_reft.

    `policy`, when given, overrides the stored position policy.
    """
    path = _check_folder(folder)
    cfg_path, st_path = path / REFT_CONFIG_NAME, path / REFT_WEIGHTS_NAME
    if not cfg_path.is_file():
        raise AdapterFileNotFoundError(f"Missing {REFT_CONFIG_NAME} in {path} (not a ReFT adapter folder?)")
    where = str(cfg_path)
    data = _read_json(cfg_path)
    for key in ("format_version", "kind", "rank", "layers", "policy"):
        if key not in data:
            raise AdapterFormatError(f"{where}: missing required key {key!r}")
    if data.get("preft_format", "reft") != "reft":
        raise AdapterFormatError(f"{where}: preft_format is {data['preft_format']!r}, expected 'reft'")
    if data["format_version"] != REFT_FORMAT_VERSION:
        raise AdapterFormatError(f"{where}: unsupported format_version {data['format_version']!r} "
                                 f"(this preft_jax reads version {REFT_FORMAT_VERSION})")
    kind = data["kind"]
    if kind not in REFT_KINDS:
        raise AdapterFormatError(f"{where}: unknown ReFT kind {kind!r}; supported: {list(REFT_KINDS)}")
    rank = _as_int(data["rank"], "rank", where)
    if not 0 < rank <= model_config.d_model:
        raise AdapterFormatError(f"{where}: rank must be in [1, d_model={model_config.d_model}], got {rank}")
    if not isinstance(data["layers"], list) or not data["layers"]:
        raise AdapterFormatError(f"{where}: layers must be a non-empty list of layer indices, got {data['layers']!r}")
    layers = [_as_int(i, "layers entry", where) for i in data["layers"]]
    n, d = model_config.n_layers, model_config.d_model
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise AdapterFormatError(f"{where}: layer index {bad} out of range for a model with {n} layers")
    if len(set(layers)) != len(layers):
        raise AdapterFormatError(f"{where}: duplicate layer indices in {layers}")
    for key, mine in (("n_layers", n), ("d_model", d)):
        if key in data and data[key] != mine:
            raise AdapterFormatError(f"{where}: adapter was saved for a model with {key}={data[key]!r}, "
                                     f"this model has {key}={mine}")
    stored_policy = _policy_from_json(data["policy"], where)

    tensors = _read_safetensors(st_path)
    expected = {f"layers.{i}.{p}": ((rank, d) if p != "b" else (rank,)) for i in layers for p in _PARTS}
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise AdapterFormatError(f"{st_path}: unexpected tensor(s) {unexpected[:5]}"
                                 f"{' ...' if len(unexpected) > 5 else ''}; expected layers.{{i}}.R/W/b for "
                                 f"configured layers {sorted(layers)}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise AdapterFormatError(f"{st_path}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    out = {"R": np.zeros((n, rank, d), np.float32), "W": np.zeros((n, rank, d), np.float32),
           "b": np.zeros((n, rank), np.float32)}
    for name, shape in expected.items():
        arr = tensors[name]
        if tuple(arr.shape) != shape:
            raise AdapterFormatError(f"{st_path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape} "
                                     f"(rank={rank}, d_model={d})")
        _, i, p = name.split(".")
        out[p][int(i)] = arr
    config = ReftConfig(rank=rank, layers=tuple(layers), kind=kind,
                        policy=stored_policy if policy is None else policy)
    return ReftWeights(config=config, R=out["R"], W=out["W"], b=out["b"])


def adapter_kind(folder: str | os.PathLike) -> str:
    """'lora' (PEFT adapter_config.json), 'reft' (preft_jax reft_config.json) or 'pyreft' (a pyreft/pyvene
    intervention folder: config.json with representations + intervention_types) for an adapter folder."""
    from preft_jax.adapters.pyreft_io import is_pyreft_folder

    path = _check_folder(folder)
    found = [kind for kind, present in (("lora", (path / PEFT_CONFIG_NAME).is_file()),
                                        ("reft", (path / REFT_CONFIG_NAME).is_file()),
                                        ("pyreft", is_pyreft_folder(path))) if present]
    if len(found) > 1:
        raise AdapterFormatError(f"{path} holds both {' and '.join(found)} adapter files; load it with "
                                 f"load_peft_lora, load_reft or load_pyreft explicitly")
    if found:
        return found[0]
    from preft_jax.adapters import orbax_io
    if orbax_io.is_orbax_checkpoint(path):          # a training run, its checkpoints folder, or one step
        return orbax_io.checkpoint_adapter_kind(path)
    raise AdapterFileNotFoundError(f"{path} is not an adapter folder: neither {PEFT_CONFIG_NAME} (PEFT LoRA) nor "
                                   f"{REFT_CONFIG_NAME} (preft_jax ReFT) nor a pyreft/pyvene config.json found, "
                                   f"nor an Orbax training checkpoint")


def load_adapter(folder: str | os.PathLike, model_config: ModelConfig,
                 policy: PositionPolicy | None = None) -> LoraWeights | ReftWeights:
    """Load whichever adapter a folder holds: LoraWeights for PEFT LoRA, ReftWeights for preft_jax ReFT or a
    pyreft LoReFT/DiReFT folder; for an Orbax training run / checkpoints folder (latest step) or step
    folder, the trained adapter. `policy`, when given, overrides the stored / default position policy."""
    from preft_jax.adapters import orbax_io
    if orbax_io.is_orbax_checkpoint(folder):
        w = orbax_io.load_orbax_adapter(folder, model_config)
        if policy is not None:
            import dataclasses
            w = dataclasses.replace(w, config=dataclasses.replace(w.config, policy=policy))
        return w
    kind = adapter_kind(folder)
    if kind == "lora":
        return load_peft_lora(folder, model_config, policy=policy)
    if kind == "reft":
        return load_reft(folder, model_config, policy=policy)
    from preft_jax.adapters.pyreft_io import load_pyreft
    return load_pyreft(folder, model_config, positions=policy)
