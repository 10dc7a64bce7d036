"""A UTF-8 byte tokenizer (ids 0..255) for the tiny random test/demo model (`--model tiny`).

It has the interface the engine and server use from `preft_jax.tokenizer.Tokenizer`: encode,
decode, apply_chat_template, encode_chat, eos_token_ids, bos_token_id, vocab_size.
"""
from __future__ import annotations

from typing import Iterable


class ByteTokenizer:
    vocab_size = 256
    chat_template = "byte-chat"
    add_bos_default = False          # a text prompt gets no BOS (as `Tokenizer.add_bos_default`)

    def __init__(self, bos_token_id: int = 1, eos_token_ids: tuple[int, ...] = (2,)):
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.special_token_ids = frozenset({bos_token_id, *eos_token_ids})

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        return bytes([int(i)])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **_) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if continue_final_message:              # the last message left open, to be continued
            return text[:-1]
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kw))
