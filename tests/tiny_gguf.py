"""Writes a tiny random Llama GGUF (Q8_0 weights by default, byte-level BPE tokenizer, ChatML template) for tests."""
from __future__ import annotations

import numpy as np

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _byte_tokens() -> list[str]:
    from preft_jax.tokenizer import _bytes_to_unicode
    return [_bytes_to_unicode()[b] for b in range(256)]


def write_tiny_gguf(path, seed: int = 0, n_layers: int = 2, d: int = 64, n_heads: int = 4, n_kv: int = 2,
                    ffn: int = 96, qtype: str = "Q8_0") -> None:
    """`qtype`: the ggml type of the layer projections (token_embd is always Q8_0)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _byte_tokens() + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab = len(tokens) + 6          # a few unused rows, as real models have
    hd = d // n_heads

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)

    def add(name, shape, norm=False, type_name=qtype):
        if norm:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        arr = (rng.standard_normal(shape) * shape[-1] ** -0.5).astype(np.float32)
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType[type_name])
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[type_name])

    add("token_embd.weight", (vocab, d), type_name="Q8_0")
    add("output_norm.weight", (d,), norm=True)
    for i in range(n_layers):
        add(f"blk.{i}.attn_norm.weight", (d,), norm=True)
        add(f"blk.{i}.ffn_norm.weight", (d,), norm=True)
        add(f"blk.{i}.attn_q.weight", (n_heads * hd, d))
        add(f"blk.{i}.attn_k.weight", (n_kv * hd, d))
        add(f"blk.{i}.attn_v.weight", (n_kv * hd, d))
        add(f"blk.{i}.attn_output.weight", (d, n_heads * hd))
        add(f"blk.{i}.ffn_gate.weight", (ffn, d))
        add(f"blk.{i}.ffn_up.weight", (ffn, d))
        add(f"blk.{i}.ffn_down.weight", (d, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
