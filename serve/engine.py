"""The serving engine: a paged KV cache, chunked prefill within a token budget, prefix caching that
understands PreFT, tiered adapters, and a token-only step loop.

Each `step()`:
  1. takes new requests, ends cancelled and expired ones;
  2. asks the scheduler (serve/scheduler.py) for this step's work: one decode token for every running
     sequence, prefill chunks for the rest of `max_num_batched_tokens` (admitting waiting requests
     while rows, KV blocks and device adapter slots last; preempting by recompute when the pool runs
     out);
  3. runs at most two jitted calls (`preft_jax.paged_step`): the prefill chunks (adapted per the
     position policy; a row whose chunk ends its prompt samples its first token) and the decode
     rows, in PreFT mode ("prefill") on the base weights alone, in the all-token baseline ("all")
     with each row's adapter. Each call returns sampled token ids only (plus, only for calls with a
     row that asked for them, the top log-probabilities: `paged_step(logprobs=True)`);
  4. hands the ids to the requests (("tokens", ids) events, preceded by ("logprobs", entries) when
     asked for); text, stop strings and UTF-8 hold-back are the consumer's (serve/output.py).

Randomness is per request: each sequence has its own key (from `SamplingParams.seed`, or drawn from
the engine's generator seeded by `EngineConfig.seed`), folded with the index of the token being
drawn, so a seeded request gives the same tokens whatever else is running, and a preempted one is
recomputed to the same tokens.

Parallel samples (`submit_n`, OpenAI `n`): one prefill, then n decode sequences sharing the prompt's
KV blocks (the partial last block is copied on first write, see serve/scheduler.py); the n first
tokens are drawn from the one prefill's logits (`sample_rows`).

PreFT adapters need the device only while the prompt is prefilled: a request pins a device bank
slot when its prefill starts and unpins it when the prefill ends (mode "all" keeps it until the end).

Shapes are bucketed (decode: `max_num_seqs` rows x block-table width; prefill: rows (powers of 4 up
to `max_prefill_seqs`, so one short prompt does not pay for a full prefill batch) x chunk length x
block-table width), every bucket compiled up front by `warmup()` or, while idle, by the engine thread
after `warm_in_background()` (serve/warmup.py).

Failure isolation: a request whose own preparation or token handling fails is failed alone; a failed
prefill call is retried one chunk at a time so only the chunk that fails by itself fails its request;
a failed decode call fails the running requests (not attributable), never the queued ones; a failed
call that consumed the (donated) KV pool rebuilds it and requeues the running sequences for
recompute. Every path ends a request through `Request.settle()`, which releases its adapter
reference once; failures are logged with tracebacks and request ids.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from typing import Callable, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from preft_jax import native_decode
from preft_jax.generation import ModelRunner
from preft_jax.paged_kv import PagedBatch, PagedKVCache, choose_attention
from preft_jax import sharding as shd
from preft_jax.paged_step import copy_blocks, paged_step, sample_rows, sharded_paged_step
from preft_jax.sampling import MAX_TOP_LOGPROBS, SamplingParams, seed_key_data
from serve.errors import (DeadlineExceededError, EngineError, PromptTooLongError, QueueFullError, RequestError,
                          UnavailableError)
from serve.kv_blocks import NULL_BLOCK, BlockPool
from serve.metrics import EngineMetrics
from serve.registry import AdapterRegistry
from serve.request import GenerationRequest, Request, Result, new_request_id
from serve.scheduler import DECODE, Chunk, Scheduler, SchedulerConfig, Sequence
from serve.warmup import warmup_tasks

__all__ = ["Engine", "EngineConfig", "EngineError", "GenerationRequest", "Request", "Result"]

log = logging.getLogger("serve.engine")


def _pow_buckets(lo: int, hi: int, base: int = 2) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= base
    out.append(hi)
    return sorted(set(out))


_take_tokens = jax.jit(lambda prev, index: prev[index][:, None])


def _to_host(out) -> dict:
    """A step's device output -> numpy arrays (tokens and, when present, log-prob arrays)."""
    if not isinstance(out, dict):
        return {"tokens": np.asarray(out)}
    return {k: np.asarray(v) for k, v in out.items() if k != "logits"}


def _entry(host: dict, r: int, k: int | None):
    """Row r's log-prob entry (logprob, [(id, logprob)] * k) or None when not asked for."""
    if k is None or "logprob" not in host:
        return None
    return (float(host["logprob"][r]),
            [(int(i), float(v)) for i, v in zip(host["top_ids"][r, :k], host["top_values"][r, :k])])


def _bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16               # sequences running at once (decode rows)
    max_model_len: int = 1024            # tokens per sequence: prompt + generated
    mode: str = "prefill"                # "prefill" (PreFT: base decode) or "all" (all-token baseline)
    max_prefill_seqs: int = 4            # prefill rows per step
    max_num_batched_tokens: int = 256    # tokens per step: decode tokens + prefill chunk tokens
    block_size: int = 16
    kv_cache_tokens: int | None = None   # KV pool size in tokens (default: max_num_seqs * max_model_len)
    kv_cache_memory: int | None = None   # ... or in bytes (K and V, every layer)
    enable_prefix_cache: bool = True
    seed: int = 0
    max_queued: int = 1024               # waiting requests beyond this are refused (HTTP 429)
    request_timeout: float | None = 600.0   # total deadline per request in seconds (queue + generation)
    wedge_timeout: float = 60.0          # a step running longer than this makes `health()` report wedged
    starvation_s: float = 2.0            # waiting longer than this jumps the adapter-grouping order
    min_chunk: int = 16                  # smallest prefill chunk bucket
    num_scheduler_steps: int = 4         # decode calls per step when nothing waits (pipelined, see _run_decode)
    warmup_logprobs: bool = False        # warmup() also compiles the log-probability variants (else: on first use)
    cpu_decode: str = "auto"             # CPU float32: "native" (FFI decode step + native projections), "xla", "auto"

    def __post_init__(self):
        if self.mode not in ("prefill", "all"):
            raise ValueError(f"engine mode must be 'prefill' or 'all', got {self.mode!r}")
        if self.cpu_decode not in native_decode.CPU_DECODE:
            raise ValueError(f"cpu_decode must be one of {native_decode.CPU_DECODE}, got {self.cpu_decode!r}")
        for name in ("max_num_seqs", "max_prefill_seqs", "block_size", "min_chunk", "num_scheduler_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs + 1:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must exceed max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence decodes one token per step")
        if self.kv_cache_tokens is not None and self.kv_cache_memory is not None:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size ({self.block_size})")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.request_timeout is not None and not (math.isfinite(self.request_timeout)
                                                     and self.request_timeout > 0):
            raise ValueError(f"request_timeout must be a positive number of seconds or None, "
                             f"got {self.request_timeout}")
        for name in ("wedge_timeout", "starvation_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v}")

    def num_blocks(self, bytes_per_token: int) -> int:
        """Blocks in the pool (block 0, reserved, included)."""
        if self.kv_cache_memory is not None:
            tokens = self.kv_cache_memory // bytes_per_token
        elif self.kv_cache_tokens is not None:
            tokens = self.kv_cache_tokens
        else:                                  # every sequence at full length fits
            return self.max_num_seqs * -(-self.max_model_len // self.block_size) + 1
        blocks = tokens // self.block_size
        if blocks < 1:
            raise ValueError(f"the KV cache holds {tokens} tokens, less than one block of {self.block_size}")
        return blocks + 1


def _engine_failure(what: str, req: Request) -> EngineError:
    return EngineError(f"the engine failed while {what} (request {req.request_id}); the server log has details")


class Engine:
    """`mesh` (optional; default the runner's, see `ModelRunner`): tensor/data-parallel serving. The
    weights, the paged KV pool and the adapter bank are placed by their declared logical axes
    (preft_jax.sharding.RULES) and every step runs under the mesh with explicit out_shardings, so
    the donated pool keeps its declared sharding (`cache_shardings`)."""

    def __init__(self, runner: ModelRunner, registry: AdapterRegistry, config: EngineConfig = EngineConfig(),
                 tokenizer=None, mesh: jax.sharding.Mesh | None = None):
        if mesh is not None:
            runner = runner.with_mesh(mesh)
        self.runner, self.registry, self.config, self.tokenizer = runner, registry, config, tokenizer
        self.mesh = runner.mesh
        cfg = runner.cfg
        if config.max_model_len > cfg.max_seq_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context {cfg.max_seq_len}")
        registry.set_mode(config.mode)        # the engine's mode decides which tokens adapters act on
        bs = config.block_size
        self.num_blocks = config.num_blocks(PagedKVCache.bytes_per_token(cfg, runner.dtype))
        self.pool = BlockPool(self.num_blocks, bs, config.enable_prefix_cache)
        self._step_fn, self.cache_shardings = paged_step, None
        if self.mesh is not None:
            abstract = jax.eval_shape(lambda: PagedKVCache.create(cfg, self.num_blocks, bs, runner.dtype))
            self.cache_shardings = shd.cache_shardings(abstract, self.mesh, cfg)
            self._step_fn = sharded_paged_step(self.mesh, self.cache_shardings)
            if registry.bank is not None:
                registry.place(shd.bank_shardings(registry.bank, self.mesh, cfg))
        self.cache = self._new_cache()
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_seqs, config.max_model_len, bs,
            config.mode, config.starvation_s), self.pool, registry)
        self.decode_attention = choose_attention(cfg, bs)
        self.native = self._native_weights()
        max_blocks = -(-config.max_model_len // bs)
        self.block_buckets = _pow_buckets(1, max_blocks)               # decode: every step, fine buckets
        self.prefill_block_buckets = _pow_buckets(1, max_blocks, 4)    # prefill context: coarser
        self.prefill_row_buckets = _pow_buckets(1, config.max_prefill_seqs, 4)
        self.chunk_buckets = _pow_buckets(min(config.min_chunk, config.max_num_batched_tokens),
                                          min(config.max_num_batched_tokens, config.max_model_len))
        self._seqs: dict[Request, Sequence] = {}
        self._inbox: deque[Sequence] = deque()
        self._lock = threading.Lock()            # inbox + live set (submit threads vs the engine thread)
        self._state = threading.RLock()          # scheduler state (engine thread vs a shutdown thread)
        self._wake = threading.Event()
        self._rng = np.random.default_rng(config.seed)      # keys of requests without a seed
        self.fork_buckets = _pow_buckets(1, config.max_num_seqs)
        self._thread: threading.Thread | None = None
        self._warm_pending: deque = deque()      # background warm-up tasks (serve/warmup.py)
        self._warm_started: float | None = None
        self._stop = threading.Event()
        self._accepting = True
        self._step_started: float | None = None
        self._last_step_end: float | None = None
        self._load_failures: list[tuple[Sequence, RequestError]] = []
        self.metrics = EngineMetrics()
        self.steps = 0

    @property
    def mode(self) -> str:
        return self.config.mode

    def _new_cache(self) -> PagedKVCache:
        """The paged KV pool, created in place on the mesh (never whole on one device first)."""
        cfg, nb, bs, dt = self.runner.cfg, self.num_blocks, self.config.block_size, self.runner.dtype
        if self.mesh is None:
            return PagedKVCache.create(cfg, nb, bs, dt)
        return jax.jit(lambda: PagedKVCache.create(cfg, nb, bs, dt), out_shardings=self.cache_shardings)()

    def _native_weights(self):
        """The packed weights of the native CPU path (preft_jax.native_decode), or None: "auto" takes
        it where it can serve (one CPU device, float32, the library builds), "native" requires it.
        With them, base-weight decode calls run as one native call, and every other call (prefill
        chunks, all-token decode) runs its base projections as native matmuls."""
        choice = self.config.cpu_decode
        if choice == "xla":
            return None
        why = (f"the default backend is {jax.default_backend()}" if jax.default_backend() != "cpu"
               else native_decode.unsupported_reason(self.runner.cfg, self.runner.dtype, self.mesh,
                                                 self.runner.quantization))
        if why:
            if choice == "native":
                raise ValueError(f"cpu_decode='native' is unavailable: {why}")
            log.info("decode on the XLA path: %s", why)
            return None
        model = nnx.merge(self.runner.graphdef, self.runner.state)
        return native_decode.pack(model)

    # ---- submission ------------------------------------------------------------------------
    def submit(self, prompt_ids: Seq[int], adapter: str | None = None,
               sampling: SamplingParams = SamplingParams(), stop: Seq[str] = (),
               events=None, request_id: str | None = None, timeout: float | None = None) -> Request:
        """Validates and queues a request. Raises RequestError subclasses (UnknownAdapterError,
        PromptTooLongError, QueueFullError, UnavailableError, ...) before anything is queued.

        Stops at any of `sampling.stop_token_ids` (default: the model's EOS ids; pass (-1,) for
        none) and at any of the `stop` strings (cut by the consumer, see serve/output.py).
        `timeout`: this request's total deadline in seconds (default `config.request_timeout`)."""
        return self.submit_n(prompt_ids, adapter, sampling, 1, stop, None if events is None else [events],
                             request_id, timeout)[0]

    def submit_n(self, prompt_ids: Seq[int], adapter: str | None = None,
                 sampling: SamplingParams = SamplingParams(), n: int = 1, stop: Seq[str] = (),
                 events: Seq | None = None, request_id: str | None = None,
                 timeout: float | None = None) -> list[Request]:
        """`n` completions of one prompt (OpenAI `n`), one Request each (ids `<request_id>-<i>` when
        n > 1; `events`: one sink per completion). The prompt is prefilled once; the n sequences
        then share its KV blocks. With `sampling.seed`, completion i draws from a key derived from
        (seed, i): the same seed gives the same n outputs. Until the prompt is prefilled the n are
        one unit: cancelling or failing the first ends them all."""
        prompt_ids, stop = self._check(prompt_ids, sampling, stop)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.config.max_num_seqs:
            raise RequestError(f"n must be an integer in [1, {self.config.max_num_seqs}] (the engine's "
                               f"max_num_seqs), got {n}", "n")
        if events is not None and len(events) != n:
            raise RequestError(f"events: need one sink per completion ({n}), got {len(events)}")
        if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
            raise RequestError(f"timeout must be a positive number of seconds, got {timeout}", "timeout")
        timeout = self.config.request_timeout if timeout is None else timeout
        stop_ids = tuple(sampling.stop_token_ids) or tuple(self.runner.cfg.eos_token_ids)
        with self._lock:                                  # refuse before taking an adapter reference
            self._check_capacity_locked()
        refs = []
        try:
            for _ in range(n):
                refs.append(self.registry.acquire(adapter))    # raises UnknownAdapterError
        except RequestError:
            for ref in refs:
                self.registry.release(ref)
            raise
        if refs[0] is not None:
            self.registry.prepare(adapter)                # start loading it now, off the engine thread
        rid = request_id or new_request_id()
        deadline = None if timeout is None else time.monotonic() + timeout
        seqs = []
        for i, ref in enumerate(refs):
            req = Request(rid if n == 1 else f"{rid}-{i}", prompt_ids, adapter, sampling, stop_ids, stop, ref,
                          deadline=deadline, tokenizer=self.tokenizer, on_stop=lambda r: self.cancel(r))
            if sampling.seed is not None:
                req.key_data = seed_key_data(sampling.seed, i)
            else:
                with self._lock:                          # submit runs on callers' threads
                    req.key_data = self._rng.integers(0, 2 ** 32, 2, dtype=np.uint32)
            if events is not None:
                req.events = events[i]
            seq = Sequence(req, list(prompt_ids), len(prompt_ids))
            if sampling.prompt_logprobs is not None:
                seq.prompt_logprobs = [None] * len(prompt_ids)
            seqs.append(seq)
        seqs[0].forks = seqs[1:]
        try:
            with self._lock:
                self._check_capacity_locked()
                self._inbox.append(seqs[0])
                for seq in seqs:
                    self._seqs[seq.req] = seq
        except RequestError:
            for ref in refs:
                self.registry.release(ref)
            raise
        self.metrics.requests_submitted += n
        self.metrics.by_mode[self.config.mode] += n
        self._wake.set()
        return [seq.req for seq in seqs]

    def _check_capacity_locked(self):
        if not self._accepting:
            raise UnavailableError("the engine is shutting down; no new requests are accepted")
        if self.queued >= self.config.max_queued:
            raise QueueFullError(f"the request queue is full ({self.config.max_queued} waiting requests); "
                                 f"retry later")

    def cancel(self, req: Request) -> None:
        """Stops a queued or running request at the next step (finish_reason "cancelled")."""
        req.cancelled = True
        self._wake.set()

    def generate(self, requests: Seq) -> list[Result]:
        """Synchronous: submits GenerationRequests (or (prompt_ids, adapter, sampling[, stop]) tuples)
        and steps until all are done. Every request is validated before any is queued."""
        if self._thread is not None:
            raise RuntimeError("engine is running in the background; use submit() + wait()")
        reqs = [r if isinstance(r, GenerationRequest) else GenerationRequest(*r) for r in requests]
        for r in reqs:       # validate all first, so a bad one leaves nothing queued
            self._check(r.prompt_ids, r.sampling, r.stop)
            if r.adapter is not None and r.adapter not in self.registry:
                self.registry.acquire(r.adapter)          # raises UnknownAdapterError
        handles = [self.submit(r.prompt_ids, r.adapter, r.sampling, r.stop) for r in reqs]
        outputs = [h.output() for h in handles]
        while any(not h.finished for h in handles):
            self.step()
            for h, out in zip(handles, outputs):           # consumer side: text and stop strings
                while not h.events.empty():
                    for kind, payload in out.handle(h.events.get_nowait()):
                        if kind == "error":
                            raise payload
        for h, out in zip(handles, outputs):
            while not h.events.empty():
                for kind, payload in out.handle(h.events.get_nowait()):
                    if kind == "error":
                        raise payload
            if h.error is not None:
                raise h.error
        return [h.result for h in handles]

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
        bad_stop = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad_stop:
            raise RequestError(f"stop token ids must be < {vocab} (negative: none), got {bad_stop}")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; the context length is {limit} "
                                     f"tokens (prompt + at least 1 generated token)", "prompt")
        if len(prompt_ids) + sampling.max_new_tokens > limit:
            raise PromptTooLongError(f"prompt of {len(prompt_ids)} tokens + max_tokens={sampling.max_new_tokens} "
                                     f"exceeds the context length {limit}; ask for at most "
                                     f"{limit - len(prompt_ids)} tokens", "max_tokens")
        if not self.scheduler.fits_ever(len(prompt_ids) + sampling.max_new_tokens):
            raise PromptTooLongError(f"prompt of {len(prompt_ids)} tokens + max_tokens={sampling.max_new_tokens} "
                                     f"can never fit the KV cache ({self.pool.capacity * self.config.block_size} "
                                     f"tokens)", "max_tokens")
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
        return bool(self._inbox) or bool(self.scheduler.waiting) or bool(self.scheduler.running)

    @property
    def active(self) -> int:
        """Requests running now (prefilling or decoding)."""
        return self.scheduler.num_running

    @property
    def queued(self) -> int:
        return len(self._inbox) + self.scheduler.num_waiting

    def live_requests(self) -> list[Request]:
        with self._lock:
            return [r for r in self._seqs if not r.finished]

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
                "running": self.active, "decode_rows": self.config.max_num_seqs,
                "saturation": round(self.active / self.config.max_num_seqs, 3),
                "queue_saturation": round(self.queued / max(1, self.config.max_queued), 3),
                "kv_blocks": self.pool.capacity, "kv_blocks_used": self.pool.capacity - self.pool.num_available,
                "kv_usage": round(self.pool.usage(), 3), "warmup_pending": len(self._warm_pending)}

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> None:
        self._step_started = time.monotonic()
        try:
            with self._state:
                self._drain_inbox()
                self._sweep()
                plan = self.scheduler.schedule(self._adapter_ready)
                for seq, err in self._load_failures:
                    self._terminate(seq.req, error=EngineError(str(err), err.status, err.code))
                self._load_failures.clear()
                if plan.preempted:
                    log.info("preempted %s (KV pool exhausted); they will be recomputed",
                             [s.req.request_id for s in plan.preempted])
            if plan.copies:
                self._run_copies(plan)
            if plan.prefill:
                self._run_prefill(plan.prefill)
            decode = [s for s in plan.decode if not s.req.finished and s.status == DECODE]
            if decode:
                quiet = not plan.prefill and not self._inbox and not self.scheduler.waiting
                self._run_decode(decode, self.config.num_scheduler_steps if quiet else 1)
        finally:
            self.steps += 1
            self._last_step_end = time.monotonic()
            self._step_started = None

    def _drain_inbox(self):
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())

    def _sweep(self):
        """Ends cancelled and expired requests, queued or running."""
        now = time.monotonic()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            req = seq.req
            if req.cancelled:
                self._terminate(req, "cancelled")
            elif req.expired(now):
                self._terminate(req, error=DeadlineExceededError(
                    f"request {req.request_id} exceeded its deadline; {len(req.tokens)} tokens were generated"))

    def _adapter_ready(self, seq: Sequence) -> bool:
        ref = seq.ref
        if ref is None:
            return True
        try:
            return self.registry.resolve(ref) is not None
        except RequestError as e:                       # the adapter cannot be loaded: this request fails
            self._load_failures.append((seq, e))
            return False

    def _sampling_rows(self, seqs, n, ahead: int = 0):
        """(temperature, top_p, top_k, key data, token index) per row; the token index of a row is
        the number of tokens its request has generated (+ `ahead` dispatched but not yet seen)."""
        temp, top_p, top_k = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.int32)
        key_data, counters = np.zeros((n, 2), np.uint32), np.zeros(n, np.int32)
        for i, s in enumerate(seqs):
            sp = s.req.sampling
            temp[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, sp.top_k
            key_data[i] = s.req.key_data
            counters[i] = len(s.req.tokens) + ahead
        return temp, top_p, top_k, key_data, counters

    def _row_tables(self, seqs, width):
        bt = np.full((len(seqs), width), NULL_BLOCK, np.int32)
        for i, s in enumerate(seqs):
            blocks = s.blocks[:width]
            bt[i, :len(blocks)] = blocks
        return bt

    # ---- prefill ---------------------------------------------------------------------------
    def _prefill_arrays(self, chunks: list[Chunk]):
        c = self.config
        bs, P = c.block_size, _bucket(len(chunks), self.prefill_row_buckets)
        C = _bucket(max(ch.length for ch in chunks), self.chunk_buckets)
        nb = _bucket(max(1, max(-(-ch.start // bs) for ch in chunks)), self.prefill_block_buckets)
        tokens = np.zeros((P, C), np.int32)
        ctx, clen, plen = np.zeros(P, np.int32), np.zeros(P, np.int32), np.ones(P, np.int32)
        widx = np.full((P, C), self.num_blocks * bs, np.int32)
        ids = np.zeros(P, np.int32)
        bt = np.full((P, nb), NULL_BLOCK, np.int32)
        for r, ch in enumerate(chunks):
            s = ch.seq
            tokens[r, :ch.length] = s.tokens[ch.start:ch.start + ch.length]
            ctx[r], clen[r], plen[r] = ch.start, ch.length, s.plen
            pos = np.arange(ch.start, ch.start + ch.length)
            widx[r, :ch.length] = np.asarray(s.blocks, np.int32)[pos // bs] * bs + pos % bs
            ids[r] = 0 if s.ref is None else s.ref.slot
            ctx_blocks = s.blocks[:-(-ch.start // bs)]
            bt[r, :len(ctx_blocks)] = ctx_blocks
        batch = PagedBatch(jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(clen), jnp.asarray(widx), "gather")
        samp = self._sampling_rows([ch.seq for ch in chunks], P)
        logprobs = any(ch.completes_prompt and ch.seq.req.sampling.logprobs is not None for ch in chunks)
        next_tokens = None
        if any(ch.seq.prompt_logprobs and ch.start + 1 < ch.seq.plen for ch in chunks):
            next_tokens = np.zeros((P, C), np.int32)          # the prompt token each position predicts
            for r, ch in enumerate(chunks):
                nxt = ch.seq.tokens[ch.start + 1:ch.start + ch.length + 1]
                next_tokens[r, :len(nxt)] = nxt
        return tokens, batch, ids, plen, samp, (logprobs, next_tokens is not None, True), next_tokens

    def _call(self, tokens, batch, bank, ids, plen, samp, flags=(False, False, False), next_tokens=None,
              native=None):
        """One jitted step (dispatched asynchronously): device array of sampled token ids, or a dict
        of device arrays (`paged_step`) when flags = (logprobs, prompt_logprobs, return_logits) ask
        for more."""
        temp, top_p, top_k, key_data, counters = samp
        logprobs, prompt_logprobs, return_logits = flags
        with self.runner.mesh_context():
            out, self.cache = self._step_fn(
                self.runner.graphdef, self.runner.state, jnp.asarray(tokens), batch, self.cache, bank,
                None if bank is None else jnp.asarray(ids), jnp.asarray(plen), jnp.asarray(temp),
                jnp.asarray(top_p), jnp.asarray(top_k), (jnp.asarray(key_data), jnp.asarray(counters)),
                None if next_tokens is None else jnp.asarray(next_tokens), native,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs, return_logits=return_logits)
        return out

    def _run_prefill(self, chunks: list[Chunk]):
        try:
            arrays = self._prefill_arrays(chunks)
        except Exception:  # noqa: BLE001 - host-side data of one of these requests: find it
            log.exception("could not prepare prefill for %s", [ch.seq.req.request_id for ch in chunks])
            if len(chunks) == 1:
                self._terminate(chunks[0].seq.req, error=_engine_failure("preparing its prompt", chunks[0].seq.req))
            else:
                for ch in chunks:
                    self._run_prefill([ch])
            return
        tokens, batch, ids, plen, samp, flags, next_tokens = arrays
        try:
            out = self._call(tokens, batch, self.registry.bank, ids, plen, samp, flags, next_tokens, self.native)
            host = _to_host(out)
        except Exception:  # noqa: BLE001
            ids_ = [ch.seq.req.request_id for ch in chunks]
            log.exception("prefill step failed for requests %s", ids_)
            self.metrics.step_failures["prefill"] += 1
            self._recover_cache()
            if len(chunks) > 1:
                for ch in chunks:
                    if not ch.seq.req.finished and ch.seq.num_computed == ch.start and ch.seq.blocks:
                        self._run_prefill([ch])
            elif not chunks[0].seq.req.finished:
                self._terminate(chunks[0].seq.req, error=_engine_failure("prefilling its prompt", chunks[0].seq.req))
            return
        nxt = host["tokens"]
        with self._state:
            for r, ch in enumerate(chunks):
                seq = ch.seq
                if seq.req.finished or seq.num_computed != ch.start:
                    continue
                seq.num_computed += ch.length
                self.metrics.prompt_tokens += ch.length
                self.scheduler.register_computed(seq)
                if seq.prompt_logprobs and "prompt_logprob" in host:
                    self._record_prompt_logprobs(seq, ch, host, r)
                if seq.num_computed == len(seq.tokens):
                    seq.status = DECODE
                    if self.config.mode == "prefill" and seq.ref is not None:
                        self.registry.unpin(seq.ref)           # PreFT: the adapter's device slot is free again
                    if seq.prompt_logprobs:
                        for s_ in [seq, *seq.forks]:
                            s_.req.emit(("prompt_logprobs", seq.prompt_logprobs))
                        seq.prompt_logprobs = []               # sent (a recompute after preemption resends nothing)
                    forks = self._fork(seq, out["logits"], r) if seq.forks else []
                    self._accept_safely(seq, int(nxt[r]), _entry(host, r, seq.req.sampling.logprobs))
                    for kid, tok, lp in forks:
                        self._accept_safely(kid, tok, lp)

    def _record_prompt_logprobs(self, seq: Sequence, ch: Chunk, host: dict, r: int):
        k = seq.req.sampling.prompt_logprobs
        for j in range(ch.length):
            pos = ch.start + j + 1
            if pos < seq.plen and seq.prompt_logprobs[pos] is None:
                seq.prompt_logprobs[pos] = (float(host["prompt_logprob"][r, j]),
                                            [(int(i), float(v)) for i, v in zip(host["prompt_top_ids"][r, j, :k],
                                                                                host["prompt_top_values"][r, j, :k])])

    def _fork(self, parent: Sequence, logits, row: int) -> list:
        """The parent's prefill ended: its live siblings join the running set sharing its blocks and
        draw their first tokens from the same logits row. Returns [(seq, token, logprob entry)]."""
        kids, parent.forks = parent.forks, []
        live = []
        for kid in kids:
            if kid.req.finished:
                continue
            if kid.req.cancelled:
                self._terminate(kid.req, "cancelled")
                continue
            if kid.ref is not None:
                kid.ref.entry = parent.ref.entry              # the same adapter version as the prefill
            self.scheduler.fork(parent, kid)
            if self.config.mode == "all" and kid.ref is not None:
                self.registry.pin(kid.ref)                    # the parent's slot: pinned, so a hit
            live.append(kid)
        if not live:
            return []
        try:
            S = _bucket(len(live), self.fork_buckets)
            temp, top_p, top_k, key_data, counters = self._sampling_rows(live, S)
            sp = parent.req.sampling
            out = sample_rows(logits, jnp.full(S, row, jnp.int32), jnp.asarray(temp), jnp.asarray(top_p),
                              jnp.asarray(top_k), jnp.asarray(key_data), jnp.asarray(counters),
                              logprobs=sp.logprobs is not None)
            host = _to_host(out)
        except Exception:  # noqa: BLE001 - these requests' own sampling: fail them alone
            log.exception("could not sample the first tokens of %s", [k.req.request_id for k in live])
            for kid in live:
                self._terminate(kid.req, error=_engine_failure("sampling its first token", kid.req))
            return []
        return [(kid, int(host["tokens"][i]), _entry(host, i, sp.logprobs)) for i, kid in enumerate(live)]

    # ---- decode ----------------------------------------------------------------------------
    def _decode_inputs(self, seqs: list[Sequence], ahead: int):
        """Arrays of one decode call; `ahead` = tokens already dispatched but not yet accounted (0 or 1)."""
        c = self.config
        bs, R = c.block_size, c.max_num_seqs
        nb = _bucket(max(1, max(-(-(s.num_computed + ahead + 1) // bs) for s in seqs)), self.block_buckets)
        tokens = np.zeros((R, 1), np.int32)
        ctx, clen, plen = np.zeros(R, np.int32), np.zeros(R, np.int32), np.ones(R, np.int32)
        widx = np.full((R, 1), self.num_blocks * bs, np.int32)
        ids = np.zeros(R, np.int32)
        for r, s in enumerate(seqs):
            p = s.num_computed + ahead
            if not ahead:
                tokens[r, 0] = s.tokens[p]
            ctx[r], clen[r], plen[r] = p, 1, s.plen
            widx[r, 0] = s.blocks[p // bs] * bs + p % bs
            ids[r] = 0 if s.ref is None else s.ref.slot
        bt = np.full((R, nb), NULL_BLOCK, np.int32)
        bt[:len(seqs)] = self._row_tables(seqs, nb)
        batch = PagedBatch(jnp.asarray(bt), jnp.asarray(ctx), jnp.asarray(clen), jnp.asarray(widx),
                           self.decode_attention)
        return tokens, batch, ids, plen, self._sampling_rows(seqs, R, ahead)

    def _dispatch_decode(self, seqs, ahead, prev_tokens=None, prev_rows=None):
        """Dispatches one decode call (asynchronously); with `prev_tokens` (the device output of the
        call before, not yet seen by the host) each row's input token is taken from it on device."""
        tokens, batch, ids, plen, samp = self._decode_inputs(seqs, ahead)
        if prev_tokens is not None:
            if isinstance(prev_tokens, dict):
                prev_tokens = prev_tokens["tokens"]
            where = {id(s): i for i, s in enumerate(prev_rows)}
            index = np.zeros(self.config.max_num_seqs, np.int32)
            index[:len(seqs)] = [where[id(s)] for s in seqs]
            tokens = _take_tokens(prev_tokens, jnp.asarray(index))
        logprobs = any(s.req.sampling.logprobs is not None for s in seqs)
        return self._call_decode(tokens, batch, ids, plen, samp, logprobs)

    def _call_decode(self, tokens, batch, ids, plen, samp, logprobs: bool):
        """One decode call: with each row's adapter in mode "all", else on base weights (one native
        CPU call where the engine packed weights for it, `self.native`)."""
        bank = self.registry.bank if self.config.mode == "all" else None
        return self._call(tokens, batch, bank, ids, plen, samp, (logprobs, False, False), None, self.native)

    def _copy_blocks(self, copies: list[tuple[int, int]]):
        """Device copies of shared partial blocks (copy-on-write), padded to one shape (0 -> 0)."""
        src = np.zeros(self.config.max_num_seqs, np.int32)
        dst = np.zeros(self.config.max_num_seqs, np.int32)
        for i, (a, b) in enumerate(copies):
            src[i], dst[i] = a, b
        self.cache = copy_blocks(self.cache, jnp.asarray(src), jnp.asarray(dst))

    def _run_copies(self, plan):
        """Copy-on-write before anything reads or writes this step (a failure fails the decode rows)."""
        try:
            self._copy_blocks(plan.copies)
        except Exception:  # noqa: BLE001
            log.exception("block copy failed; failing decoding requests %s", [s.req.request_id for s in plan.decode])
            self.metrics.step_failures["decode"] += 1
            for s in plan.decode:
                self._terminate(s.req, error=_engine_failure("decoding", s.req))
            self._recover_cache()

    def _run_decode(self, seqs: list[Sequence], iterations: int = 1):
        """`iterations` decode calls for the running sequences. From the second on, each call is
        dispatched before the host has seen the previous call's tokens (its input tokens stay on the
        device): the host's token handling overlaps the device's next step. A sequence that stops on
        a token the host has not seen yet has one extra token computed and discarded."""
        c = self.config
        pending = None                                          # (rows, device tokens) not yet processed
        try:
            for it in range(iterations):
                if pending is None:
                    rows = [s for s in seqs if not s.req.finished and s.status == DECODE]
                    if not rows:
                        break
                    pending = (rows, self._dispatch_decode(rows, 0))
                    continue
                prev_rows, prev = pending
                rows = [s for s in prev_rows if not s.req.finished and not s.req.cancelled
                        and len(s.req.tokens) + 2 <= s.req.sampling.max_new_tokens
                        and len(s.tokens) + 2 <= c.max_model_len]
                with self._state:                               # a home for position num_computed + 1
                    rows = [s for s in rows if self.scheduler.grow(s, s.num_computed + 2)]
                nxt = self._dispatch_decode(rows, 1, prev, prev_rows) if rows else None
                self._process_decode(prev_rows, prev)
                pending = (rows, nxt) if rows else None
                if pending is None:
                    break
            if pending is not None:
                self._process_decode(*pending)
        except Exception:  # noqa: BLE001 - not attributable: every running request is affected
            log.exception("decode step failed; failing running requests %s", [s.req.request_id for s in seqs])
            self.metrics.step_failures["decode"] += 1
            for s in seqs:
                self._terminate(s.req, error=_engine_failure("decoding", s.req))
            self._recover_cache()

    def _process_decode(self, rows, out):
        host = _to_host(out)                                    # the one host transfer of the call
        nxt = host["tokens"]
        with self._state:
            for r, s in enumerate(rows):
                if s.req.finished or s.status != DECODE:
                    continue
                s.num_computed += 1
                self.scheduler.register_computed(s)
                self._accept_safely(s, int(nxt[r]), _entry(host, r, s.req.sampling.logprobs))

    def _recover_cache(self):
        """After a failed call: if the donated KV pool was consumed, rebuild it, forget the prefix
        cache, and requeue every running sequence for recompute (prompt + generated tokens)."""
        try:
            lost = self.cache.k.is_deleted() or self.cache.v.is_deleted()
        except Exception:  # noqa: BLE001
            lost = True
        if not lost:
            return
        with self._state:
            running = list(self.scheduler.running)
            log.error("KV cache lost in a failed step; requeueing %s for recompute",
                      [s.req.request_id for s in running])
            for s in reversed(running):
                self.scheduler.preempt(s)
            self.pool.reset_prefix_cache()
            self.cache = self._new_cache()

    # ---- tokens ----------------------------------------------------------------------------
    def _accept_safely(self, seq: Sequence, token: int, logprob=None):
        try:
            if logprob is None:
                self._accept(seq, token)
            else:
                self._accept(seq, token, logprob)
        except Exception:  # noqa: BLE001 - this request's own token handling: fail it alone
            log.exception("request %s: could not process its token", seq.req.request_id)
            self._terminate(seq.req, error=_engine_failure("processing its output", seq.req))

    def _accept(self, seq: Sequence, token: int, logprob=None):
        """Records a sampled token (and its log-prob entry, when asked for); retires the request
        when it is finished."""
        req = seq.req
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
        seq.tokens.append(token)
        req.tokens.append(token)
        if logprob is not None:
            req.emit(("logprobs", [logprob]))
        req.emit(("tokens", [token]))
        if len(req.tokens) >= req.sampling.max_new_tokens or len(seq.tokens) >= self.config.max_model_len:
            return self._terminate(req, "length")

    def _terminate(self, req: Request, reason: str | None = None, error: EngineError | None = None):
        """The one way a request ends (finish or error); safe from any thread, the first call wins."""
        if not req.settle():
            return
        with self._state:
            seq = self._seqs.pop(req, None)
            forks, seq_forks = [], seq.forks if seq is not None else []
            if seq_forks:                 # ended before its prefill: its siblings end with it
                forks, seq.forks = seq_forks, []
            if seq is not None:
                try:
                    self.scheduler.remove(seq)
                except ValueError:
                    pass
            with self._lock:
                if seq is not None and seq in self._inbox:
                    self._inbox.remove(seq)
        self.registry.release(req.adapter_ref)
        for kid in forks:
            self._terminate(kid.req, reason, error)
        if error is not None:
            req.error = error
            self.metrics.requests_failed[error.code] += 1
            req.emit(("error", error))
            return
        self.metrics.requests_finished[reason] += 1
        if req.result is None:      # the engine's view; a consumer (serve/output.py) adds text and stop strings
            req.result = Result(req.request_id, req.adapter, list(req.tokens), None, reason, len(req.prompt_ids))
        req.emit(("finished", reason))

    # ---- compile everything up front -------------------------------------------------------
    def prefill_buckets(self) -> list[tuple[int, int, int]]:
        """(rows, chunk length, block-table width) of every prefill call shape."""
        return [(P, C, nb) for P in self.prefill_row_buckets for C in self.chunk_buckets
                for nb in self.prefill_block_buckets]

    def warmup_tasks(self):
        """(label, run) per program to compile (serve/warmup.py)."""
        return warmup_tasks(self)

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compiles every prefill and decode shape before serving, so no request stalls the running
        streams on a compile. Returns the seconds it took."""
        if self.busy:
            raise RuntimeError("warmup() runs before any request is submitted")
        t0 = time.monotonic()
        tasks = self.warmup_tasks()
        for i, (label, run) in enumerate(tasks):
            if progress:
                progress(f"compiling {i + 1}/{len(tasks)}: {label}")
            run()
        return time.monotonic() - t0

    def warm_in_background(self) -> int:
        """Queues every warm-up task for the engine thread, which runs one whenever no request is
        waiting or running (serve/warmup.py). Returns the number of tasks queued."""
        tasks = self.warmup_tasks()
        with self._lock:
            self._warm_pending.extend(tasks)
        self._warm_started = time.monotonic()
        self._wake.set()
        return len(tasks)

    def _warm_one(self) -> None:
        """Runs the next background warm-up task (engine thread, idle only); a failure drops the rest."""
        with self._lock:
            if not self._warm_pending:
                return
            label, run = self._warm_pending.popleft()
        try:
            run()
        except Exception:  # noqa: BLE001 - requests then compile on demand
            log.exception("background warm-up failed at %r; the remaining shapes compile on first use", label)
            with self._lock:
                self._warm_pending.clear()
            self._recover_cache()
        if not self._warm_pending and self._warm_started is not None:
            log.info("background warm-up done in %.1f s", time.monotonic() - self._warm_started)
            self._warm_started = None

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
        for req in self.live_requests():
            self._terminate(req, error=EngineError("the server is shutting down", 503, "unavailable"))

    def _loop(self):
        while not self._stop.is_set():
            if not self.busy:
                if self._warm_pending:
                    self._warm_one()
                    continue
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a bug outside the guarded device calls: never hang clients
                running = [s.req for s in list(self.scheduler.running)]
                log.exception("engine step failed; failing running requests %s", [r.request_id for r in running])
                self.metrics.step_failures["other"] += 1
                for req in running:
                    self._terminate(req, error=_engine_failure("running a step", req))
                self._recover_cache()
                time.sleep(0.01)
            if self.scheduler.waiting and not self.scheduler.running and not self._inbox:
                time.sleep(0.002)       # only waiting on adapter loads: do not spin
