"""OpenAI response bodies and stream chunks (no engine, no HTTP): completions (echo, legacy
logprobs), chat completions (chat logprobs), models, usage, and the SSE encoding.

A formatter covers one request's choices (choice k = prompt k // n, sample k % n, OpenAI's order):
`response(reqs, results)` is the non-streaming body; for a stream `first_chunks()` comes first, then
`delta_chunks(k, output, ids, text)` per token delta, `done_chunks(k, output, result)` when choice k
ends, and `usage_chunk(results)` last when the client asked for usage.
"""
from __future__ import annotations

import json
import time
import uuid

from preft_jax.adapters import policy as position_policy
from serve import logprobs as logprobs_fmt

SSE_DONE = "data: [DONE]\n\n"


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(prompts: list[list[int]], results, generated: bool = True) -> dict:
    """`generated` False: the tokens were generated only to score the prompts (echo, max_tokens 0)."""
    p = sum(len(ids) for ids in prompts)          # each prompt once, whatever n
    c = sum(r.completion_tokens for r in results) if generated else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def result_text(tokenizer, result) -> str:
    return result.text if result.text is not None else tokenizer.decode(result.tokens)


def model_entry(name: str, kind: str, created: int, base_id: str, policy=None) -> dict:
    """One /v1/models entry; an adapter's carries the position policy it is served with
    (`PositionPolicy.describe()` and its JSON form; null while a folder adapter is not loaded)."""
    entry = {"id": name, "object": "model", "created": created, "owned_by": "preft_jax", "kind": kind,
             "root": base_id, "parent": None if kind == "base" else base_id}
    if kind != "base":
        entry["policy"] = None if policy is None else policy.describe()
        entry["position_policy"] = None if policy is None else position_policy.to_json(policy)
    return entry


class CompletionFormat:
    """/v1/completions: `prompts` (token ids) and `prompt_texts` (what `echo` repeats), `n` samples
    each, legacy logprobs with `k_lp` alternatives (None: none). `score_only` (echo with max_tokens 0):
    each choice is its echoed prompt alone, finish_reason "length", no completion tokens (what was
    generated to get there is left out)."""

    def __init__(self, model: str, tokenizer, token_text: logprobs_fmt.TokenText, prompts, prompt_texts,
                 n: int, echo: bool, k_lp: int | None, score_only: bool = False, added: list[int] | None = None):
        self.id, self.created, self.model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.tokenizer, self.token_text = tokenizer, token_text
        self.prompts, self.prompt_texts, self.n, self.echo, self.k_lp = prompts, prompt_texts, n, echo, k_lp
        self.score_only = score_only
        self.added = added or [0] * len(prompts)      # per prompt: leading ids not in its text (an added BOS)
        self._sent: dict[int, list[int]] = {}          # ids streamed per choice
        self._echoed: set[int] = set()

    def choice(self, k, text, logprobs=None, finish=None) -> dict:
        return {"index": k, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def envelope(self, choices) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def _start(self, k) -> int:
        """Where choice k's generated text starts in its `text` (after the echoed prompt)."""
        return len(self.prompt_texts[k // self.n]) if self.echo else 0

    def echo_part(self, k, out) -> tuple[str, dict | None]:
        """(text, logprobs) of choice k's echoed prompt."""
        i = k // self.n
        text = self.prompt_texts[i]
        if self.k_lp is None:
            return text, None
        entries = out.prompt_logprobs or [None] * len(self.prompts[i])
        a = self.added[i]             # the echoed text holds the prompt's special tokens, not an added BOS
        offsets = [0] * a + logprobs_fmt.text_offsets(self.tokenizer, self.prompts[i][a:], skip_special_tokens=False)
        return text, logprobs_fmt.legacy(self.token_text, self.prompts[i], entries, offsets)

    def _finish(self, result) -> str:
        return "length" if self.score_only else result.finish_reason

    def response(self, reqs, results) -> dict:
        choices = []
        for k, (req, result) in enumerate(zip(reqs, results)):
            if self.score_only:
                choices.append(self.choice(k, *self.echo_part(k, req.output()), self._finish(result)))
                continue
            text, lp = result_text(self.tokenizer, result), None
            if self.k_lp is not None:
                ids, entries = result.scored()              # the stop token last, at the text's end
                lp = logprobs_fmt.legacy(self.token_text, ids, entries,
                                         logprobs_fmt.text_offsets(self.tokenizer, ids, self._start(k)))
            if self.echo:
                etext, elp = self.echo_part(k, req.output())
                text = etext + text
                if lp is not None:
                    lp = {key: elp[key] + lp[key] for key in lp}
            choices.append(self.choice(k, text, lp, result.finish_reason))
        return dict(self.envelope(choices), usage=usage(self.prompts, results, not self.score_only))

    # ---- streaming ---------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        return []

    def _echo_chunks(self, k, out) -> list[dict]:
        if not self.echo or k in self._echoed:
            return []
        self._echoed.add(k)
        return [self.envelope([self.choice(k, *self.echo_part(k, out))])]

    def delta_chunks(self, k, out, ids, text) -> list[dict]:
        chunks = self._echo_chunks(k, out)
        if self.score_only:
            return chunks
        sent = self._sent.setdefault(k, [])
        lp = None
        if self.k_lp is not None and ids:
            lp = logprobs_fmt.legacy(self.token_text, ids, out.logprobs[len(sent):len(sent) + len(ids)],
                                     logprobs_fmt.text_offsets(self.tokenizer, ids, self._start(k), sent))
        sent += ids
        if text or lp is not None:
            chunks.append(self.envelope([self.choice(k, text, lp)]))
        return chunks

    def done_chunks(self, k, out, result) -> list[dict]:
        lp = None
        if self.k_lp is not None and result.stop_token and not self.score_only:     # the stop token's entry
            sent = self._sent.get(k, [])
            lp = logprobs_fmt.legacy(self.token_text, [result.stop_token_id], [result.stop_logprob],
                                     logprobs_fmt.text_offsets(self.tokenizer, [result.stop_token_id],
                                                               self._start(k), sent))
        return self._echo_chunks(k, out) + [self.envelope([self.choice(k, "", lp, self._finish(result))])]

    def usage_chunk(self, results) -> dict:
        return dict(self.envelope([]), usage=usage(self.prompts, results, not self.score_only))


class ChatFormat:
    """/v1/chat/completions: one prompt (`prompt_ids`), `n` choices, chat logprobs when `k_lp` is set."""

    def __init__(self, model: str, tokenizer, token_text: logprobs_fmt.TokenText, prompt_ids, n: int,
                 k_lp: int | None):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.tokenizer, self.token_text, self.prompt_ids, self.n, self.k_lp = tokenizer, token_text, prompt_ids, n, k_lp
        self._sent: dict[int, int] = {}                # tokens streamed per choice

    def _logprobs(self, ids, entries) -> dict:
        return {"content": logprobs_fmt.chat_content(self.token_text, ids, entries), "refusal": None}

    def chunk(self, k, text, finish, role=False, logprobs=None) -> dict:
        delta = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def response(self, reqs, results) -> dict:
        choices = []
        for k, result in enumerate(results):
            lp = None if self.k_lp is None else self._logprobs(*result.scored())
            choices.append({"index": k, "message": {"role": "assistant", "content": result_text(self.tokenizer, result)},
                            "logprobs": lp, "finish_reason": result.finish_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": usage([self.prompt_ids], results)}

    # ---- streaming ---------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        return [self.chunk(k, "", None, role=True) for k in range(self.n)]

    def delta_chunks(self, k, out, ids, text) -> list[dict]:
        lp, sent = None, self._sent.get(k, 0)
        if self.k_lp is not None and ids:
            lp = self._logprobs(ids, out.logprobs[sent:sent + len(ids)])
        self._sent[k] = sent + len(ids)
        return [self.chunk(k, text, None, logprobs=lp)] if text or lp is not None else []

    def done_chunks(self, k, out, result) -> list[dict]:
        lp = None
        if self.k_lp is not None and result.stop_token:           # the stop token's entry
            lp = self._logprobs([result.stop_token_id], [result.stop_logprob])
        return [self.chunk(k, None, result.finish_reason, logprobs=lp)]

    def usage_chunk(self, results) -> dict:
        last = self.chunk(0, None, None)
        last["choices"], last["usage"] = [], usage([self.prompt_ids], results)
        return last
