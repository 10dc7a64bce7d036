"""ReFT adapter I/O (preft_jax's own format) and adapter-kind detection."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from preft_jax.adapters.config import LoraConfig, LoraWeights, PositionPolicy, ReftConfig, ReftWeights
from preft_jax.adapters.peft_io import AdapterFileNotFoundError, AdapterFormatError, save_peft_lora
from preft_jax.adapters.reft_io import (REFT_CONFIG_NAME, REFT_WEIGHTS_NAME, adapter_kind, load_adapter, load_reft,
                                        save_reft)
from preft_jax.config import tiny_config

CFG = tiny_config()


def _random_reft(rank=3, layers=(0, 2), kind="direft", policy=PositionPolicy(first_k=2, last_k=4), seed=0):
    rng = np.random.default_rng(seed)
    n, d = CFG.n_layers, CFG.d_model
    R, W, b = (np.zeros((n, rank, d), np.float32), np.zeros((n, rank, d), np.float32),
               np.zeros((n, rank), np.float32))
    for i in layers:
        R[i], W[i], b[i] = rng.standard_normal((rank, d)), rng.standard_normal((rank, d)), rng.standard_normal(rank)
    return ReftWeights(ReftConfig(rank=rank, layers=layers, kind=kind, policy=policy), R, W, b)


def _edit_json(folder, **changes):
    path = folder / REFT_CONFIG_NAME
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _edit_tensors(folder, fn):
    path = str(folder / REFT_WEIGHTS_NAME)
    save_file(fn(load_file(path)), path)


@pytest.fixture
def reft_folder(tmp_path):
    folder = tmp_path / "reft"
    save_reft(folder, _random_reft())
    return folder


def test_round_trip(tmp_path):
    w = _random_reft()
    save_reft(tmp_path, w)
    assert sorted(os.listdir(tmp_path)) == [REFT_CONFIG_NAME, REFT_WEIGHTS_NAME]
    stored = load_file(str(tmp_path / REFT_WEIGHTS_NAME))
    assert sorted(stored) == [f"layers.{i}.{p}" for i in (0, 2) for p in ("R", "W", "b")]
    assert stored["layers.2.R"].shape == (3, CFG.d_model) and stored["layers.0.b"].shape == (3,)
    cfg = json.loads((tmp_path / REFT_CONFIG_NAME).read_text())
    assert cfg["policy"] == {"mode": "prefill", "first_k": 2, "last_k": 4} and cfg["format_version"] == 1

    back = load_reft(tmp_path, CFG)
    assert back.config == w.config
    for name in ("R", "W", "b"):
        got, want = getattr(back, name), getattr(w, name)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert not back.R[1].any() and not back.b[1].any()
    assert load_reft(tmp_path, CFG, policy=PositionPolicy(mode="all")).config.policy.mode == "all"


def test_save_rejects_inconsistent_weights(tmp_path):
    w = _random_reft()
    w.R[1, 0, 0] = 1.0
    with pytest.raises(ValueError, match="outside config.layers"):
        save_reft(tmp_path, w)
    w = _random_reft()
    w.b = w.b[:, :2]
    with pytest.raises(ValueError, match=r"ReftWeights.b has shape \(3, 2\), expected \(3, 3\)"):
        save_reft(tmp_path, w)


def test_missing_and_bad_json(reft_folder, tmp_path):
    with pytest.raises(AdapterFileNotFoundError, match="does not exist"):
        load_reft(tmp_path / "nope", CFG)
    (reft_folder / REFT_CONFIG_NAME).write_text('{"rank": 3,')
    with pytest.raises(AdapterFormatError, match="not valid JSON"):
        load_reft(reft_folder, CFG)
    os.remove(reft_folder / REFT_CONFIG_NAME)
    with pytest.raises(AdapterFileNotFoundError, match="Missing reft_config.json"):
        load_reft(reft_folder, CFG)


def test_bad_config_fields(reft_folder):
    good = json.loads((reft_folder / REFT_CONFIG_NAME).read_text())
    cases = [
        (dict(kind="noreft"), "unknown ReFT kind 'noreft'"),
        (dict(format_version=9), "unsupported format_version 9"),
        (dict(layers=[0, 3]), r"layer index \[3\] out of range.*3 layers"),
        (dict(rank="three"), "rank must be an integer"),
        (dict(d_model=128), "saved for a model with d_model=128, this model has d_model=64"),
        (dict(policy={"mode": "all", "last_k": 2}), "invalid position policy"),
    ]
    for change, message in cases:
        (reft_folder / REFT_CONFIG_NAME).write_text(json.dumps({**good, **change}))
        with pytest.raises(AdapterFormatError, match=message):
            load_reft(reft_folder, CFG)
    del good["layers"]
    (reft_folder / REFT_CONFIG_NAME).write_text(json.dumps(good))
    with pytest.raises(AdapterFormatError, match="missing required key 'layers'"):
        load_reft(reft_folder, CFG)


def test_bad_tensors(reft_folder):
    os.rename(reft_folder / REFT_WEIGHTS_NAME, reft_folder / "moved")
    with pytest.raises(AdapterFileNotFoundError, match="Missing reft_model.safetensors"):
        load_reft(reft_folder, CFG)
    os.rename(reft_folder / "moved", reft_folder / REFT_WEIGHTS_NAME)
    with pytest.raises(AdapterFormatError, match="saved for a model with d_model=64, this model has d_model=32"):
        load_reft(reft_folder, tiny_config(d_model=32))
    _edit_tensors(reft_folder, lambda d: {**d, "layers.0.R": d["layers.0.R"][:, :32].copy()})
    with pytest.raises(AdapterFormatError, match=r"'layers.0.R' has shape \(3, 32\), expected \(3, 64\)"):
        load_reft(reft_folder, CFG)
    _edit_tensors(reft_folder, lambda d: {**d, "layers.0.R": d["layers.2.R"]})
    _edit_tensors(reft_folder, lambda d: {**d, "layers.1.R": d["layers.0.R"]})
    with pytest.raises(AdapterFormatError, match=r"unexpected tensor.*layers\.1\.R"):
        load_reft(reft_folder, CFG)
    _edit_tensors(reft_folder, lambda d: {k: v for k, v in d.items() if k not in ("layers.1.R", "layers.2.W")})
    with pytest.raises(AdapterFormatError, match=r"missing tensor.*layers\.2\.W"):
        load_reft(reft_folder, CFG)
    save_reft(reft_folder, _random_reft())
    _edit_json(reft_folder, rank=2)
    with pytest.raises(AdapterFormatError, match=r"'layers.0.R' has shape \(3, 64\), expected \(2, 64\).*rank=2"):
        load_reft(reft_folder, CFG)


def test_load_adapter_detects_kind(reft_folder, tmp_path):
    assert adapter_kind(reft_folder) == "reft"
    assert isinstance(load_adapter(reft_folder, CFG), ReftWeights)

    lora_folder = tmp_path / "lora"
    dims = CFG.projection_dims()
    lw = LoraWeights(LoraConfig(rank=2, alpha=4.0, targets=("q",)),
                     {"q": np.ones((CFG.n_layers, dims["q"][0], 2), np.float32)},
                     {"q": np.ones((CFG.n_layers, 2, dims["q"][1]), np.float32)})
    save_peft_lora(lora_folder, lw, CFG)
    assert adapter_kind(lora_folder) == "lora"
    got = load_adapter(lora_folder, CFG)
    assert isinstance(got, LoraWeights) and got.config == lw.config

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterFormatError, match="neither adapter_config.json.*nor reft_config.json"):
        load_adapter(empty, CFG)
    save_reft(lora_folder, _random_reft())
    with pytest.raises(AdapterFormatError, match="both"):
        load_adapter(lora_folder, CFG)
