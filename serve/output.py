"""Consumer-side processing of a request's token events: the engine emits token ids only; text,
stop strings and UTF-8 hold-back happen here, in the consumer (the server's event loop, or the
thread calling `Request.stream()`), in time linear in the output length.

Engine events:  ("tokens", [ids]) ... then ("finished", reason) or ("error", EngineError)
                (with log-probabilities asked for: ("logprobs", entries) before each "tokens", and
                ("prompt_logprobs", entries) once)
Public events:  ("delta", (ids, text)) ... then ("done", Result) or ("error", EngineError)

Log-prob entries are kept aligned with the kept tokens: `self.logprobs[i]` is token `self.tokens[i]`'s
(a consumer streaming them reads the entries of each delta's ids from there).

A stop string reached in the text ends the request at once for the consumer (the text is cut before
it, the tokens after the one that completed it are dropped) and cancels it in the engine, which
stops generating within a step.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from serve.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Result:
    """A finished request's outcome (built here by `RequestOutput`; `serve.request` re-exports it)."""
    request_id: str
    adapter: str | None
    tokens: list[int]             # generated ids (a stop token is not included: its text is not output)
    text: str | None              # decoded text (None without a tokenizer), cut before a stop string
    finish_reason: str            # "stop" | "length" | "cancelled"
    prompt_tokens: int
    logprobs: list | None = None          # per generated token (logprob, [(id, logprob)] * k), if asked for
    prompt_logprobs: list | None = None   # per prompt token, entry 0 None, if asked for
    stop_token_id: int | None = None      # the stop token (EOS or stop_token_ids) that ended it, if one did
    stop_logprob: tuple | None = None     # its log-prob entry, if log-probabilities were asked for

    @property
    def stop_token(self) -> bool:
        """Ended by a stop token the model generated (not in `tokens`: its text is not output)."""
        return self.stop_token_id is not None

    def scored(self) -> tuple[list[int], list]:
        """(ids, log-prob entries) of every generated token, the stop token last when one ended the
        request: what a response's logprobs list (vLLM lists the stop token too; its text is not
        output). Needs `logprobs`."""
        if self.stop_token_id is None:
            return list(self.tokens), list(self.logprobs)
        return list(self.tokens) + [self.stop_token_id], list(self.logprobs) + [self.stop_logprob]

    @property
    def completion_tokens(self) -> int:
        """Generated tokens, the stop token included: it was generated (and computed), and OpenAI and
        vLLM count it."""
        return len(self.tokens) + self.stop_token

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


class RequestOutput:
    """Turns one `serve.request.Request`'s engine events into public events (this module does not import
    serve.request: the request imports its output, never the other way)."""

    def __init__(self, req, tokenizer, cancel: Callable | None = None):
        self.req, self.tokenizer, self.cancel = req, tokenizer, cancel
        self.detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer, req.stop_strings)
        self.tokens: list[int] = []
        self.logprobs: list | None = None if req.sampling.logprobs is None else []
        self.prompt_logprobs: list | None = None
        self._pending_logprobs: list = []
        self._stop = (None, None)                 # (the stop token, its log-prob entry) the engine named
        self.done = False

    def handle(self, event) -> list:
        """Public events for one engine event (none once the request is done)."""
        if self.done:
            return []
        kind, payload = event
        if kind == "logprobs":
            self._pending_logprobs += list(payload)
            return []
        if kind == "prompt_logprobs":
            self.prompt_logprobs = list(payload)
            return []
        if kind == "stop_token":
            self._stop = (int(payload[0]), payload[1])
            return []
        if kind == "tokens":
            ids = [int(t) for t in payload]
            if self.logprobs is not None:
                entries = self._pending_logprobs[:len(ids)]
                self._pending_logprobs = self._pending_logprobs[len(ids):]
                self.logprobs += entries + [None] * (len(ids) - len(entries))
            if self.detok is None:
                self.tokens += ids
                return [("delta", (ids, ""))]
            before = len(self.tokens)
            self.tokens += ids
            out = self.detok.add(ids)
            if out.stopped:
                keep = out.n_tokens - before                # tokens up to the one completing the stop string
                self.tokens = self.tokens[:out.n_tokens]
                if self.logprobs is not None:
                    self.logprobs = self.logprobs[:out.n_tokens]
                if self.cancel is not None:
                    self.cancel(self.req)
                events = [("delta", (ids[:keep], out.text))] if keep or out.text else []
                return events + [self._finish("stop")]
            return [("delta", (ids, out.text))]
        if kind == "finished":
            # the engine's "stop" is a stop token; a stop string completed by text held back until
            # now (a partial character at the end) ends the request as "stop" too
            tail = None if self.detok is None else self.detok.flush()
            events = [("delta", ([], tail.text))] if tail is not None and tail.text else []
            reason = "stop" if tail is not None and tail.stopped else payload
            return events + [self._finish(reason, stop_token=payload == "stop")]
        if kind == "error":
            self.done = True
            return [("error", payload)]
        raise ValueError(f"unknown engine event {kind!r}")

    def _finish(self, reason: str, stop_token: bool = False):
        self.done = True
        text = None if self.detok is None else self.detok.text
        stop_id, stop_lp = self._stop if stop_token else (None, None)
        result = Result(self.req.request_id, self.req.adapter, list(self.tokens), text, reason,
                        len(self.req.prompt_ids), None if self.logprobs is None else list(self.logprobs),
                        self.prompt_logprobs, stop_id, None if self.logprobs is None else stop_lp)
        self.req.result = result
        return ("done", result)
