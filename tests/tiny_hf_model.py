"""A tiny random Llama written as an HF model folder (config.json, model.safetensors, a byte-level
tokenizer.json with a ChatML template), so CLI tests can run `python -m train.sft --model FOLDER`."""
from __future__ import annotations

import json
import pathlib

import numpy as np

from preft_jax.config import tiny_config
from reference_llama import random_params

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_hf_config(**overrides):
    return tiny_config(**{"vocab_size": 256 + len(SPECIALS), "max_seq_len": 512, "bos_token_id": None,
                          "eos_token_ids": (256 + SPECIALS.index("<|im_end|>"),), **overrides})


def write_tiny_hf_model(folder, seed: int = 0, **overrides) -> pathlib.Path:
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = tiny_hf_config(**overrides)
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    p = random_params(cfg, seed)
    t = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i in range(cfg.n_layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = p["attn_norm"][i]
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = p["mlp_norm"][i]
        for ours, hf in names.items():
            t[f"model.layers.{i}.{hf}.weight"] = p[ours][i].T
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": True,
        "max_position_embeddings": cfg.max_seq_len, "hidden_act": "silu"}))
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}))
    return folder


def even_token_reward(completion_ids, answer) -> float:
    """A GRPO reward a random model gets a spread of: the fraction of even token ids."""
    return float(np.mean([t % 2 == 0 for t in completion_ids])) if completion_ids else 0.0
