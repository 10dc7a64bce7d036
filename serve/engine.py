"""Slot-based continuous batching: adapted prefill into free slots, one decode step for all slots.

Each `step()`:
  1. retires cancelled and expired requests, then admits waiting requests into free cache slots and
     prefills them in one batch with their adapters (prompt tokens adapted; the last prompt token's
     logits sample the first token);
  2. runs one decode step for every slot: in PreFT mode ("prefill") on the base weights alone
     (`bank=None`: no adapter work at decode), in the all-token baseline ("all") with the bank
     (per-token gathered adapters, BGMV);
  3. retires finished requests (stop token or string, max tokens, cache full) and frees slots.
Inactive slots are computed and ignored, so every step has the same shapes (no recompiles; prefill
compiles once per power-of-two prompt-length bucket, all of them up front with `warmup()`).

Failure isolation: a request that fails its own host-side preparation or token handling fails
alone. A failed prefill batch is retried one request at a time, so only the request that fails
by itself is failed. A failed decode step fails every running request (it cannot be attributed),
and never the queued ones. Whenever a failed device step may have consumed the (donated) KV cache,
the cache is rebuilt and the requests whose rows it held are failed. Every path ends a request
through `Request.settle()`, which releases its adapter reference exactly once; every failure is
logged with its traceback and the request ids.

Two APIs: `generate(requests)` steps synchronously until all are done; `start()` runs the step loop
in a background thread, and `submit()` returns a `Request` whose events (see serve/request.py) are
put into a queue (or any object with `.put`, e.g. the server's asyncio bridge).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from preft_jax.generation import ModelRunner, bucket_length
from preft_jax.kv_cache import KVCache
from preft_jax.sampling import SamplingParams, sample
from serve.errors import (DeadlineExceededError, EngineError, PromptTooLongError, QueueFullError, RequestError,
                          UnavailableError)
from serve.metrics import EngineMetrics
from serve.registry import AdapterRegistry
from serve.request import GenerationRequest, Request, Result, new_request_id

__all__ = ["Engine", "EngineConfig", "EngineError", "GenerationRequest", "Request", "Result"]

log = logging.getLogger("serve.engine")

_sample = jax.jit(sample)


def _pick(logits, key, temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray) -> np.ndarray:
    """Per-row sampling (`preft_jax.sampling.sample`: greedy batches take its argmax-only path)."""
    return np.asarray(_sample(logits, key, jnp.asarray(temperature), jnp.asarray(top_p), jnp.asarray(top_k)))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 8
    max_len: int = 512            # KV-cache length per slot (prompt + generated tokens)
    mode: str = "prefill"         # "prefill" (PreFT: base decode) or "all" (all-token baseline)
    prefill_batch: int = 4        # prompts prefilled together (padded to this many rows)
    seed: int = 0
    max_queued: int = 1024        # waiting requests beyond this are refused (QueueFullError, HTTP 429)
    request_timeout: float | None = 600.0   # total deadline per request in seconds (queue + generation)
    wedge_timeout: float = 60.0   # a step running longer than this makes `health()` report wedged

    def __post_init__(self):
        if self.mode not in ("prefill", "all"):
            raise ValueError(f"engine mode must be 'prefill' or 'all', got {self.mode!r}")
        if self.n_slots < 1 or self.prefill_batch < 1 or self.max_len < 2:
            raise ValueError("n_slots, prefill_batch must be >= 1 and max_len >= 2")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.request_timeout is not None and not (math.isfinite(self.request_timeout)
                                                     and self.request_timeout > 0):
            raise ValueError(f"request_timeout must be a positive number of seconds or None, "
                             f"got {self.request_timeout}")
        if not (math.isfinite(self.wedge_timeout) and self.wedge_timeout > 0):
            raise ValueError(f"wedge_timeout must be a positive number of seconds, got {self.wedge_timeout}")


def _engine_failure(what: str, req: Request) -> EngineError:
    return EngineError(f"the engine failed while {what} (request {req.request_id}); the server log has details")


class Engine:
    def __init__(self, runner: ModelRunner, registry: AdapterRegistry, config: EngineConfig = EngineConfig(),
                 tokenizer=None):
        self.runner, self.registry, self.config, self.tokenizer = runner, registry, config, tokenizer
        if config.max_len > runner.cfg.max_seq_len:
            raise ValueError(f"max_len {config.max_len} exceeds the model's context {runner.cfg.max_seq_len}")
        registry.set_mode(config.mode)        # the engine's mode decides which tokens adapters act on
        n = config.n_slots
        self.cache = self._new_cache()
        self._slot_req: list[Request | None] = [None] * n
        self._last = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._plen = np.ones(n, np.int32)
        self._adapter = np.zeros(n, np.int32)
        self._temp = np.zeros(n, np.float32)
        self._top_p = np.ones(n, np.float32)
        self._top_k = np.zeros(n, np.int32)
        self._waiting: deque[Request] = deque()
        self._live: set[Request] = set()             # every request not yet settled
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._key = jax.random.key(config.seed)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._accepting = True
        self._step_started: float | None = None
        self._last_step_end: float | None = None
        self.metrics = EngineMetrics()
        self.steps = 0

    @property
    def mode(self) -> str:
        return self.config.mode

    def _new_cache(self) -> KVCache:
        return KVCache.create(self.runner.cfg, self.config.n_slots, self.config.max_len, self.runner.dtype)

    # ---- submission ------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], adapter: str | None = None,
               sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
               events=None, request_id: str | None = None, timeout: float | None = None) -> Request:
        """Validates and queues a request. Raises RequestError subclasses (UnknownAdapterError,
        PromptTooLongError, QueueFullError, UnavailableError, ...) before anything is queued, so
        nothing else is affected.

        Stops at any of `sampling.stop_token_ids` (default: the model's EOS ids; pass (-1,) for
        none) and, with a tokenizer, at any of the `stop` strings (the text is cut before it).
        `timeout`: this request's total deadline in seconds (default `config.request_timeout`)."""
        prompt_ids, stop = self._check(prompt_ids, sampling, stop)
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise RequestError(f"timeout must be a positive number of seconds, got {timeout}", "timeout")
        timeout = self.config.request_timeout if timeout is None else timeout
        stop_ids = tuple(sampling.stop_token_ids) or tuple(self.runner.cfg.eos_token_ids)
        with self._lock:                                  # refuse before taking an adapter reference
            self._check_capacity_locked()
        slot = self.registry.acquire(adapter)             # raises UnknownAdapterError
        req = Request(request_id or new_request_id(), prompt_ids, adapter, sampling, stop_ids, stop, slot,
                      deadline=None if timeout is None else time.monotonic() + timeout)
        if events is not None:
            req.events = events
        try:
            with self._lock:
                self._check_capacity_locked()
                self._waiting.append(req)
                self._live.add(req)
        except RequestError:
            self.registry.release(slot)
            raise
        self.metrics.requests_submitted += 1
        self._wake.set()
        return req

    def _check_capacity_locked(self):
        if not self._accepting:
            raise UnavailableError("the engine is shutting down; no new requests are accepted")
        if len(self._waiting) >= self.config.max_queued:
            raise QueueFullError(f"the request queue is full ({self.config.max_queued} waiting requests); "
                                 f"retry later")

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
        while any(not h.finished for h in handles):
            self.step()
        for h in handles:
            if h.error is not None:
                raise h.error
        return [h.result for h in handles]

    def _validate_only(self, r: GenerationRequest):
        self._check(r.prompt_ids, r.sampling, r.stop)
        if r.adapter is not None and r.adapter not in self.registry:
            self.registry.acquire(r.adapter)          # raises UnknownAdapterError

    def _check(self, prompt_ids, sampling: SamplingParams, stop):
        """Everything the engine must be able to represent, checked before the request is queued."""
        if not isinstance(sampling, SamplingParams):
            raise RequestError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        vocab = self.runner.cfg.vocab_size
        try:
            prompt_ids = [int(t) for t in prompt_ids]
        except (TypeError, ValueError, OverflowError):
            raise RequestError("prompt token ids must be integers", "prompt") from None
        if not prompt_ids:
            raise RequestError("prompt is empty", "prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if sampling.top_k > vocab:
            raise RequestError(f"top_k must be in [0, {vocab}] (the vocabulary size), got {sampling.top_k}", "top_k")
        bad_stop = [t for t in sampling.stop_token_ids if t != -1 and not 0 <= t < vocab]
        if bad_stop:
            raise RequestError(f"stop token ids must be in [0, {vocab}) (or -1 for none), got {bad_stop}")
        limit = self.config.max_len
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the context length is {limit} "
                                     f"tokens (prompt + at least 1 generated token)", "prompt")
        if len(prompt_ids) + sampling.max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {len(prompt_ids)} tokens + max_tokens={sampling.max_new_tokens} "
                                     f"exceeds the context length {limit}; ask for at most "
                                     f"{limit - len(prompt_ids)} tokens", "max_tokens")
        if isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) for s in stop):
            raise RequestError("stop strings must be strings", "stop")
        stop = tuple(s for s in stop if s)
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need an engine with a tokenizer", "stop")
        return prompt_ids, stop

    # ---- state -----------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._slot_req)

    @property
    def active(self) -> int:
        """Requests holding a cache slot now."""
        return sum(r is not None for r in self._slot_req)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def live_requests(self) -> list[Request]:
        with self._lock:
            return list(self._live)

    def health(self) -> dict:
        """The loop's liveness: wedged when its thread died or one step has run past wedge_timeout."""
        now = time.monotonic()
        started = self._step_started
        step_age = 0.0 if started is None else now - started
        running = self._thread is not None
        alive = running and self._thread.is_alive() and not self._stop.is_set()
        wedged = (running and not alive and self._accepting) or step_age > self.config.wedge_timeout
        return {"loop_running": alive, "wedged": wedged, "accepting": self._accepting,
                "step_in_progress_s": round(step_age, 3),
                "last_step_age_s": None if self._last_step_end is None else round(now - self._last_step_end, 3),
                "steps": self.steps, "queued": self.queued, "max_queued": self.config.max_queued,
                "running": self.active, "slots": self.config.n_slots,
                "saturation": round(self.active / self.config.n_slots, 3),
                "queue_saturation": round(self.queued / max(1, self.config.max_queued), 3)}

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> None:
        self._step_started = time.monotonic()
        try:
            self._sweep()
            self._admit()
            if any(r is not None for r in self._slot_req):
                self._decode()
        finally:
            self.steps += 1
            self._last_step_end = time.monotonic()
            self._step_started = None

    def _sweep(self):
        """Ends cancelled and expired requests, queued or running."""
        now = time.monotonic()
        for req in list(self._slot_req):
            if req is not None:
                self._end_if_stale(req, now)
        with self._lock:
            stale = [r for r in self._waiting if r.cancelled or r.expired(now) or r.finished]
            for r in stale:
                self._waiting.remove(r)
        for req in stale:
            self._end_if_stale(req, now)

    def _end_if_stale(self, req: Request, now: float):
        if req.cancelled:
            self._terminate(req, "cancelled")
        elif req.expired(now):
            self._terminate(req, error=DeadlineExceededError(
                f"request {req.request_id} exceeded its deadline; {len(req.tokens)} tokens were generated"))

    def _next_key(self):
        self._key, sub = jax.random.split(self._key)
        return sub

    def _admit(self):
        free = [i for i, r in enumerate(self._slot_req) if r is None]
        batch = []
        with self._lock:
            while self._waiting and len(batch) < min(len(free), self.config.prefill_batch):
                batch.append(self._waiting.popleft())
        if batch:
            self._prefill(batch, free[:len(batch)])

    def _prefill(self, batch: list[Request], slots: list[int]):
        """Prefills `batch` into `slots`; on a device failure retries each request alone."""
        P = self.config.prefill_batch
        T = min(bucket_length(max(len(r.prompt_ids) for r in batch)), self.config.max_len)
        tokens = np.zeros((P, T), np.int32)
        lengths = np.ones(P, np.int32)
        slot_ids = np.full(P, self.config.n_slots, np.int32)     # padding rows: out of range, dropped
        adapter_ids = np.zeros(P, np.int32)
        temp, top_p, top_k = np.zeros(P, np.float32), np.ones(P, np.float32), np.zeros(P, np.int32)
        rows: list[tuple[int, Request, int]] = []
        for req, slot in zip(batch, slots):
            row = len(rows)
            try:
                tokens[row, :len(req.prompt_ids)] = req.prompt_ids
                lengths[row], slot_ids[row], adapter_ids[row] = len(req.prompt_ids), slot, req.adapter_slot
                temp[row], top_p[row] = req.sampling.temperature, req.sampling.top_p
                top_k[row] = req.sampling.top_k
            except Exception:  # noqa: BLE001 - this request's own data: fail it alone
                log.exception("request %s: could not prepare its prefill", req.request_id)
                tokens[row], lengths[row], slot_ids[row], adapter_ids[row] = 0, 1, self.config.n_slots, 0
                temp[row], top_p[row], top_k[row] = 0.0, 1.0, 0
                self._terminate(req, error=_engine_failure("preparing its prompt", req))
                continue
            rows.append((row, req, slot))
        if not rows:
            return
        bank = self.registry.bank
        try:
            logits, self.cache = self.runner.prefill(
                jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(slot_ids), self.cache, bank,
                None if bank is None else jnp.asarray(adapter_ids))
            first = _pick(logits, self._next_key(), temp, top_p, top_k)
        except Exception:  # noqa: BLE001
            ids = [r.request_id for _, r, _ in rows]
            log.exception("prefill step failed for requests %s", ids)
            self.metrics.step_failures["prefill"] += 1
            self._recover_cache()
            if len(rows) > 1:                 # attribute: each request alone
                for _, req, slot in rows:
                    if not req.finished:
                        self._prefill([req], [slot])
            else:
                self._terminate(rows[0][1], error=_engine_failure("prefilling its prompt", rows[0][1]))
            return
        self.metrics.prompt_tokens += int(sum(len(r.prompt_ids) for _, r, _ in rows))
        for row, req, slot in rows:
            if req.finished:                  # e.g. failed by a shutdown while the step ran
                continue
            self._slot_req[slot] = req
            self._plen[slot] = self._pos[slot] = len(req.prompt_ids)
            self._adapter[slot] = req.adapter_slot
            self._temp[slot], self._top_p[slot], self._top_k[slot] = temp[row], top_p[row], top_k[row]
            self._accept_safely(slot, int(first[row]))

    def _decode(self):
        bank = self.registry.bank if self.config.mode == "all" else None
        active = np.array([r is not None for r in self._slot_req])
        try:
            logits, self.cache = self.runner.decode(
                jnp.asarray(self._last), jnp.asarray(self._pos), self.cache, bank,
                None if bank is None else jnp.asarray(self._adapter),
                None if bank is None else jnp.asarray(self._plen))
            nxt = _pick(logits, self._next_key(), np.where(active, self._temp, 0.0).astype(np.float32),
                        self._top_p, np.where(active, self._top_k, 0).astype(np.int32))
        except Exception:  # noqa: BLE001 - not attributable: every running request is affected
            running = [r for r in self._slot_req if r is not None]
            log.exception("decode step failed; failing running requests %s", [r.request_id for r in running])
            self.metrics.step_failures["decode"] += 1
            for req in running:
                self._terminate(req, error=_engine_failure("decoding", req))
            self._recover_cache()
            return
        for slot, req in enumerate(self._slot_req):
            if req is not None:
                self._pos[slot] += 1
                self._accept_safely(slot, int(nxt[slot]))

    def _recover_cache(self):
        """After a failed device step: if the donated cache was consumed, rebuild it and fail the
        requests whose KV rows it held (their prompts would have to be recomputed)."""
        try:
            lost = self.cache.k.is_deleted() or self.cache.v.is_deleted()
        except Exception:  # noqa: BLE001
            lost = True
        if not lost:
            return
        running = [r for r in self._slot_req if r is not None]
        if running:
            log.error("KV cache lost in a failed step; failing requests %s", [r.request_id for r in running])
        for req in running:
            self._terminate(req, error=_engine_failure("running a step (KV cache lost)", req))
        self.cache = self._new_cache()

    def _accept_safely(self, slot: int, token: int):
        req = self._slot_req[slot]
        try:
            self._accept(slot, token)
        except Exception:  # noqa: BLE001 - this request's own token handling: fail it alone
            log.exception("request %s: could not process its token", req.request_id)
            self._terminate(req, error=_engine_failure("processing its output", req))

    def _accept(self, slot: int, token: int):
        """Records a sampled token for the request in `slot`; retires it if finished."""
        req = self._slot_req[slot]
        now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.submitted_at)
        else:
            self.metrics.inter_token.observe(now - req.last_token_at)
        req.last_token_at = now
        self.metrics.generated_tokens += 1
        if token in req.stop_token_ids:
            return self._terminate(req, "stop")
        req.tokens.append(token)
        self._last[slot] = token
        text_delta = ""
        if self.tokenizer is not None:
            req.text = self.tokenizer.decode(req.tokens)
            hit = min((i for i in (req.text.find(s) for s in req.stop_strings) if i >= 0), default=-1)
            if hit >= 0:
                req.text = req.text[:hit]
                return self._terminate(req, "stop", last_token=token)
            # hold back text that could be the start of a stop string, and a partial UTF-8 character
            hold = max((len(s) - 1 for s in req.stop_strings), default=0)
            safe = len(req.text) - hold
            if req.text.endswith("\ufffd"):
                safe = min(safe, len(req.text) - 1)
            if safe > req.emitted_text:
                text_delta = req.text[req.emitted_text:safe]
                req.emitted_text = safe
        req.emit(("delta", ([token], text_delta)))
        if len(req.tokens) >= req.sampling.max_new_tokens:
            return self._terminate(req, "length")
        if self._pos[slot] + 1 >= self.config.max_len:        # the cache is full (prompt + tokens == max_len)
            return self._terminate(req, "length")

    def _terminate(self, req: Request, reason: str | None = None, last_token: int | None = None,
                   error: EngineError | None = None):
        """The one way a request ends (result or error); safe to call from any thread, once wins."""
        if not req.settle():
            return
        for slot, r in enumerate(self._slot_req):
            if r is req:
                self._slot_req[slot] = None
        with self._lock:
            self._live.discard(req)
        self.registry.release(req.adapter_slot)
        if error is not None:
            req.error = error
            self.metrics.requests_failed[error.code] += 1
            req.emit(("error", error))
            return
        pending = [] if last_token is None else [last_token]
        if self.tokenizer is not None and len(req.text) > req.emitted_text:
            req.emit(("delta", (pending, req.text[req.emitted_text:])))
            req.emitted_text = len(req.text)
        elif pending:
            req.emit(("delta", (pending, "")))
        req.result = Result(req.request_id, req.adapter, list(req.tokens),
                            req.text if self.tokenizer is not None else None, reason, len(req.prompt_ids))
        self.metrics.requests_finished[reason] += 1
        req.emit(("done", req.result))

    # ---- compile everything up front -------------------------------------------------------
    def prefill_buckets(self) -> list[int]:
        """Every padded prompt length a prefill can use."""
        out, n = [], 1
        while True:
            t = min(bucket_length(n), self.config.max_len)
            if t not in out:
                out.append(t)
            if t >= self.config.max_len:
                return out
            n = t + 1

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compiles every prefill bucket, the decode step and the samplers before serving, so no
        request stalls the running streams on a compile. Returns the seconds it took."""
        if self.busy:
            raise RuntimeError("warmup() runs before any request is submitted")
        t0 = time.monotonic()
        P, V = self.config.prefill_batch, self.runner.cfg.vocab_size
        bank = self.registry.bank
        buckets = self.prefill_buckets()
        for i, T in enumerate(buckets):
            if progress:
                progress(f"compiling prefill {i + 1}/{len(buckets)} (prompt bucket {T} tokens)")
            logits, self.cache = self.runner.prefill(
                jnp.zeros((P, T), jnp.int32), jnp.ones(P, jnp.int32), jnp.full(P, self.config.n_slots, jnp.int32),
                self.cache, bank, None if bank is None else jnp.zeros(P, jnp.int32))
        if progress:
            progress("compiling the decode step and the samplers")
        n = self.config.n_slots
        dbank = bank if self.config.mode == "all" else None
        logits, self.cache = self.runner.decode(
            jnp.zeros(n, jnp.int32), jnp.zeros(n, jnp.int32), self.cache, dbank,
            None if dbank is None else jnp.zeros(n, jnp.int32), None if dbank is None else jnp.ones(n, jnp.int32))
        for rows in sorted({P, n}):
            z = jnp.zeros((rows, V), jnp.float32)
            _pick(z, self._next_key(), np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32))
            _pick(z, self._next_key(), np.ones(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32))
        jax.block_until_ready(self.cache.k)
        return time.monotonic() - t0

    # ---- background loop -------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._stop.clear()
            self._accepting = True
            self._thread = threading.Thread(target=self._loop, name="preft-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self, grace: float = 0.0, join_timeout: float = 5.0) -> None:
        """Stops accepting requests, lets in-flight ones run for up to `grace` seconds, then fails
        every request still live (HTTP 503) and stops the loop. Returns within about
        grace + join_timeout seconds even if a step is stuck (the stuck thread is abandoned)."""
        self._accepting = False
        end = time.monotonic() + max(0.0, grace)
        while self.busy and self._thread is not None and self._thread.is_alive() and time.monotonic() < end:
            time.sleep(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=join_timeout)
            if self._thread.is_alive():
                log.error("engine step still running after shutdown timeout; abandoning it")
            self._thread = None
        with self._lock:
            live = list(self._live)
            self._waiting.clear()
        for req in live:
            self._terminate(req, error=EngineError("the server is shutting down", 503, "unavailable"))

    def _loop(self):
        while not self._stop.is_set():
            if not self.busy:
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a bug outside the guarded device calls: never hang clients
                running = [r for r in self._slot_req if r is not None]
                log.exception("engine step failed; failing running requests %s", [r.request_id for r in running])
                self.metrics.step_failures["other"] += 1
                for req in running:
                    self._terminate(req, error=_engine_failure("running a step", req))
                self._recover_cache()
                time.sleep(0.01)
