"""Adapters straight from Orbax training checkpoints: the checkpoint identity and the reader.

A training checkpoint (written by `train.checkpoint.Checkpointer`, one `ocp.CheckpointManager`
step folder) holds two items:

    <run>/checkpoints/<step>/state   the TrainState pytree (Orbax PyTree format):
                                     {"params": adapter params, "opt_state": ..., "step": ...}
    <run>/checkpoints/<step>/meta    JSON: {"step", "data_position", "config", ...} plus the
                                     identity below, which this module defines and the trainer writes

    identity = {"checkpoint_format": "preft_train", "format_version": 1,
                "adapter": {"type": "lora" | "reft", rank, ..., "policy": {...}},
                "model": {vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim}}

The adapter params are the trainable pytree of `preft_jax.adapters.trainable` (LoRA
{"A": {target}, "B": {target}}, ReFT {"R", "W", "b"}, stacked over all layers).
`load_orbax_adapter(path, model_cfg)` accepts a run folder (<run> with checkpoints/), the
checkpoints folder itself (picks the latest step) or one step folder, restores only the params
(as host numpy) and returns the same canonical LoraWeights / ReftWeights that exporting the
params (`train.checkpoint.export_adapter`) and loading the exported folder give.
Orbax is imported only when a checkpoint is read. A step folder is read as the composite checkpoint
`ocp.CheckpointManager` wrote (`_step_checkpointer`: the step-level handler with both items), the
current Orbax API train/checkpoint.py uses, so Orbax finds the step's metadata where it put it.
"""
from __future__ import annotations

import os
import pathlib
from typing import Any

import numpy as np

from preft_jax.adapters.config import LoraConfig, LoraWeights, ReftConfig, ReftWeights
from preft_jax.adapters.peft_io import (AdapterFileNotFoundError, AdapterFormatError, _as_int, _policy_from_json,
                                        _policy_to_json)
from preft_jax.config import ModelConfig

__all__ = ["CHECKPOINT_FORMAT", "FORMAT_VERSION", "STATE_ITEM", "META_ITEM", "PARAMS_KEY", "CHECKPOINTS_DIR",
           "adapter_config_to_json", "adapter_config_from_json", "model_signature", "checkpoint_identity",
           "check_identity", "checkpoint_adapter_kind", "is_orbax_checkpoint", "resolve_step", "read_meta", "load_orbax_adapter"]

CHECKPOINT_FORMAT = "preft_train"
FORMAT_VERSION = 1
STATE_ITEM, META_ITEM, PARAMS_KEY = "state", "meta", "params"
CHECKPOINTS_DIR = "checkpoints"          # <run>/checkpoints/<step>/
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim")


# ------------------------------------------------------------------------------------ identity
def adapter_config_to_json(config: LoraConfig | ReftConfig) -> dict[str, Any]:
    if isinstance(config, LoraConfig):
        return {"type": "lora", "rank": config.rank, "alpha": config.alpha, "targets": list(config.targets),
                "layers": None if config.layers is None else list(config.layers), "use_rslora": config.use_rslora,
                "policy": _policy_to_json(config.policy)}
    if isinstance(config, ReftConfig):
        return {"type": "reft", "kind": config.kind, "rank": config.rank, "layers": list(config.layers),
                "policy": _policy_to_json(config.policy)}
    raise TypeError(f"expected LoraConfig or ReftConfig, got {type(config).__name__}")


def adapter_config_from_json(d: Any, where: str = "checkpoint") -> LoraConfig | ReftConfig:
    if not isinstance(d, dict) or d.get("type") not in ("lora", "reft"):
        raise AdapterFormatError(f"{where}: adapter must be an object with type 'lora' or 'reft', got {d!r}")
    try:
        policy = _policy_from_json(d.get("policy"), where)
        rank = _as_int(d.get("rank"), "rank", where)
        layers = d.get("layers")
        layers = None if layers is None else tuple(_as_int(i, "layer", where) for i in layers)
        if d["type"] == "lora":
            return LoraConfig(rank=rank, alpha=float(d["alpha"]), targets=tuple(d["targets"]), layers=layers,
                              use_rslora=bool(d.get("use_rslora", False)), policy=policy)
        return ReftConfig(rank=rank, layers=layers, kind=d["kind"], policy=policy)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, AdapterFormatError):
            raise
        raise AdapterFormatError(f"{where}: invalid adapter config {d!r}: {e}") from None


def model_signature(cfg: ModelConfig) -> dict[str, int]:
    """The model dimensions an adapter's shapes depend on."""
    return {k: int(getattr(cfg, k)) for k in MODEL_FIELDS}


def checkpoint_identity(model_cfg: ModelConfig, adapter_config: LoraConfig | ReftConfig) -> dict[str, Any]:
    """The meta fields that say what a training checkpoint holds (written with every checkpoint)."""
    return {"checkpoint_format": CHECKPOINT_FORMAT, "format_version": FORMAT_VERSION,
            "adapter": adapter_config_to_json(adapter_config), "model": model_signature(model_cfg)}


def check_identity(meta: dict, model_cfg: ModelConfig, adapter_config: LoraConfig | ReftConfig | None = None,
                   where: str = "checkpoint") -> LoraConfig | ReftConfig:
    """The checkpoint's adapter config, after checking it was written for this model (and, when given,
    for this adapter config). AdapterFormatError naming every mismatch otherwise."""
    if meta.get("checkpoint_format") != CHECKPOINT_FORMAT or "adapter" not in meta or "model" not in meta:
        raise AdapterFormatError(f"{where}: not a preft_jax training checkpoint (its meta has no "
                                 f"checkpoint_format={CHECKPOINT_FORMAT!r} / adapter / model identity)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise AdapterFormatError(f"{where}: unsupported checkpoint format_version {meta.get('format_version')!r} "
                                 f"(this preft_jax reads version {FORMAT_VERSION})")
    theirs, mine = meta["model"], model_signature(model_cfg)
    diff = [f"{k}={theirs.get(k)!r} (this model: {mine[k]})" for k in MODEL_FIELDS if theirs.get(k) != mine[k]]
    if diff:
        raise AdapterFormatError(f"{where} was trained on another model: " + ", ".join(diff))
    stored = adapter_config_from_json(meta["adapter"], where)
    if adapter_config is not None and stored != adapter_config:
        a, b = adapter_config_to_json(stored), adapter_config_to_json(adapter_config)
        diff = [f"{k}={a.get(k)!r} (this run: {b.get(k)!r})" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        raise AdapterFormatError(f"{where} holds another adapter: " + ", ".join(diff))
    return stored


# ------------------------------------------------------------------------------------- layout
def _step_dirs(folder: pathlib.Path) -> list[pathlib.Path]:
    """Finalized step folders (Orbax writes into '<step>.orbax-checkpoint-tmp-*' and renames)."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if p.is_dir() and p.name.isdigit() and (p / STATE_ITEM).is_dir()),
                  key=lambda p: int(p.name))


def _is_step(path: pathlib.Path) -> bool:
    return (path / STATE_ITEM).is_dir() and (path / META_ITEM).is_dir()


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """True for a step folder, a checkpoints folder with step folders, or a run folder holding one."""
    p = pathlib.Path(path).expanduser()
    return p.is_dir() and (_is_step(p) or bool(_step_dirs(p)) or bool(_step_dirs(p / CHECKPOINTS_DIR)))


def resolve_step(path: str | os.PathLike) -> pathlib.Path:
    """The step folder `path` designates: itself, or the latest step of a checkpoints / run folder."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise AdapterFileNotFoundError(f"Checkpoint path does not exist: {p}")
    if _is_step(p):
        return p
    steps = _step_dirs(p) or _step_dirs(p / CHECKPOINTS_DIR)
    if not steps:
        raise AdapterFileNotFoundError(f"{p} holds no Orbax checkpoint step (expected <step>/{STATE_ITEM} and "
                                       f"<step>/{META_ITEM}, directly or under {CHECKPOINTS_DIR}/)")
    return steps[-1]


def _step_checkpointer():
    """An Orbax checkpointer of one step folder as CheckpointManager writes it: a composite of the
    state (PyTree) and meta (JSON) items, with the step's own metadata file."""
    import orbax.checkpoint as ocp
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        **{STATE_ITEM: ocp.PyTreeCheckpointHandler(), META_ITEM: ocp.JsonCheckpointHandler()}))


def read_meta(step_dir: str | os.PathLike) -> dict:
    """The JSON meta item of a step folder."""
    import orbax.checkpoint as ocp
    step_dir = pathlib.Path(step_dir)
    try:
        with _step_checkpointer() as ck:
            meta = ck.restore(step_dir, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except (FileNotFoundError, ValueError, OSError, KeyError) as e:
        raise AdapterFormatError(f"{step_dir}: cannot read the checkpoint meta: {e}") from None
    if not isinstance(meta, dict):
        raise AdapterFormatError(f"{step_dir}: checkpoint meta is not a JSON object")
    return dict(meta)


def checkpoint_adapter_kind(path: str | os.PathLike) -> str:
    """'lora' or 'reft': the adapter type a training checkpoint holds (its latest step)."""
    step_dir = resolve_step(path)
    meta = read_meta(step_dir)
    kind = meta.get("adapter", {}).get("type") if isinstance(meta.get("adapter"), dict) else None
    if kind not in ("lora", "reft"):
        raise AdapterFormatError(f"checkpoint {step_dir}: its meta names no adapter type (not a preft_jax "
                                 f"training checkpoint?)")
    return kind


def _expected_shapes(model_cfg: ModelConfig, config: LoraConfig | ReftConfig) -> dict:
    n, d, r = model_cfg.n_layers, model_cfg.d_model, config.rank
    if isinstance(config, LoraConfig):
        dims = model_cfg.projection_dims()
        return {"A": {t: (n, dims[t][0], r) for t in config.targets},
                "B": {t: (n, r, dims[t][1]) for t in config.targets}}
    return {"R": (n, r, d), "W": (n, r, d), "b": (n, r)}


def _flat(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, prefix + (str(k),))
    else:
        yield prefix, tree


def load_orbax_adapter(path: str | os.PathLike, model_config: ModelConfig) -> LoraWeights | ReftWeights:
    """Canonical adapter weights from a training run / checkpoints / step folder (latest step)."""
    import orbax.checkpoint as ocp

    from preft_jax.adapters.trainable import adapter_weights

    step_dir = resolve_step(path)
    where = f"checkpoint {step_dir}"
    config = check_identity(read_meta(step_dir), model_config, where=where)
    expected = _expected_shapes(model_config, config)
    with _step_checkpointer() as ck:
        state_meta = ck.metadata(step_dir).item_metadata[STATE_ITEM]
        stored = getattr(state_meta, "tree", None)
        params_meta = stored.get(PARAMS_KEY) if isinstance(stored, dict) else None
        if not isinstance(params_meta, dict):
            raise AdapterFormatError(f"{where}: its state has no {PARAMS_KEY!r} subtree")
        have = {"/".join(k): tuple(m.shape) for k, m in _flat(params_meta)}
        want = {"/".join(k): tuple(s) for k, s in _flat(expected)}
        if set(have) != set(want):
            raise AdapterFormatError(f"{where}: adapter params {sorted(have)} do not match its adapter config "
                                     f"(expected {sorted(want)})")
        bad = [f"{k}: {have[k]} (expected {want[k]})" for k in sorted(want) if have[k] != want[k]]
        if bad:
            raise AdapterFormatError(f"{where}: adapter param shapes do not fit this model: " + "; ".join(bad))
        item = {PARAMS_KEY: params_meta}
        restore_args = {PARAMS_KEY: {**_tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params_meta)}}
        restored = ck.restore(step_dir, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True)}))[STATE_ITEM]
    params = _tree_map(lambda x: np.asarray(x, np.float32), restored[PARAMS_KEY])
    return adapter_weights(model_config, config, params)


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)
