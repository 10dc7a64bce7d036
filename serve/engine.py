"""Slot-based continuous batching: adapted prefill into free slots, one decode step for all slots.

Each `step()`:
  1. retires cancelled requests, then admits waiting requests into free cache slots and prefills
     them in one batch with their adapters (prompt tokens adapted; the last prompt token's logits
     sample the first token);
  2. runs one decode step for every slot: in PreFT mode ("prefill") on the base weights alone
     (`bank=None`: no adapter work at decode), in the all-token baseline ("all") with the bank
     (per-token gathered adapters, BGMV);
  3. retires finished requests (stop token or string, max tokens, cache full) and frees slots.
Inactive slots are computed and ignored, so every step has the same shapes (no recompiles; prefill
compiles once per power-of-two prompt-length bucket).

Two APIs: `generate(requests)` steps synchronously until all are done; `start()` runs the step loop
in a background thread, and `submit()` returns a `Request` whose events ("delta", then "done") are
put into a queue (or any object with `.put`, e.g. an asyncio bridge) as tokens are produced.
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
_argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _pick(logits, key, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Per-row sampling (`preft_jax.sampling.sample`); an all-greedy batch skips its sort over the vocab."""
    if not np.any(temperature > 0):
        return np.asarray(_argmax(logits))          # == sample() for temperature 0 rows
    return np.asarray(_sample(logits, key, jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k)))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 8
    max_len: int = 512            # KV-cache length per slot (prompt + generated tokens)
    mode: str = "prefill"         # "prefill" (PreFT: base decode) or "all" (all-token baseline)
    prefill_batch: int = 4        # prompts prefilled together (padded to this many rows)
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("prefill", "all"):
            raise ValueError(f"engine mode must be 'prefill' or 'all', got {self.mode!r}")
        if self.n_slots < 1 or self.prefill_batch < 1 or self.max_len < 2:
            raise ValueError("n_slots, prefill_batch must be >= 1 and max_len >= 2")


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One request for `Engine.generate` (tuples (prompt_ids, adapter, sampling[, stop]) work too)."""
    prompt_ids: Sequence[int]
    adapter: str | None = None
    sampling: SamplingParams = SamplingParams()
    stop: Sequence[str] = ()


@dataclasses.dataclass
class Result:
    request_id: int
    adapter: str | None
    tokens: list[int]             # generated ids (a stop token is not included)
    text: str | None              # decoded text (None without a tokenizer), cut before a stop string
    finish_reason: str            # "stop" | "length" | "cancelled"
    prompt_tokens: int

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


@dataclasses.dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    adapter_slot: int
    events: object = dataclasses.field(default_factory=queue.Queue)   # anything with .put(event)
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    emitted_text: int = 0
    cancelled: bool = False
    result: Result | None = None

    def wait(self, timeout: float | None = None) -> Result:
        """Blocks until finished (background engine) and returns the result (events: a queue.Queue)."""
        while self.result is None:
            kind, payload = self.events.get(timeout=timeout)
            if kind == "error":
                raise EngineError(payload)
        return self.result

    def stream(self, timeout: float | None = None):
        """Yields ("delta", (token_ids, text)) events and finally ("done", Result)."""
        while True:
            kind, payload = self.events.get(timeout=timeout)
            if kind == "error":
                raise EngineError(payload)
            yield kind, payload
            if kind == "done":
                return


class Engine:
    def __init__(self, runner: ModelRunner, registry: AdapterRegistry, config: EngineConfig = EngineConfig(),
                 tokenizer=None):
        self.runner, self.registry, self.config, self.tokenizer = runner, registry, config, tokenizer
        if config.max_len > runner.cfg.max_seq_len:
            raise ValueError(f"max_len {config.max_len} exceeds the model's context {runner.cfg.max_seq_len}")
        registry.set_mode(config.mode)        # the engine's mode decides which tokens adapters act on
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

    @property
    def mode(self) -> str:
        return self.config.mode

    # ---- submission ------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], adapter: str | None = None,
               sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
               events=None) -> Request:
        """Validates and queues a request. Raises RequestError subclasses (UnknownAdapterError,
        PromptTooLongError, ...) before anything is queued, so nothing else is affected.

        Stops at any of `sampling.stop_token_ids` (default: the model's EOS ids; pass (-1,) for
        none) and, with a tokenizer, at any of the `stop` strings (the text is cut before it)."""
        prompt_ids, stop = self._check(prompt_ids, sampling, stop)
        stop_ids = tuple(sampling.stop_token_ids) or tuple(self.runner.cfg.eos_token_ids)
        slot = self.registry.acquire(adapter)             # raises UnknownAdapterError
        req = Request(next(self._ids), prompt_ids, adapter, sampling, stop_ids, stop, slot)
        if events is not None:
            req.events = events
        with self._lock:
            self._waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        """Stops a queued or running request at the next step (finish_reason "cancelled")."""
        req.cancelled = True
        self._wake.set()

    def generate(self, requests: Sequence) -> list[Result]:
        """Synchronous: submits GenerationRequests (or (prompt_ids, adapter, sampling[, stop]) tuples)
        and steps until all are done. Every request is validated before any is queued."""
        if self._thread is not None:
            raise RuntimeError("engine is running in the background; use submit() + wait()")
        reqs = [r if isinstance(r, GenerationRequest) else GenerationRequest(*r) for r in requests]
        for r in reqs:       # validate all first, so a bad one leaves nothing queued
            self._validate_only(r)
        handles = [self.submit(r.prompt_ids, r.adapter, r.sampling, r.stop) for r in reqs]
        while any(h.result is None for h in handles):
            self.step()
        return [h.result for h in handles]

    def _validate_only(self, r: GenerationRequest):
        self._check(r.prompt_ids, r.sampling, r.stop)
        if r.adapter is not None and r.adapter not in self.registry:
            self.registry.acquire(r.adapter)          # raises UnknownAdapterError

    def _check(self, prompt_ids, sampling: SamplingParams, stop):
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise RequestError("prompt is empty")
        vocab = self.runner.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        limit = self.config.max_len
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the context length is {limit} "
                                     f"tokens (prompt + at least 1 generated token)")
        if len(prompt_ids) + sampling.max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {len(prompt_ids)} tokens + max_tokens={sampling.max_new_tokens} "
                                     f"exceeds the context length {limit}; ask for at most "
                                     f"{limit - len(prompt_ids)} tokens")
        stop = tuple(s for s in stop if s)
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need an engine with a tokenizer")
        return prompt_ids, stop

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._slot_req)

    @property
    def active(self) -> int:
        """Requests holding a cache slot now."""
        return sum(r is not None for r in self._slot_req)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> None:
        for slot, req in enumerate(self._slot_req):
            if req is not None and req.cancelled:
                self._finish(slot, "cancelled")
        self._admit()
        if any(r is not None for r in self._slot_req):
            self._decode()
        self.steps += 1

    def _next_key(self):
        self._key, sub = jax.random.split(self._key)
        return sub

    def _admit(self):
        free = [i for i, r in enumerate(self._slot_req) if r is None]
        batch = []
        with self._lock:
            while self._waiting and len(batch) < min(len(free), self.config.prefill_batch):
                req = self._waiting.popleft()
                if req.cancelled:
                    self._finish_request(req, "cancelled")
                else:
                    batch.append(req)
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
        first = _pick(logits, self._next_key(), temp, top_p, top_k)
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
        active = np.array([r is not None for r in self._slot_req])
        nxt = _pick(logits, self._next_key(), np.where(active, self._temp, 0.0).astype(np.float32),
                    self._top_p, self._top_k)
        for slot, req in enumerate(self._slot_req):
            if req is not None:
                self._pos[slot] += 1
                self._accept(slot, int(nxt[slot]))

    def _accept(self, slot: int, token: int):
        """Records a sampled token for the request in `slot`; retires it if finished."""
        req = self._slot_req[slot]
        if token in req.stop_token_ids:
            return self._finish(slot, "stop")
        req.tokens.append(token)
        self._last[slot] = token
        text_delta = ""
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.tokens)
            hit = min((i for i in (req.text.find(s) for s in req.stop_strings) if i >= 0), default=-1)
            if hit >= 0:
                req.text = req.text[:hit]
                return self._finish(slot, "stop", last_token=token)
            # hold back text that could be the start of a stop string, and a partial UTF-8 character
            hold = max((len(s) - 1 for s in req.stop_strings), default=0)
            safe = len(req.text) - hold
            if req.text.endswith("\ufffd"):
                safe = min(safe, len(req.text) - 1)
            if safe > req.emitted_text:
                text_delta = req.text[req.emitted_text:safe]
                req.emitted_text = safe
        req.events.put(("delta", ([token], text_delta)))
        if len(req.tokens) >= req.sampling.max_new_tokens:
            return self._finish(slot, "length")
        if self._pos[slot] + 1 >= self.config.max_len:        # the cache is full (prompt + tokens == max_len)
            return self._finish(slot, "length")

    def _finish(self, slot: int, reason: str, last_token: int | None = None):
        req = self._slot_req[slot]
        self._slot_req[slot] = None
        self._finish_request(req, reason, last_token)

    def _finish_request(self, req: Request, reason: str, last_token: int | None = None):
        pending = [] if last_token is None else [last_token]
        if self.tokenizer is not None and len(req.text) > req.emitted_text:
            req.events.put(("delta", (pending, req.text[req.emitted_text:])))
            req.emitted_text = len(req.text)
        elif pending:
            req.events.put(("delta", (pending, "")))
        req.result = Result(req.request_id, req.adapter, list(req.tokens),
                            req.text if self.tokenizer is not None else None, reason, len(req.prompt_ids))
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
            except Exception as e:  # never hang clients: fail every in-flight request, keep serving
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                time.sleep(0.01)

    def _fail_all(self, message: str):
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        running = [r for r in self._slot_req if r is not None]
        self._slot_req = [None] * self.config.n_slots
        # the failed step may have consumed (donated) the cache: start from a fresh one
        self.cache = KVCache.create(self.runner.cfg, self.config.n_slots, self.config.max_len, self.runner.dtype)
        for req in waiting + running:
            self.registry.release(req.adapter_slot)
            req.events.put(("error", message))
