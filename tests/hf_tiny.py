"""Tiny random Qwen2 / Llama-3 HF model folders built locally (no hub): torch model + tokenizer files.

Tokenizers are byte-level BPEs trained on a few sentences with the `tokenizers` library, with the
family's pre-tokenizer regex, special tokens, tokenizer_config.json and chat template.
"""
from __future__ import annotations

import json

import pytest

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2-Instruct's template and Llama-3-Instruct's template (verbatim from their tokenizer_config.json).
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris is.",
          "Numbers like 12345 and 2024 appear here.", "def f(x):\n    return x * 2\n",
          "Ünïcödé text, emojis 🙂 and   spaces.", "The the the cat sat on the mat."] * 20


def _bpe_tokenizer(split: str, specials: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(specials)
    return tok


def qwen2_tokenizer(vocab_size: int = 320):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _bpe_tokenizer(QWEN2_SPLIT, specials, vocab_size)
    return tok, {s: tok.token_to_id(s) for s in specials}


def write_qwen2_tokenizer(folder, tok, ids) -> None:
    """Qwen2-style tokenizer.json, tokenizer_config.json (ChatML template) and generation_config.json."""
    specials = list(ids)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
        "model_max_length": 128, "chat_template": QWEN2_TEMPLATE, "errors": "replace",
        "added_tokens_decoder": {str(ids[s]): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False} for s in specials},
    }))
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": False}))


def llama3_tokenizer(vocab_size: int = 320):
    """Llama-3-style tokenizer (BOS added by the post-processor, as Meta's tokenizer.json does)."""
    from tokenizers import processors
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = _bpe_tokenizer(LLAMA3_SPLIT, specials, vocab_size)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok, {s: tok.token_to_id(s) for s in specials}


def write_llama3_tokenizer(folder, tok, ids) -> None:
    specials = list(ids)
    bos = ids["<|begin_of_text|>"]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "model_max_length": 128, "chat_template": LLAMA3_TEMPLATE,
        "added_tokens_decoder": {str(ids[s]): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False} for s in specials},
    }))
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": bos, "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]], "do_sample": False}))


def _reference(name: str):
    """The torch reference package, or a skip naming it (these builders are test references only)."""
    return pytest.importorskip(name, reason=f"HF reference: {name} not installed (pip install -e '.[test]')")


def randomize_(model, seed: int):
    """Non-trivial weights everywhere: norm scales around 1 and random q/k/v biases (HF zero-inits them)."""
    torch = _reference("torch")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def tiny_qwen2(folder, seed: int = 0, tie: bool = False):
    """(torch Qwen2ForCausalLM in float32 eval mode, special ids) saved with its tokenizer in `folder`."""
    torch = _reference("torch")
    _reference("transformers")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    tok, ids = qwen2_tokenizer()
    cfg = Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=tie,
                      use_sliding_window=False, sliding_window=64, max_window_layers=2,
                      initializer_range=0.2, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    model = randomize_(Qwen2ForCausalLM(cfg), seed).eval()
    model.save_pretrained(folder)
    write_qwen2_tokenizer(folder, tok, ids)         # after: save_pretrained writes its own generation_config
    return model, ids


def tiny_llama3(folder, seed: int = 0, tie: bool = True, max_positions: int = 128):
    """(torch LlamaForCausalLM with llama3 rope scaling, special ids) saved with its tokenizer."""
    torch = _reference("torch")
    _reference("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    tok, ids = llama3_tokenizer()
    # original_max_position_embeddings=32 puts this head_dim's frequencies in all three llama3 bands
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                      rms_norm_eps=1e-5, tie_word_embeddings=tie, initializer_range=0.2,
                      rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32},
                      bos_token_id=ids["<|begin_of_text|>"], eos_token_id=[ids["<|end_of_text|>"], ids["<|eot_id|>"]])
    model = randomize_(LlamaForCausalLM(cfg), seed).eval()
    model.save_pretrained(folder)
    write_llama3_tokenizer(folder, tok, ids)
    return model, ids
