"""Qwen2 and Llama 3.x from HF safetensors folders: configs, tokenizers + chat templates, logits and greedy
generation against transformers, and a PEFT LoRA on Qwen2 (all-token and prefill-only)."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_tiny import tiny_llama3, tiny_qwen2
from preft_jax.adapters.bank import build_bank
from preft_jax.adapters.config import PositionPolicy
from preft_jax.adapters.peft_io import load_peft_lora
from preft_jax.config import RopeScaling
from preft_jax.generation import ModelRunner, sequence_logits
from preft_jax.loading import load_model
from preft_jax.loading.hf_safetensors import config_from_hf
from preft_jax.model import Llama
from preft_jax.sampling import SamplingParams

pytestmark = pytest.mark.hf_reference
FAMILIES = ("qwen2", "llama3")
_logits = jax.jit(sequence_logits, static_argnums=0)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            hf_model, ids = (tiny_qwen2 if name == "qwen2" else tiny_llama3)(folder)
            cfg, params, tok = load_model(folder)
            built[name] = dict(folder=folder, hf=hf_model, ids=ids, cfg=cfg, params=params, tok=tok,
                               runner=ModelRunner(Llama.from_params(cfg, params)))
        return built[name]
    return get


def _hf_logits(model, ids):
    import torch
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_configs(family):
    q = family("qwen2")
    cfg = q["cfg"]
    assert cfg.qkv_bias and not cfg.tie_embeddings and "lm_head" in q["params"]
    assert cfg.rope_theta == 1e6 and cfg.rms_eps == pytest.approx(1e-6) and cfg.rope_scaling is None
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (4, 2, 16, 128)
    assert q["params"]["bq"].shape == (3, 64) and q["params"]["bk"].shape == (3, 32)
    np.testing.assert_array_equal(q["params"]["bv"][1], q["hf"].model.layers[1].self_attn.v_proj.bias.detach().numpy())
    assert set(cfg.eos_token_ids) == {q["ids"]["<|im_end|>"], q["ids"]["<|endoftext|>"]}
    ll = family("llama3")
    cfg = ll["cfg"]
    assert not cfg.qkv_bias and cfg.tie_embeddings and "lm_head" not in ll["params"] and "bq" not in ll["params"]
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert set(cfg.eos_token_ids) == {ll["ids"]["<|eot_id|>"], ll["ids"]["<|end_of_text|>"]}
    assert cfg.bos_token_id == ll["ids"]["<|begin_of_text|>"]


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(family, name):
    f = family(name)
    ids = np.random.default_rng(1).integers(0, f["cfg"].vocab_size, 48).tolist()   # > 32: llama3 bands matter
    got = np.asarray(_logits(f["runner"].graphdef, f["runner"].state, jnp.asarray([ids]), jnp.asarray([len(ids)])))[0]
    want = _hf_logits(f["hf"], ids)
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_chat_generation_matches_transformers(family, name):
    import torch
    f = family(name)
    prompt = f["tok"].encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = f["runner"].generate([prompt], SamplingParams(max_new_tokens=16, stop_token_ids=(-1,)))[0]
    with torch.no_grad():
        hf = f["hf"].generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert out.tokens == hf[0, len(prompt):].tolist()
    assert len(set(out.tokens)) > 2                      # a real continuation, not one repeated token


@pytest.mark.parametrize("name", FAMILIES)
def test_tokenizer_and_chat_template_match_transformers(family, name, tmp_path):
    from transformers import AutoTokenizer

    from preft_jax.tokenizer import Tokenizer
    f = family(name)
    hf_tok = AutoTokenizer.from_pretrained(f["folder"])
    hf_tok.save_pretrained(tmp_path)                     # transformers' own layout (chat_template.jinja)
    ours_resaved = Tokenizer.from_hf_folder(tmp_path)
    convos = [[{"role": "user", "content": "What is the capital of France?"}],
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi 12345 🙂 "},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "def f(x): pass"}]]
    for msgs in convos:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, return_dict=False)
            assert f["tok"].encode_chat(msgs, add_generation_prompt=gen) == list(want)
            assert ours_resaved.encode_chat(msgs, add_generation_prompt=gen) == list(want)
    for text in ("Numbers 1234567 and   spaces\n\nnew", "Ünïcödé 🙂", "<|im_start|>x<|eot_id|>"):
        assert f["tok"].encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"]
        assert f["tok"].decode(f["tok"].encode(text), skip_special_tokens=False) == text
        for tok in (f["tok"], ours_resaved):             # a raw prompt as HF's tokenizer(text): Llama-3's BOS
            assert tok.encode(text, add_bos=tok.add_bos_default) == hf_tok(text)["input_ids"]
    assert f["tok"].add_bos_default == (name == "llama3")
    assert hf_tok.eos_token_id in f["tok"].eos_token_ids
    if name == "llama3":                                  # the template writes BOS itself: no double BOS
        ids = f["tok"].encode_chat(convos[0])
        assert ids[0] == f["ids"]["<|begin_of_text|>"] and ids[1] != ids[0]


# ------------------------------------------------------------------------------------- PEFT on Qwen2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen2_peft(family, tmp_path_factory):
    import copy

    import torch
    pytest.importorskip("peft", reason="HF reference: peft not installed (pip install -e '.[test]')")
    from peft import LoraConfig, get_peft_model
    f = family("qwen2")
    torch.manual_seed(5)
    peft_model = get_peft_model(copy.deepcopy(f["hf"]), LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, lora_dropout=0.0))
    peft_model.eval()
    folder = tmp_path_factory.mktemp("qwen2_lora")
    peft_model.save_pretrained(folder)
    # Prefill-only reference: scale every LoRA delta by a per-position mask (1 on prompt positions).
    mask = {"value": None}

    def hook(module, inputs, output):
        return output if mask["value"] is None else output * mask["value"][..., None].to(output.dtype)
    for name, module in peft_model.named_modules():
        if name.endswith("lora_B.default"):
            module.register_forward_hook(hook)
    return f, peft_model, folder, mask


def _masked_logits(peft_model, mask, seq, prompt_len):
    import torch
    mask["value"] = (torch.arange(len(seq)) < prompt_len).float()[None]
    try:
        with torch.no_grad():
            return peft_model(input_ids=torch.tensor([seq])).logits[0].numpy()
    finally:
        mask["value"] = None


def test_peft_lora_qwen2_all_tokens(qwen2_peft):
    import torch
    f, peft_model, folder, _ = qwen2_peft
    lora = load_peft_lora(folder, f["cfg"], policy=PositionPolicy(mode="all"))
    bank = build_bank(f["cfg"], [lora])
    ids = np.random.default_rng(2).integers(0, f["cfg"].vocab_size, 24).tolist()
    got = np.asarray(_logits(f["runner"].graphdef, f["runner"].state, jnp.asarray([ids]), jnp.asarray([len(ids)]),
                             bank, jnp.asarray([1])))[0]
    with torch.no_grad():
        want = peft_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    base = _hf_logits(f["hf"], ids)
    assert np.abs(want - base).max() > 0.1 * np.abs(base).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_peft_lora_qwen2_prefill_only(qwen2_peft):
    f, peft_model, folder, mask = qwen2_peft
    lora = load_peft_lora(folder, f["cfg"])               # default policy: prefill (prompt tokens only)
    assert lora.config.policy.mode == "prefill"
    bank = build_bank(f["cfg"], [lora])
    prompt = f["tok"].encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    n_new = 10
    out = f["runner"].generate([prompt], SamplingParams(max_new_tokens=n_new, stop_token_ids=(-1,)),
                               bank=bank, adapter_ids=[1])[0]
    # reference: greedy by full recompute, LoRA active on prompt positions only
    seq = list(prompt)
    for _ in range(n_new):
        seq.append(int(np.argmax(_masked_logits(peft_model, mask, seq, len(prompt))[-1])))
    assert out.tokens == seq[len(prompt):]
    # teacher-forced logits over prompt + generation: equal to the masked reference everywhere,
    # and different from the all-token adapter on the generated positions
    want = _masked_logits(peft_model, mask, seq, len(prompt))
    got = np.asarray(_logits(f["runner"].graphdef, f["runner"].state, jnp.asarray([seq]), jnp.asarray([len(prompt)]),
                             bank, jnp.asarray([1])))[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
    all_tok = _masked_logits(peft_model, mask, seq, len(seq))
    assert np.abs(all_tok[len(prompt):] - want[len(prompt):]).max() > 0.05 * np.abs(want).max()


# ------------------------------------------------------------------------------------------ errors
def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "gpt2" in msg and "GPT2LMHeadModel" in msg
    for supported in ("llama", "mistral", "qwen2", "Qwen2ForCausalLM", "LlamaForCausalLM"):
        assert supported in msg


def test_sliding_window_rules():
    base = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, intermediate_size=128,
                vocab_size=100, max_position_embeddings=4096, sliding_window=1024)
    # Qwen2 ships a window it does not use unless use_sliding_window (or layer_types) says so
    assert config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": False}).qkv_bias
    assert config_from_hf({**base, "model_type": "qwen2", "layer_types": ["full_attention"] * 4})
    for bad in ({"use_sliding_window": True, "max_window_layers": 2},
                {"layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2}):
        with pytest.raises(ValueError, match="Sliding-window"):
            config_from_hf({**base, "model_type": "qwen2", **bad})
    with pytest.raises(ValueError, match="Sliding-window"):
        config_from_hf({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf({**base, "sliding_window": None, "model_type": "llama", "attention_bias": True})
