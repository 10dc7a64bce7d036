"""Read and write LoReFT / DiReFT interventions in the folder format of pyreft (pyvene's IntervenableModel.save).

A pyreft folder holds

    config.json                 pyvene IntervenableConfig: "representations" (one list per intervention:
                                [layer, component, unit, max_number_of_units, low_rank_dimension, ...]),
                                "intervention_types" ("<class 'pyreft.interventions.LoreftIntervention'>"),
                                "sorted_keys", "intervention_dimensions", "mode", ...
    intkey_<key>.bin            one `torch.save`d state dict per intervention, key
                                "layer_{L}_comp_{component}_unit_{unit}_nunit_{n}#{i}"

How pyreft applies them (pyreft.interventions, with `rotate_layer.weight` = Q [d, r] with orthonormal
columns, kept orthonormal by `torch.nn.utils.parametrizations.orthogonal`, and `learned_source` =
nn.Linear(d, r) with weight W [r, d] and bias b):

    LoReFT   h + (W h + b - Q^T h) Q^T        state dict {"weight": W, "bias": b, "rotate_layer": Q}
    DiReFT   h + (W h + b) Q^T                state dict of the module: "learned_source.weight/bias" and the
                                              parametrization "rotate_layer.parametrizations.weight.original"
                                              and ".0.base" (Q = base @ householder(original))

i.e. exactly preft_jax's ReFT with R = Q^T ([r, d], orthonormal rows), W, b. Component "block_output" of
layer L is the residual stream after decoder layer L, the place preft_jax's ReFT edits.

Positions: pyreft does not save them; its data modules take a string like "f1+l1" (first 1 and last 1
prompt positions), which maps to PositionPolicy(first_k=1, last_k=1). Pass `positions=` to load_pyreft;
save_pyreft records the policy in an extra config key ("preft_positions") that pyvene ignores.
Difference: pyreft clamps each window to prompt_length // 2; preft_jax does not (same positions
whenever prompt_length >= 2 * max(first_k, last_k)).
"""
from __future__ import annotations

import os
import pathlib
import re
import warnings
from typing import Any

import numpy as np

from preft_jax.adapters.config import ReftConfig, ReftWeights
from preft_jax.adapters.policy import PositionPolicy
from preft_jax.adapters.peft_io import (AdapterFileNotFoundError, AdapterFormatError, UnsupportedAdapterError,
                                        _check_folder, _read_json, _write_json)
from preft_jax.adapters.torch_pickle import TorchFileError, load_torch_file, save_torch_file
from preft_jax.config import ModelConfig

__all__ = ["load_pyreft", "save_pyreft", "is_pyreft_folder", "parse_positions", "positions_string",
           "PYREFT_TYPES"]

CONFIG_NAME = "config.json"
POSITIONS_KEY = "preft_positions"
# pyreft class name -> preft_jax ReFT kind
PYREFT_TYPES = {"LoreftIntervention": "loreft", "DireftIntervention": "direft"}
_TYPE_STRING = "<class 'pyreft.interventions.{}'>"
_KIND_CLASS = {kind: cls for cls, kind in PYREFT_TYPES.items()}
# pyvene RepresentationConfig field order (config.json stores each representation as a list)
_REPR_FIELDS = ("layer", "component", "unit", "max_number_of_units", "low_rank_dimension", "intervention_type",
                "intervention", "subspace_partition", "group_key", "intervention_link_key", "moe_key",
                "source_representation", "hidden_source_representation", "latent_dim")
_ORTHO_TOL = 1e-4


# -------------------------------------------------------------------------------------- positions
_POS_RE = re.compile(r"^(?:f(\d+))?(?:\+?l(\d+))?$")


def parse_positions(spec: str | PositionPolicy) -> PositionPolicy:
    """pyreft's position string -> PositionPolicy: "f1+l1", "f3", "l1"; also "all_prompt" (every prompt
    token) and "all" (every token, prompt and generated)."""
    if isinstance(spec, PositionPolicy):
        return spec
    s = str(spec).strip().lower()
    if s == "all":
        return PositionPolicy(mode="all")
    if s == "all_prompt":
        return PositionPolicy()
    m = _POS_RE.match(s)
    if not s or not m or (m.group(1) is None and m.group(2) is None) or (s.startswith("l") and "+" in s):
        raise ValueError(f"Bad pyreft positions {spec!r}: expected 'f<N>+l<M>', 'f<N>', 'l<M>', 'all_prompt' or 'all'")
    first = int(m.group(1)) if m.group(1) is not None else 0
    last = int(m.group(2)) if m.group(2) is not None else 0
    if first == 0 and last == 0:
        raise ValueError(f"pyreft positions {spec!r} select no position")
    return PositionPolicy(first_k=first or None, last_k=last or None)


def positions_string(policy: PositionPolicy) -> str:
    """Inverse of parse_positions."""
    if policy.mode == "activated":
        raise ValueError("pyreft has no activated (invocation-triggered) positions; save it with save_reft")
    if policy.mode == "all":
        return "all"
    if policy.first_k is None and policy.last_k is None:
        return "all_prompt"
    parts = ([f"f{policy.first_k}"] if policy.first_k else []) + ([f"l{policy.last_k}"] if policy.last_k else [])
    return "+".join(parts) if parts else "all_prompt"


# ------------------------------------------------------------------------------------------- read
def is_pyreft_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder/config.json` is a pyvene/pyreft IntervenableConfig."""
    path = pathlib.Path(folder) / CONFIG_NAME
    if not path.is_file():
        return False
    try:
        data = _read_json(path)
    except AdapterFormatError:
        return False
    return isinstance(data, dict) and "representations" in data and "intervention_types" in data


def _representation(raw: Any, i: int, where: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        rep = dict(raw)
    elif isinstance(raw, list):
        if len(raw) > len(_REPR_FIELDS):
            raise AdapterFormatError(f"{where}: representation {i} has {len(raw)} fields, expected <= {len(_REPR_FIELDS)}")
        rep = dict(zip(_REPR_FIELDS, raw))
    else:
        raise AdapterFormatError(f"{where}: representation {i} is {type(raw).__name__}, expected a list or an object")
    rep.setdefault("component", "block_output")
    rep.setdefault("unit", "pos")
    rep.setdefault("max_number_of_units", 1)
    return rep


def _class_name(type_string: Any) -> str:
    s = str(type_string).replace("<class '", "").replace("'>", "")
    return s.rsplit(".", 1)[-1]


def _householder_product(A: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """LAPACK orgqr: first k columns of H_1 ... H_k, H_i = I - tau_i v_i v_i^T (v_i[i] = 1, below: A[:, i])."""
    n, k = A.shape
    Q = np.eye(n, k)
    for i in reversed(range(k)):
        v = np.zeros(n)
        v[i] = 1.0
        v[i + 1:] = A[i + 1:, i]
        Q -= tau[i] * np.outer(v, v @ Q)
    return Q


def _orthogonal_forward(original: np.ndarray, base: np.ndarray | None) -> np.ndarray:
    """torch.nn.utils.parametrizations.orthogonal's weight for a real [n, k] `original` (default maps:
    householder for n != k, matrix_exp for square), with `base` when the trivialization is used."""
    X = np.asarray(original, np.float64)
    transposed = X.shape[0] < X.shape[1]
    if transposed:
        X = X.T
    n, k = X.shape
    if n == k:                                            # matrix_exp of the skew part of tril(X)
        L = np.tril(X)
        A = L - L.T
        w, V = np.linalg.eigh(1j * A)                     # 1j*A is Hermitian; exp(A) = V exp(-i w) V^H
        Q = ((V * np.exp(-1j * w)) @ V.conj().T).real
    else:
        A = np.tril(X, -1)
        tau = 2.0 / (1.0 + (A * A).sum(axis=0))
        Q = _householder_product(A, tau) * np.trunc(np.diagonal(X))[None, :]
    if base is not None:
        Q = np.asarray(base, np.float64) @ Q
    return Q.T if transposed else Q


def _rotation_from_state(sd: dict, where: str) -> np.ndarray:
    """Q [d, r] from either pyreft's compact LoReFT state ("rotate_layer") or a module state dict."""
    if "rotate_layer" in sd:
        return np.asarray(sd["rotate_layer"], np.float64)
    orig_key = "rotate_layer.parametrizations.weight.original"
    if orig_key in sd:
        base = sd.get("rotate_layer.parametrizations.weight.0.base")
        return _orthogonal_forward(sd[orig_key], base)
    if "rotate_layer.weight" in sd:
        return np.asarray(sd["rotate_layer.weight"], np.float64)
    raise AdapterFormatError(f"{where}: no rotate_layer in the intervention state (keys: {sorted(sd)})")


def _source_from_state(sd: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    for w_key, b_key in (("weight", "bias"), ("learned_source.weight", "learned_source.bias")):
        if w_key in sd and b_key in sd:
            return np.asarray(sd[w_key], np.float64), np.asarray(sd[b_key], np.float64)
    raise AdapterFormatError(f"{where}: no learned_source weight/bias in the intervention state (keys: {sorted(sd)})")


def load_pyreft(folder: str | os.PathLike, model_config: ModelConfig,
                positions: str | PositionPolicy | None = None) -> ReftWeights:
    """ReftWeights (canonical float32, stacked over all layers) from a pyreft/pyvene save folder.

    positions: pyreft position string ("f1+l1", "l1", ...) or a PositionPolicy. Default: the policy
    save_pyreft recorded, else every prompt position (with a warning: pyreft does not store positions).
    """
    path = _check_folder(folder)
    cfg_path = path / CONFIG_NAME
    if not cfg_path.is_file():
        raise AdapterFileNotFoundError(f"Missing {CONFIG_NAME} in {path} (not a pyreft folder?)")
    where = str(cfg_path)
    data = _read_json(cfg_path)
    for key in ("representations", "intervention_types"):
        if key not in data:
            raise AdapterFormatError(f"{where}: missing {key!r}; not a pyreft/pyvene intervention config")
    reps = data["representations"]
    types = data["intervention_types"]
    if not isinstance(reps, list) or not reps:
        raise AdapterFormatError(f"{where}: 'representations' must be a non-empty list")
    if not isinstance(types, list):
        types = [types] * len(reps)
    if len(types) != len(reps):
        raise AdapterFormatError(f"{where}: {len(types)} intervention_types for {len(reps)} representations")
    if data.get("mode", "parallel") != "parallel":
        raise UnsupportedAdapterError(f"{where}: pyvene mode {data['mode']!r} is not supported (only 'parallel')")

    n_layers, d = model_config.n_layers, model_config.d_model
    collisions: dict[str, int] = {}
    kinds, per_layer = set(), {}
    for i, (raw, type_string) in enumerate(zip(reps, types)):
        rep = _representation(raw, i, where)
        cls = _class_name(type_string)
        if cls not in PYREFT_TYPES:
            raise UnsupportedAdapterError(
                f"{where}: intervention {i} is a {cls}, which preft_jax cannot represent; supported pyreft "
                f"interventions: {', '.join(f'{c} ({k})' for c, k in PYREFT_TYPES.items())}")
        kinds.add(PYREFT_TYPES[cls])
        if rep["component"] != "block_output" or rep["unit"] != "pos":
            raise UnsupportedAdapterError(
                f"{where}: intervention {i} acts on component={rep['component']!r}, unit={rep['unit']!r}; preft_jax "
                f"ReFT edits the residual stream after a layer (component='block_output', unit='pos')")
        for field in ("subspace_partition", "intervention_link_key", "moe_key"):
            if rep.get(field) is not None:
                raise UnsupportedAdapterError(f"{where}: intervention {i} sets {field}={rep[field]!r}; not supported")
        layer = rep["layer"]
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise AdapterFormatError(f"{where}: intervention {i} layer {layer!r} out of range for a model with "
                                     f"{n_layers} layers")
        key = f"layer_{layer}_comp_{rep['component']}_unit_{rep['unit']}_nunit_{rep['max_number_of_units']}"
        collisions[key] = collisions.get(key, -1) + 1
        key = f"{key}#{collisions[key]}"
        if layer in per_layer:
            raise UnsupportedAdapterError(
                f"{where}: layer {layer} has more than one intervention (e.g. pyreft trained with positions "
                f"'f<N>+l<M>' and share_weights=False: separate weights for the first and the last positions); "
                f"preft_jax holds one intervention per layer")
        bin_path = path / f"intkey_{key}.bin"
        if not bin_path.is_file():
            raise AdapterFileNotFoundError(f"Missing intervention weights {bin_path.name} in {path}")
        try:
            sd = load_torch_file(bin_path)
        except TorchFileError as e:
            raise AdapterFormatError(str(e)) from None
        if not isinstance(sd, dict):
            raise AdapterFormatError(f"{bin_path}: expected a state dict, got {type(sd).__name__}")
        Q = _rotation_from_state(sd, str(bin_path))
        W, b = _source_from_state(sd, str(bin_path))
        r = Q.shape[1] if Q.ndim == 2 else -1
        if Q.ndim != 2 or Q.shape[0] != d or W.shape != (r, d) or b.shape != (r,):
            raise AdapterFormatError(
                f"{bin_path}: rotate_layer {Q.shape}, weight {W.shape}, bias {b.shape} do not fit d_model={d} "
                f"(expected [d, r], [r, d], [r])")
        declared = rep.get("low_rank_dimension")
        if declared is not None and declared != r:
            raise AdapterFormatError(f"{bin_path}: rank {r} but config.json says low_rank_dimension={declared}")
        per_layer[layer] = (Q.T, W, b)
    if len(kinds) != 1:
        raise UnsupportedAdapterError(f"{where}: mixes intervention kinds {sorted(kinds)}; preft_jax needs one kind")

    if positions is None:
        stored = data.get(POSITIONS_KEY)
        if stored is not None:
            policy = parse_positions(stored)
        else:
            warnings.warn(f"{path}: pyreft does not record the positions an intervention was trained on; using "
                          f"every prompt position. Pass positions='f1+l1' (pyreft's position string) to match "
                          f"training.", stacklevel=2)
            policy = PositionPolicy()
    else:
        policy = parse_positions(positions)

    rank = max(R.shape[0] for R, _, _ in per_layer.values())   # zero rows are inert in LoReFT and DiReFT
    R_all = np.zeros((n_layers, rank, d), np.float32)
    W_all = np.zeros((n_layers, rank, d), np.float32)
    b_all = np.zeros((n_layers, rank), np.float32)
    for layer, (R, W, b) in per_layer.items():
        r = R.shape[0]
        R_all[layer, :r], W_all[layer, :r], b_all[layer, :r] = R, W, b
    config = ReftConfig(rank=rank, layers=tuple(sorted(per_layer)), kind=kinds.pop(), policy=policy)
    return ReftWeights(config=config, R=R_all, W=W_all, b=b_all)


# ------------------------------------------------------------------------------------------ write
def _orthonormal_completion(R: np.ndarray) -> np.ndarray:
    """[d, d] orthogonal matrix whose first r columns are R^T (R: [r, d] with orthonormal rows)."""
    r, d = R.shape
    rng = np.random.default_rng(0)
    M = np.concatenate([R.T.astype(np.float64), rng.standard_normal((d, d - r))], axis=1)
    Q, U = np.linalg.qr(M)
    Q = Q * np.sign(np.diagonal(U))[None, :]
    Q[:, :r] = R.T                                           # exact first columns
    return Q


def save_pyreft(folder: str | os.PathLike, weights: ReftWeights, model_config: ModelConfig | None = None) -> None:
    """Write `weights` as a pyreft folder that `pyreft.ReftModel.load(folder, model)` reads.

    pyreft keeps R orthonormal (an orthogonal parametrization), so R's rows must be orthonormal (as
    preft_jax's LoReFT training keeps them); otherwise a ValueError says so.
    """
    cfg = weights.config
    R, W, b = (np.asarray(x, np.float64) for x in (weights.R, weights.W, weights.b))
    if R.ndim != 3 or W.shape != R.shape or b.shape != R.shape[:2]:
        raise ValueError(f"ReftWeights shapes R {R.shape}, W {W.shape}, b {b.shape} are inconsistent")
    n_layers, rank, d = R.shape
    if model_config is not None and (model_config.n_layers, model_config.d_model) != (n_layers, d):
        raise ValueError(f"weights are for n_layers={n_layers}, d_model={d}; the model has "
                         f"{model_config.n_layers}, {model_config.d_model}")
    layers = sorted(set(cfg.layers))
    outside = [i for i in range(n_layers) if i not in layers]
    if outside and (np.any(R[outside]) or np.any(W[outside]) or np.any(b[outside])):
        raise ValueError(f"ReftWeights are non-zero outside config.layers {tuple(layers)}; they would be lost")
    for i in layers:
        err = float(np.abs(R[i] @ R[i].T - np.eye(rank)).max())
        if err > _ORTHO_TOL:
            raise ValueError(f"layer {i}: R's rows are not orthonormal (max |R R^T - I| = {err:.2e}); pyreft's "
                             f"{_KIND_CLASS[cfg.kind]} parametrizes R as orthonormal and cannot hold it")

    path = pathlib.Path(folder).expanduser()
    if path.exists() and not path.is_dir():
        raise AdapterFormatError(f"Adapter path exists and is not a folder: {path}")
    path.mkdir(parents=True, exist_ok=True)
    cls = _KIND_CLASS[cfg.kind]
    keys, reps = [], []
    for i in layers:
        key = f"layer_{i}_comp_block_output_unit_pos_nunit_1#0"
        keys.append(key)
        reps.append([i, "block_output", "pos", 1, rank] + [None] * (len(_REPR_FIELDS) - 5))
        Rf, Wf, bf = R[i].astype(np.float32), W[i].astype(np.float32), b[i].astype(np.float32)
        if cfg.kind == "loreft":
            state = {"weight": Wf, "bias": bf, "rotate_layer": np.ascontiguousarray(Rf.T)}
        else:
            # torch's orthogonal parametrization after `right_inverse`: original = -I, base[:, :r] = R^T
            neg_id = np.zeros((d, rank), np.float32)
            np.fill_diagonal(neg_id, -1.0)
            state = {"embed_dim": np.array(d, np.int64), "interchange_dim": np.array(d, np.int64),
                     "rotate_layer.parametrizations.weight.original": neg_id,
                     "rotate_layer.parametrizations.weight.0.base": _orthonormal_completion(R[i]).astype(np.float32),
                     "learned_source.weight": Wf, "learned_source.bias": bf}
        save_torch_file(path / f"intkey_{key}.bin", state)
    _write_json(path / CONFIG_NAME, {
        "intervention_constant_sources": [True] * len(layers),
        "intervention_dimensions": [d] * len(layers),
        "intervention_types": [_TYPE_STRING.format(cls)] * len(layers),
        "mode": "parallel",
        "representations": reps,
        "sorted_keys": keys,
        POSITIONS_KEY: positions_string(cfg.policy),
    })
