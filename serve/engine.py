"""Slot-based continuous batching: adapted prefill into free slots, one decode step for all slots.

Each `step()`:
  1. admits waiting requests into free cache slots and prefills them in one batch with their
     adapters (prompt tokens adapted; the last prompt token's logits sample the first token);
  2. runs one decode step for every slot: in PreFT mode ("prefill") on the base weights alone
     (`bank=None`: no adapter work at decode), in the all-token baseline ("all") with the bank
     (per-token gathered adapters, BGMV);
  3. retires finished requests (stop token or string, max tokens, cache full) and frees slots.
Inactive slots are computed and ignored, so every step has the same shapes (no recompiles).
"""
from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections import deque
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.generation import ModelRunner, bucket_length
from preft_jax.kv_cache import KVCache
from preft_jax.sampling import SamplingParams, sample
from serve.errors import PromptTooLongError, RequestError
from serve.registry import AdapterRegistry

_sample = jax.jit(sample)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 8
    max_len: int = 512            # KV-cache length per slot (prompt + generated)
    mode: str = "prefill"         # "prefill" (PreFT: base decode) or "all" (all-token baseline)
    prefill_batch: int = 4        # prompts prefilled together (padded to this many rows)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("prefill", "all"):
            raise ValueError(f"engine mode must be 'prefill' or 'all', got {self.mode!r}")
        if self.n_slots < 1 or self.prefill_batch < 1 or self.max_len < 2:
            raise ValueError("n_slots, prefill_batch must be >= 1 and max_len >= 2")


@dataclasses.dataclass
class Result:
    request_id: int
    adapter: str | None
    tokens: list[int]
    text: str | None
    finish_reason: str            # "stop" | "length"
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    adapter_slot: int
    events: "queue.Queue" = dataclasses.field(default_factory=queue.Queue)
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_text: int = 0
    result: Result | None = None

    def wait(self, timeout: float | None = None) -> Result:
        """Blocks until finished (background engine) and returns the result."""
        while self.result is None:
            kind, payload = self.events.get(timeout=timeout)
            if kind == "error":
                raise RuntimeError(payload)
        return self.result

    def stream(self, timeout: float | None = None):
        """Yields ("delta", (token_ids, text)) events and finally ("done", Result)."""
        while True:
            kind, payload = self.events.get(timeout=timeout)
            if kind == "error":
                raise RuntimeError(payload)
            yield kind, payload
            if kind == "done":
                return


class Engine:
    def __init__(self, runner: ModelRunner, registry: AdapterRegistry, config: EngineConfig = EngineConfig(),
                 tokenizer=None):
        self.runner, self.registry, self.config, self.tokenizer = runner, registry, config, tokenizer
        if config.max_len > runner.cfg.max_seq_len:
            raise ValueError(f"max_len {config.max_len} exceeds the model's context {runner.cfg.max_seq_len}")
        n = config.n_slots
        self.cache = KVCache.create(runner.cfg, n, config.max_len, runner.dtype)
        self._slot_req: list[Request | None] = [None] * n
        self._last = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._plen = np.ones(n, np.int32)
        self._adapter = np.zeros(n, np.int32)
        self._temp = np.zeros(n, np.float32)
        self._top_p = np.ones(n, np.float32)
        self._top_k = np.zeros(n, np.int32)
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._key = jax.random.key(config.seed)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0

    # ---- submission ------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], adapter: str | None = None,
               sampling: SamplingParams = SamplingParams(), stop_strings: Sequence[str] = ()) -> Request:
        """Validates and queues a request. Raises RequestError subclasses; nothing else is affected."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise RequestError("prompt is empty")
        vocab = self.runner.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_len
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; this server's context is {limit} "
                                     f"tokens (prompt + at least 1 generated)")
        if stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need an engine with a tokenizer")
        slot = self.registry.acquire(adapter)             # raises UnknownAdapterError
        req = Request(next(self._ids), prompt_ids, adapter, sampling, tuple(s for s in stop_strings if s), slot)
        with self._lock:
            self._waiting.append(req)
        self._wake.set()
        return req

    def generate(self, requests: Sequence[tuple]) -> list[Result]:
        """Synchronous: submit (prompt_ids, adapter, sampling[, stop_strings]) tuples, step until done."""
        if self._thread is not None:
            raise RuntimeError("engine is running in the background; use submit() + wait()")
        reqs = [self.submit(*r) for r in requests]
        while any(r.result is None for r in reqs):
            self.step()
        return [r.result for r in reqs]

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._slot_req)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> None:
        self._admit()
        if any(r is not None for r in self._slot_req):
            self._decode()
        self.steps += 1

    def _next_key(self):
        self._key, sub = jax.random.split(self._key)
        return sub

    def _admit(self):
        free = [i for i, r in enumerate(self._slot_req) if r is None]
        with self._lock:
            batch = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting),
                                                                 self.config.prefill_batch))]
        if not batch:
            return
        P = self.config.prefill_batch
        T = min(bucket_length(max(len(r.prompt_ids) for r in batch)), self.config.max_len)
        tokens = np.zeros((P, T), np.int32)
        lengths = np.ones(P, np.int32)
        slot_ids = np.full(P, self.config.n_slots, np.int32)     # padding rows: out of range, dropped
        adapter_ids = np.zeros(P, np.int32)
        temp, top_p, top_k = np.zeros(P, np.float32), np.ones(P, np.float32), np.zeros(P, np.int32)
        for row, (req, slot) in enumerate(zip(batch, free)):
            tokens[row, :len(req.prompt_ids)] = req.prompt_ids
            lengths[row], slot_ids[row], adapter_ids[row] = len(req.prompt_ids), slot, req.adapter_slot
            temp[row], top_p[row], top_k[row] = req.sampling.temperature, req.sampling.top_p, req.sampling.top_k
        bank = self.registry.bank
        logits, self.cache = self.runner.prefill(
            jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(slot_ids), self.cache, bank,
            None if bank is None else jnp.asarray(adapter_ids))
        first = np.asarray(_sample(logits, self._next_key(), jnp.asarray(temp), jnp.asarray(top_p),
                                   jnp.asarray(top_k)))
        for row, (req, slot) in enumerate(zip(batch, free)):
            self._slot_req[slot] = req
            self._plen[slot] = self._pos[slot] = len(req.prompt_ids)
            self._adapter[slot] = req.adapter_slot
            self._temp[slot], self._top_p[slot], self._top_k[slot] = temp[row], top_p[row], top_k[row]
            self._accept(slot, int(first[row]))

    def _decode(self):
        bank = self.registry.bank if self.config.mode == "all" else None
        logits, self.cache = self.runner.decode(
            jnp.asarray(self._last), jnp.asarray(self._pos), self.cache, bank,
            None if bank is None else jnp.asarray(self._adapter),
            None if bank is None else jnp.asarray(self._plen))
        nxt = np.asarray(_sample(logits, self._next_key(), jnp.asarray(self._temp), jnp.asarray(self._top_p),
                                 jnp.asarray(self._top_k)))
        for slot, req in enumerate(self._slot_req):
            if req is not None:
                self._pos[slot] += 1
                self._accept(slot, int(nxt[slot]))

    def _accept(self, slot: int, token: int):
        """Records a sampled token for the request in `slot`; retires it if finished."""
        req = self._slot_req[slot]
        sp = req.sampling
        if token in sp.stop_token_ids:
            return self._finish(slot, "stop")
        req.tokens.append(token)
        self._last[slot] = token
        text_delta = ""
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.tokens)
            hit = min((i for i in (req.text.find(s) for s in req.stop_strings) if i >= 0), default=-1)
            if hit >= 0:
                req.text = req.text[:hit]
                self._emit_text(req)
                return self._finish(slot, "stop")
            # hold back text that could be the start of a stop string, and partial UTF-8
            hold = max((len(s) - 1 for s in req.stop_strings), default=0)
            safe = len(req.text) - hold
            if req.text.endswith("\ufffd"):
                safe = min(safe, len(req.text) - 1)
            if safe > req.emitted_text:
                text_delta = req.text[req.emitted_text:safe]
                req.emitted_text = safe
        req.events.put(("delta", ([token], text_delta)))
        if len(req.tokens) >= sp.max_new_tokens:
            return self._finish(slot, "length")
        if self._pos[slot] + 1 >= self.config.max_len:        # next token would not fit in the cache
            return self._finish(slot, "length")

    def _emit_text(self, req: Request):
        if len(req.text) > req.emitted_text:
            req.events.put(("delta", ([], req.text[req.emitted_text:])))
            req.emitted_text = len(req.text)

    def _finish(self, slot: int, reason: str):
        req = self._slot_req[slot]
        if self.tokenizer is not None:
            self._emit_text(req)
        req.result = Result(req.request_id, req.adapter, list(req.tokens),
                            req.text if self.tokenizer is not None else None, reason, len(req.prompt_ids))
        self._slot_req[slot] = None
        self.registry.release(req.adapter_slot)
        req.events.put(("done", req.result))

    # ---- background loop -------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="preft-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self):
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self):
        while not self._stop.is_set():
            if not self.busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception as e:  # never hang clients: fail every in-flight request
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                time.sleep(0.01)

    def _fail_all(self, message: str):
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for req in waiting:
            self.registry.release(req.adapter_slot)
            req.events.put(("error", message))
        for slot, req in enumerate(self._slot_req):
            if req is not None:
                self._slot_req[slot] = None
                self.registry.release(req.adapter_slot)
                req.events.put(("error", message))
