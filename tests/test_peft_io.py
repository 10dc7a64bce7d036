"""PEFT LoRA adapter I/O: parity with peft's own files, round trips through peft, malformed inputs."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from preft_jax.adapters.config import LORA_TARGETS, LoraConfig, LoraWeights, PositionPolicy
from preft_jax.adapters.peft_io import (POLICY_NAME, AdapterFileNotFoundError, AdapterFormatError,
                                        UnsupportedAdapterError, load_peft_lora, save_peft_lora)
from preft_jax.config import tiny_config

torch = pytest.importorskip("torch", reason="HF reference: torch not installed (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers",
                                   reason="HF reference: transformers not installed (pip install -e '.[test]')")
peft = pytest.importorskip("peft", reason="HF reference: peft not installed (pip install -e '.[test]')")
from safetensors.numpy import load_file, save_file  # noqa: E402

pytestmark = [pytest.mark.hf_reference,
              pytest.mark.filterwarnings("ignore::FutureWarning")]   # transformers deprecation noise

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_PARENT = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn",
           "gate": "mlp", "up": "mlp", "down": "mlp"}
CFG = tiny_config()


def _tiny_hf_model():
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.d_model, num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads, head_dim=CFG.head_dim,
        intermediate_size=CFG.ffn_dim, max_position_embeddings=CFG.max_seq_len, rms_norm_eps=CFG.rms_eps,
        rope_theta=CFG.rope_theta, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(hf_cfg).eval()


@pytest.fixture(scope="module")
def base_state():
    return _tiny_hf_model().state_dict()


@pytest.fixture
def make_base(base_state):
    """Fresh tiny LlamaForCausalLM with fixed weights (peft mutates the model it wraps)."""
    def make():
        model = _tiny_hf_model()
        model.load_state_dict(base_state)
        return model
    return make


def _peft_save(make_base, folder, seed=1, **lora_kwargs):
    """get_peft_model + save_pretrained; returns {(layer, short, 'A'|'B'): numpy tensor in peft layout}."""
    kwargs = dict(r=4, lora_alpha=8, target_modules=list(ALL_PROJ), init_lora_weights=False)
    kwargs.update(lora_kwargs)
    torch.manual_seed(seed)
    pm = peft.get_peft_model(make_base(), peft.LoraConfig(**kwargs))
    pm.save_pretrained(str(folder))
    return _lora_tensors(pm)


def _lora_tensors(peft_model):
    out = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        for t in LORA_TARGETS:
            mod = getattr(getattr(layer, _PARENT[t]), f"{t}_proj")
            if hasattr(mod, "lora_A") and "default" in mod.lora_A:
                out[(i, t, "A")] = mod.lora_A["default"].weight.detach().numpy().copy()
                out[(i, t, "B")] = mod.lora_B["default"].weight.detach().numpy().copy()
    return out


def _assert_matches_peft(weights, ref, layers):
    for t in weights.config.targets:
        for i in range(CFG.n_layers):
            if i in layers:
                np.testing.assert_array_equal(weights.A[t][i], ref[(i, t, "A")].T)
                np.testing.assert_array_equal(weights.B[t][i], ref[(i, t, "B")].T)
            else:
                assert not weights.A[t][i].any() and not weights.B[t][i].any()


def _random_weights(rank=4, alpha=8.0, targets=LORA_TARGETS, layers=None, seed=0, **cfg_kwargs):
    rng = np.random.default_rng(seed)
    cfg = LoraConfig(rank=rank, alpha=alpha, targets=tuple(targets), layers=layers, **cfg_kwargs)
    dims = CFG.projection_dims()
    keep = np.zeros((CFG.n_layers, 1, 1), np.float32)
    keep[list(range(CFG.n_layers)) if layers is None else list(layers)] = 1
    A = {t: (rng.standard_normal((CFG.n_layers, dims[t][0], rank)) * keep).astype(np.float32) for t in targets}
    B = {t: (rng.standard_normal((CFG.n_layers, rank, dims[t][1])) * keep).astype(np.float32) for t in targets}
    return LoraWeights(cfg, A, B)


def _edit_config(folder, **changes):
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def _edit_tensors(folder, fn):
    path = os.path.join(folder, "adapter_model.safetensors")
    tensors = fn(load_file(path))
    save_file(tensors, path, metadata={"format": "pt"})


# ------------------------------------------------------------------------------- reading peft files
def test_load_peft_all_targets_matches_peft(make_base, tmp_path):
    ref = _peft_save(make_base, tmp_path)
    w = load_peft_lora(tmp_path, CFG)
    assert w.config.targets == LORA_TARGETS
    assert (w.config.rank, w.config.alpha, w.config.layers, w.config.use_rslora) == (4, 8.0, None, False)
    assert w.config.policy == PositionPolicy()
    dims = CFG.projection_dims()
    for t in LORA_TARGETS:
        assert w.A[t].shape == (CFG.n_layers, dims[t][0], 4) and w.A[t].dtype == np.float32
        assert w.B[t].shape == (CFG.n_layers, 4, dims[t][1]) and w.B[t].dtype == np.float32
        assert np.abs(w.B[t]).sum() > 0   # init_lora_weights=False -> B non-zero
    _assert_matches_peft(w, ref, range(CFG.n_layers))


def test_load_peft_layer_and_target_subset(make_base, tmp_path):
    ref = _peft_save(make_base, tmp_path, target_modules=["v_proj", "q_proj", "down_proj"],
                     layers_to_transform=[0, 2], lora_alpha=16, use_rslora=True)
    w = load_peft_lora(tmp_path, CFG)
    assert w.config.targets == ("q", "v", "down")
    assert w.config.layers == (0, 2)
    assert w.config.use_rslora and w.config.scale == pytest.approx(16 / 2)
    _assert_matches_peft(w, ref, {0, 2})


def test_load_peft_all_linear_and_regex(make_base, tmp_path):
    ref = _peft_save(make_base, tmp_path / "all", target_modules="all-linear")
    w = load_peft_lora(tmp_path / "all", CFG)
    assert w.config.targets == LORA_TARGETS
    _assert_matches_peft(w, ref, range(CFG.n_layers))

    ref = _peft_save(make_base, tmp_path / "rx", target_modules=r".*\.1\.self_attn\.(k|o)_proj")
    w = load_peft_lora(tmp_path / "rx", CFG)
    assert w.config.targets == ("k", "o") and w.config.layers == (1,)
    _assert_matches_peft(w, ref, {1})


def test_load_bf16_infix_and_prefix_variants(make_base, tmp_path):
    ref = _peft_save(make_base, tmp_path, target_modules=["q_proj", "v_proj"])
    want = load_peft_lora(tmp_path, CFG)
    # adapter-name infix, no base_model.model. prefix
    _edit_tensors(tmp_path, lambda d: {k.replace("base_model.model.", "").replace(".weight", ".default.weight"): v
                                       for k, v in d.items()})
    got = load_peft_lora(tmp_path, CFG)
    for t in ("q", "v"):
        np.testing.assert_array_equal(got.A[t], want.A[t])
        np.testing.assert_array_equal(got.B[t], want.B[t])
    # bfloat16 tensors (numpy has no bf16: written through torch's safetensors)
    from safetensors.torch import save_file as torch_save
    torch_save({f"base_model.model.model.layers.{i}.self_attn.{t}_proj.lora_{ab}.weight":
                torch.from_numpy(ref[(i, t, ab)]).to(torch.bfloat16) for (i, t, ab) in ref},
               str(tmp_path / "adapter_model.safetensors"))
    got = load_peft_lora(tmp_path, CFG)
    expect = torch.from_numpy(ref[(1, "q", "B")]).to(torch.bfloat16).float().numpy().T
    np.testing.assert_array_equal(got.B["q"][1], expect)
    assert got.B["q"].dtype == np.float32


def test_rank_pattern(make_base, tmp_path):
    _peft_save(make_base, tmp_path, target_modules=["q_proj", "v_proj"])
    _edit_config(tmp_path, rank_pattern={"q_proj": 4, "v_proj": 4})     # uniform: fine
    assert load_peft_lora(tmp_path, CFG).config.rank == 4
    _edit_config(tmp_path, rank_pattern={"q_proj": 8})
    with pytest.raises(NotImplementedError, match="rank_pattern"):
        load_peft_lora(tmp_path, CFG)
    _edit_config(tmp_path, rank_pattern={}, alpha_pattern={"layers.0.self_attn.v_proj": 32})
    with pytest.raises(UnsupportedAdapterError, match="alpha_pattern"):
        load_peft_lora(tmp_path, CFG)


# ------------------------------------------------------------------------------------- round trips
def test_round_trip_and_loads_in_peft(make_base, tmp_path):
    w = _random_weights(rank=4, alpha=6.0, layers=(0, 2), policy=PositionPolicy(last_k=5))
    save_peft_lora(tmp_path, w, CFG, base_model_name_or_path="tiny-llama")
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors", POLICY_NAME]
    with open(tmp_path / "adapter_config.json") as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["layers_to_transform"] == [0, 2] and cfg["target_modules"] == ALL_PROJ
    assert not any(".1." in k for k in load_file(str(tmp_path / "adapter_model.safetensors")))

    back = load_peft_lora(tmp_path, CFG)
    assert back.config == w.config        # policy came back through the sidecar
    for t in LORA_TARGETS:
        np.testing.assert_array_equal(back.A[t], w.A[t])
        np.testing.assert_array_equal(back.B[t], w.B[t])
    assert load_peft_lora(tmp_path, CFG, policy=PositionPolicy(mode="all")).config.policy.mode == "all"

    pm = peft.PeftModel.from_pretrained(make_base(), str(tmp_path))
    assert isinstance(pm, peft.PeftModelForCausalLM)
    ref = _lora_tensors(pm)
    assert {i for i, _, _ in ref} == {0, 2}
    _assert_matches_peft(w, ref, {0, 2})
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(w.config.scale)


def test_round_trip_rslora_subset_through_peft(make_base, tmp_path):
    w = _random_weights(rank=2, alpha=3.5, targets=("k", "up"), use_rslora=True, seed=3)
    save_peft_lora(tmp_path, w, CFG)
    with open(tmp_path / "adapter_config.json") as f:
        assert json.load(f)["layers_to_transform"] is None
    pm = peft.PeftModel.from_pretrained(make_base(), str(tmp_path))
    _assert_matches_peft(w, _lora_tensors(pm), range(CFG.n_layers))
    assert pm.base_model.model.model.layers[1].mlp.up_proj.scaling["default"] == pytest.approx(w.config.scale)
    # ... and peft's own re-save reads back identically
    pm.save_pretrained(str(tmp_path / "resaved"))
    back = load_peft_lora(tmp_path / "resaved", CFG)
    assert back.config == w.config
    for t in ("k", "up"):
        np.testing.assert_array_equal(back.B[t], w.B[t])


def test_save_rejects_inconsistent_weights(tmp_path):
    w = _random_weights(layers=(1,))
    w.A["q"][0] = 1.0
    with pytest.raises(ValueError, match="outside config.layers"):
        save_peft_lora(tmp_path, w, CFG)
    w = _random_weights()
    with pytest.raises(ValueError, match=r"A\['q'\] has shape \(3, 64, 4\), expected \(3, 32, 4\)"):
        save_peft_lora(tmp_path, w, tiny_config(d_model=32))


# ------------------------------------------------------------------------------------ bad inputs
@pytest.fixture
def peft_folder(make_base, tmp_path):
    folder = tmp_path / "adapter"
    _peft_save(make_base, folder, target_modules=["q_proj", "v_proj"])
    return folder


def test_missing_folder_and_files(peft_folder, tmp_path):
    with pytest.raises(AdapterFileNotFoundError, match="does not exist"):
        load_peft_lora(tmp_path / "nope", CFG)
    with pytest.raises(FileNotFoundError):
        load_peft_lora(tmp_path / "nope", CFG)
    os.remove(peft_folder / "adapter_model.safetensors")
    with pytest.raises(AdapterFileNotFoundError, match="Missing adapter_model.safetensors"):
        load_peft_lora(peft_folder, CFG)
    (peft_folder / "adapter_model.bin").write_bytes(b"\x80")
    with pytest.raises(AdapterFormatError, match="adapter_model.bin"):
        load_peft_lora(peft_folder, CFG)
    os.remove(peft_folder / "adapter_config.json")
    with pytest.raises(AdapterFileNotFoundError, match="Missing adapter_config.json"):
        load_peft_lora(peft_folder, CFG)


def test_bad_json_and_missing_keys(peft_folder):
    cfg_path = peft_folder / "adapter_config.json"
    text = cfg_path.read_text()
    cfg_path.write_text(text[:-10])
    with pytest.raises(AdapterFormatError, match="not valid JSON.*line"):
        load_peft_lora(peft_folder, CFG)
    cfg_path.write_text("[1, 2]")
    with pytest.raises(AdapterFormatError, match="JSON object"):
        load_peft_lora(peft_folder, CFG)
    cfg = json.loads(text)
    del cfg["r"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(AdapterFormatError, match="missing required key 'r'"):
        load_peft_lora(peft_folder, CFG)


def test_unsupported_config_features(peft_folder):
    _edit_config(peft_folder, peft_type="IA3")
    with pytest.raises(AdapterFormatError, match="peft_type is 'IA3'"):
        load_peft_lora(peft_folder, CFG)
    _edit_config(peft_folder, peft_type="LORA", bias="all")
    with pytest.raises(UnsupportedAdapterError, match="bias='all'"):
        load_peft_lora(peft_folder, CFG)
    _edit_config(peft_folder, bias="none", target_modules=["q_proj", "lm_head"])
    with pytest.raises(AdapterFormatError, match=r"unknown target module\(s\) \['lm_head'\]"):
        load_peft_lora(peft_folder, CFG)
    _edit_config(peft_folder, target_modules=["q_proj", "v_proj"], layers_to_transform=[0, 5])
    with pytest.raises(AdapterFormatError, match=r"layers_to_transform index \[5\] out of range.*3 layers"):
        load_peft_lora(peft_folder, CFG)


def test_dora_rejected(make_base, tmp_path):
    _peft_save(make_base, tmp_path, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(UnsupportedAdapterError, match="DoRA"):
        load_peft_lora(tmp_path, CFG)
    _edit_config(tmp_path, use_dora=False)   # the magnitude tensors alone are caught too
    with pytest.raises(AdapterFormatError, match="lora_magnitude_vector.*DoRA"):
        load_peft_lora(tmp_path, CFG)


def test_wrong_shape_names_tensor(peft_folder):
    with pytest.raises(AdapterFormatError,
                       match=r"self_attn\.q_proj\.lora_A\.weight' has shape \(4, 64\), expected \(4, 32\)"):
        load_peft_lora(peft_folder, tiny_config(d_model=32))
    _edit_config(peft_folder, r=8)
    with pytest.raises(AdapterFormatError, match=r"has shape \(4, 64\), expected \(8, 64\)"):
        load_peft_lora(peft_folder, CFG)


def test_bad_tensor_sets(peft_folder):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    _edit_tensors(peft_folder, lambda d: {**d, "base_model.model.lm_head.modules_to_save.weight": np.zeros((2, 2),
                                                                                                          np.float32)})
    with pytest.raises(AdapterFormatError, match="unexpected tensor.*lm_head.*modules_to_save"):
        load_peft_lora(peft_folder, CFG)
    _edit_tensors(peft_folder, lambda d: {(k.replace("layers.0.", "layers.7.") if k == key else k): v
                                          for k, v in d.items() if "lm_head" not in k})
    with pytest.raises(AdapterFormatError, match=r"layers\.7\..*layer index 7, out of range.*3 layers"):
        load_peft_lora(peft_folder, CFG)
    _edit_tensors(peft_folder, lambda d: {k: v for k, v in d.items() if "layers.7." not in k})
    with pytest.raises(AdapterFormatError, match=r"missing tensor.*layers\.0\.self_attn\.q_proj\.lora_A\.weight"):
        load_peft_lora(peft_folder, CFG)
    _edit_config(peft_folder, target_modules=["v_proj"])
    with pytest.raises(AdapterFormatError, match="q_proj.*does not target"):
        load_peft_lora(peft_folder, CFG)
    (peft_folder / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(AdapterFormatError, match="not a safetensors file"):
        load_peft_lora(peft_folder, CFG)


def test_bad_policy_sidecar(tmp_path):
    save_peft_lora(tmp_path, _random_weights(), CFG)
    (tmp_path / POLICY_NAME).write_text(json.dumps({"format_version": 1, "policy": {"mode": "sometimes"}}))
    with pytest.raises(AdapterFormatError, match="invalid position policy.*sometimes"):
        load_peft_lora(tmp_path, CFG)
    # an explicit policy skips the sidecar; no sidecar at all means prefill mode
    assert load_peft_lora(tmp_path, CFG, policy=PositionPolicy()).config.policy == PositionPolicy()
    os.remove(tmp_path / POLICY_NAME)
    assert load_peft_lora(tmp_path, CFG).config.policy == PositionPolicy(mode="prefill")


def test_library_does_not_import_torch():
    import subprocess
    import sys
    code = ("import sys, preft_jax.adapters.peft_io, preft_jax.adapters.reft_io; "
            "print([m for m in ('torch', 'transformers', 'peft') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


