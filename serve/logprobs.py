"""OpenAI log-probability formats from the engine's per-token entries (serve/output.py).

An entry is (logprob, [(token_id, logprob), ...]) for one token: the model's log-softmax of the raw
logits (before temperature, top-p and top-k) at the position that produced the token, and the k
most likely tokens there. Prompt entries (echo) start with None: nothing predicts the first token.

* chat (`logprobs: true`, `top_logprobs: k`): choices[].logprobs.content[] =
  {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] * k};
* legacy completions (`logprobs: k`): choices[].logprobs = {tokens, token_logprobs, top_logprobs,
  text_offset}, `top_logprobs` a {token: logprob} map per token (None for the first prompt token):
  the k most likely and the token itself (up to k + 1 entries, as OpenAI and vLLM answer).
  `text_offset[i]` is the character offset in the choice's `text` where token i's text starts.
A token whose bytes are not valid UTF-8 on their own (part of a character) is written
"bytes:\\xNN..." in the legacy `tokens` and chat `token` fields; chat `bytes` always has the raw bytes.
The stop token that ended a completion (EOS or one of `stop_token_ids`) is listed last, with its
entry, as vLLM lists it (`Result.scored`; streamed in the chunk that carries finish_reason): its
text is not in the choice's text, and its `text_offset` is the text's end.
"""
from __future__ import annotations


class TokenText:
    """Per-token strings and bytes for a tokenizer (memoized)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, i: int) -> bytes:
        b = self._bytes.get(i)
        if b is None:
            fn = getattr(self.tokenizer, "token_bytes", None)
            b = fn(i) if fn is not None else self.tokenizer.decode([i], skip_special_tokens=False).encode("utf-8")
            self._bytes[i] = b
        return b

    def text(self, i: int) -> str:
        b = self.bytes(i)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def chat_content(tt: TokenText, ids, entries) -> list[dict]:
    out = []
    for i, e in zip(ids, entries):
        if e is None:
            continue
        lp, top = e
        out.append({"token": tt.text(i), "logprob": lp, "bytes": list(tt.bytes(i)),
                    "top_logprobs": [{"token": tt.text(j), "logprob": v, "bytes": list(tt.bytes(j))}
                                     for j, v in top]})
    return out


def legacy(tt: TokenText, ids, entries, offsets) -> dict:
    """Legacy completions logprobs for tokens `ids` starting at character `offsets[i]` in the text."""
    tokens, token_lps, tops = [], [], []
    for i, e in zip(ids, entries):
        tokens.append(tt.text(i))
        if e is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(e[0])
            top = {tt.text(j): v for j, v in e[1]}
            top.setdefault(tt.text(i), e[0])
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": list(offsets)}


def text_offsets(tokenizer, ids, start: int = 0, prefix=(), skip_special_tokens: bool = True) -> list[int]:
    """Character offset where each of `ids` starts in a text `start` characters long before the
    text of `prefix` (tokens already sent): start + len(decode(prefix + ids[:i])). Generated text
    leaves special tokens out (the default); an echoed prompt's text holds them
    (`skip_special_tokens=False`)."""
    prefix, ids = list(prefix), list(ids)
    return [start + (len(tokenizer.decode(prefix + ids[:k], skip_special_tokens=skip_special_tokens))
                     if prefix or k else 0) for k in range(len(ids))]
