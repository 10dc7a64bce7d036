"""The serving engine: a paged KV cache, chunked prefill within a token budget, prefix caching that
understands PreFT, tiered adapters, and a token-only step loop.

Each `step()`:
  1. takes new requests, ends cancelled and expired ones;
  2. asks the scheduler (serve/scheduler.py) for this step's work: one decode token for every running
     sequence, prefill chunks for the rest of `max_num_batched_tokens` (admitting waiting requests
     while rows, KV blocks and device adapter slots last; preempting by recompute when the pool runs
     out);
  3. has its device side (`StepRunner`, serve/step_runner.py: KV pool, buckets, host arrays, jitted
     calls) run at most two jitted calls (`preft_jax.paged_step`): the prefill chunks (adapted per
     the position policy; a row whose chunk ends its prompt samples its first token) and the decode
     rows: on the base weights alone (PreFT and base rows), unless a row's generated tokens use its
     adapter (mode "all", or an activated (aLoRA) adapter in either mode): then the call carries the
     bank and each row's policy decides per token (PreFT and base rows still run on base weights).
     Each call returns sampled token ids only (plus, only for calls with a row that asked for them,
     the top log-probabilities: `paged_step(logprobs=True)`);
  4. hands the ids to the requests (("tokens", ids) events, preceded by ("logprobs", entries) when
     asked for); text, stop strings and UTF-8 hold-back are the consumer's (serve/output.py).

Async scheduling (vLLM v1): while only decoding runs (nothing waiting or prefilling), up to
`num_scheduler_steps` decode calls per step are chained on the device (each call's input tokens are
the previous call's output, never read back first) and, with num_scheduler_steps > 1, the last call
is left in flight when the step returns: the next quiet step dispatches its successor before it hands
out its tokens, so the device never waits on the host's token handling between steps. A step with new
work hands out the call in flight first. num_scheduler_steps=1 is synchronous (a step's tokens are out
when it returns). With num_scheduler_steps > 1 a step that prefills hands over on the device too:
its first decode call is dispatched right behind the prefill call, before the host reads it, and
the sequences that prefill completes take their input token from its output (`_hand_off`; the
host's handling of the prefill overlaps that decode call: the prefill -> decode boundary is no
host round trip).

Randomness is per request: each sequence has its own key (from `SamplingParams.seed`, or drawn from
the engine's generator seeded by `EngineConfig.seed`), folded with the index of the token being
drawn, so a seeded request gives the same tokens whatever else is running, and a preempted one is
recomputed to the same tokens.

Parallel samples (`submit_n`, OpenAI `n`): one prefill, then n decode sequences sharing the prompt's
KV blocks (the partial last block is copied on first write, see serve/scheduler.py); the n first
tokens are drawn from the one prefill's logits (`sample_rows`).

PreFT adapters need the device only while the prompt is prefilled: a request pins a device bank
slot when its prefill starts and unpins it when the prefill ends (mode "all" and activated adapters
keep it until the end); the scheduler owns every pin and unpin (serve/scheduler.py).

Activated (aLoRA) adapters act from the last occurrence of their invocation sequence in the prompt
on (`preft_jax.adapters.policy`); the engine finds it once per request, when the adapter version is
resolved (`serve.validation.activation_start`: a prompt without it is refused, 400, at submit when
the adapter is loaded, else when it has loaded) and passes it to every prefill and decode call
(`adapter_starts`). The prompt's blocks before it are base blocks in the prefix cache.

A request is validated once, at submit, before anything is queued (serve/validation.py; sampling
fields by `SamplingParams`).

Shapes are bucketed (decode: `max_num_seqs` rows x block-table width; prefill: rows (powers of 4 up
to `max_prefill_seqs`, so one short prompt does not pay for a full prefill batch) x chunk length x
block-table width), every bucket compiled up front by `warmup()` or, while idle, by the engine thread
after `warm_in_background()` (serve/warmup.py; a failed task is retried once, then skipped).

Failure isolation: a request whose own preparation or token handling fails is failed alone; a failed
prefill call is retried one chunk at a time so only the chunk that fails by itself fails its request;
a failed decode call fails the running requests (not attributable), never the queued ones; a failed
call that consumed the (donated) KV pool rebuilds it and requeues the running sequences for
recompute. Every path ends a request through `Request.settle()`, which releases its adapter
reference once; failures are logged with tracebacks and request ids.

Lifecycle: `start()` runs the loop in a thread; `shutdown()` is idempotent and thread-safe (a signal
handler and a server's lifespan hook may both call it).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import random
import threading
import time
import weakref
from collections import deque
from typing import Callable, Sequence as Seq

import jax
import numpy as np

from preft_jax.generation import ModelRunner
from preft_jax.paged_kv import PagedKVCache
from preft_jax.sampling import SamplingParams, seed_key_data
from serve.cpu_binding import ThreadBinding
from serve.engine_config import EngineConfig
from serve.errors import DeadlineExceededError, EngineError, QueueFullError, RequestError, UnavailableError
from serve.handout import Handout
from serve.kv_blocks import BlockPool
from serve.metrics import EngineMetrics
from serve.registry import AdapterRegistry
from serve.request import GenerationRequest, Request, Result, new_request_id
from serve.scheduler import DECODE, PREFILL, Chunk, Scheduler, SchedulerConfig, Sequence
from serve.step_runner import DecodeStep, StepRunner, prompt_entry, to_host, token_entry
from serve.validation import RequestLimits, activation_start, check_request
from serve.warmup import freeze_heap, thaw_heap, warmup_tasks

__all__ = ["Engine", "EngineConfig", "EngineError", "GenerationRequest", "Request", "Result"]

log = logging.getLogger("serve.engine")


def _engine_failure(what: str, req: Request) -> EngineError:
    return EngineError(f"the engine failed while {what} (request {req.request_id}); the server log has details")


class Engine:
    """`mesh` (optional; default the runner's, see `ModelRunner`): tensor/data-parallel serving. The
    weights, the paged KV pool and the adapter bank are placed by their declared logical axes
    (preft_jax.sharding.RULES) and every step runs under the mesh with explicit out_shardings, so
    the donated pool keeps its declared sharding (`step_runner.cache_shardings`)."""

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
        self.step_runner = StepRunner(runner, registry, config, self.num_blocks)      # the device side
        self.scheduler = Scheduler(SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_seqs, config.max_model_len, bs,
            config.mode, config.starvation_s), self.pool, registry)
        self._seqs: dict[Request, Sequence] = {}
        self._inbox: deque[Sequence] = deque()
        self._cancelled: deque[tuple[Request, str]] = deque()   # (request, reason) ended early (`cancel`, a
                                                                 # stop string), not yet ended (the next step's sweep)
        self._deadlines: list[tuple[float, int, weakref.ref]] = []   # a heap: (deadline, order, request); weak:
                                                 # a finished request is not kept alive until its deadline
        self._deadline_order = itertools.count()
        self._lock = threading.Lock()            # inbox + live set (submit threads vs the engine thread)
        self._state = threading.RLock()          # scheduler state (engine thread vs a shutdown thread)
        self._endings = 0                        # requests finished or cancelled so far (under _lock): a chain's
                                                 # Handout scans its requests' flags only after it moved
        self._wake = threading.Event()
        self._rng = random.Random(config.seed)   # keys of requests without a seed (64 bits each: ~1 us,
                                                 # a numpy Generator draw was ~8 us per request)
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()       # start / shutdown (a signal handler vs a lifespan hook)
        self._warm_pending: deque = deque()      # background warm-up: (label, run, failures) (serve/warmup.py)
        self._warm_running = 0                   # a task being run now (still pending for /health)
        self._warm_skipped: list[str] = []       # tasks skipped after failing twice: "label (why)"
        self._warm_started: float | None = None
        self._token_hooks: list[Callable[[Request, int], None]] = []
        self._stop = threading.Event()
        self._accepting = True
        self._step_started: float | None = None
        self._last_step_end: float | None = None
        self._load_failures: list[tuple[Sequence, RequestError]] = []
        self.metrics = EngineMetrics()
        self.steps = 0
        self._inflight: DecodeStep | None = None  # a decode call left in flight by a quiet step (async scheduling)
        self._new_tokens = 0                     # generated this step (the metrics counter is updated once per step)
        self._froze_heap = False                 # warm-up froze the startup heap (EngineConfig.freeze_gc)
        self._binding = ThreadBinding()          # EngineConfig.cpu_binding (serve/cpu_binding.py)
        self._bind = config.cpu_binding == "on"

    @property
    def mode(self) -> str:
        return self.config.mode

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
                 timeout: float | None = None, group: str | None = None) -> list[Request]:
        """`n` completions of one prompt (OpenAI `n`), one Request each (ids `<request_id>-<i>` when
        n > 1; `events`: one sink per completion). The prompt is prefilled once; the n sequences
        then share its KV blocks. With `sampling.seed`, completion i draws from a key derived from
        (seed, i): the same seed gives the same n outputs. Until the prompt is prefilled the n are
        one unit: cancelling or failing the first ends them all. `group`: the client request these
        belong to (default: this submission), the unit the scheduler shares steps between."""
        return self.submit_many([GenerationRequest(prompt_ids, adapter, sampling, stop, n, events, request_id,
                                                   timeout, group)])[0]

    def submit_many(self, items: Seq, queue_limit: bool = True) -> list[list[Request]]:
        """Submits several prompts at once, all or nothing: every item (a `GenerationRequest`, or a
        (prompt_ids, adapter, sampling[, stop]) tuple) is validated, its adapter referenced and the
        queue's room checked for all of them before any is queued, so an error (RequestError
        subclasses, as `submit`) leaves nothing queued and nothing started. Returns each item's
        requests (`submit_n`'s list), in order. The items share one lock, one capacity check and
        one wake-up of the loop (what a client with a batch of prompts, `generate` or a server
        request with several prompts, would otherwise pay per prompt). `queue_limit=False` (the
        offline `generate`, whose caller steps the engine itself) does not bound the batch by
        `max_queued`, the server's protection against clients."""
        items = [r if isinstance(r, GenerationRequest) else GenerationRequest(*r) for r in items]
        limits = self.limits
        checked = [check_request(limits, r.prompt_ids, r.sampling, r.stop, r.n, r.timeout, r.events) for r in items]
        adding = len(items) if queue_limit else 0
        with self._lock:                                  # refuse before taking an adapter reference
            self._check_capacity_locked(adding)
        refs: list = []
        try:
            for r, (ids, _) in zip(items, checked):
                refs.extend(self.registry.acquire(r.adapter) for _ in range(r.n))   # raises UnknownAdapterError
                self._check_invocation(r.adapter, ids)    # also starts loading it now, off the engine thread
            out = self._queue(items, checked, refs, adding)
        except BaseException:                             # nothing queued: every reference taken goes back
            for ref in refs:
                self.registry.release(ref)
            raise
        total = len(refs)
        self.metrics.requests_submitted += total
        self.metrics.by_mode[self.config.mode] += total
        if not self._wake.is_set():                       # the loop re-checks the inbox after clearing it
            self._wake.set()
        return [[seq.req for seq in seqs] for seqs in out]

    def _queue(self, items: list[GenerationRequest], checked: list, refs: list, adding: int) -> list[list[Sequence]]:
        """`submit_many`'s second half: the items' Requests and Sequences (one per completion, holding
        `refs` in order), queued under one lock after the capacity check (`adding` prompts)."""
        now = time.monotonic()
        eos = tuple(self.runner.cfg.eos_token_ids)
        unseeded = sum(r.n for r in items if r.sampling.seed is None)
        with self._lock:                                  # submit runs on callers' threads
            draws = iter([self._rng.getrandbits(64) for _ in range(unseeded)])
        out, firsts = [], []
        refs_left = iter(refs)
        for r, (ids, stop) in zip(items, checked):
            timeout = self.config.request_timeout if r.timeout is None else r.timeout
            deadline = None if timeout is None else now + timeout
            sampling, n = r.sampling, r.n
            stop_ids = tuple(sampling.stop_token_ids) or eos
            rid = r.request_id or new_request_id()
            seqs = []
            for i in range(n):
                req = Request(rid if n == 1 else f"{rid}-{i}", ids, r.adapter, sampling, stop_ids, stop,
                              next(refs_left), deadline=deadline, tokenizer=self.tokenizer, on_stop=self._end_at_stop_string,
                              group=r.group or rid, submitted_at=now)
                if sampling.seed is not None:
                    req.key_data = seed_key_data(sampling.seed, i)
                else:
                    bits = next(draws)
                    req.key_data = (bits & 0xFFFFFFFF, bits >> 32)     # uint32 [2] (sampling_columns packs the rows')
                if r.events is not None:
                    req.events = r.events[i]
                seq = Sequence(req, list(ids), len(ids), arrived=now)
                if sampling.prompt_logprobs is not None:
                    seq.prompt_logprobs = [None] * len(ids)
                seqs.append(seq)
            seqs[0].forks = seqs[1:]
            firsts.append(seqs[0])
            out.append(seqs)
        with self._lock:
            self._check_capacity_locked(adding)
            self._inbox.extend(firsts)
            for seqs in out:
                for seq in seqs:
                    self._seqs[seq.req] = seq
                    if seq.req.deadline is not None:
                        heapq.heappush(self._deadlines, (seq.req.deadline, next(self._deadline_order),
                                                         weakref.ref(seq.req)))
        return out

    def _check_invocation(self, adapter: str | None, prompt_ids: Seq[int]) -> None:
        """An activated (aLoRA) adapter's prompt must contain its invocation sequence: refused here
        (InvocationMissingError, 400) when the adapter is loaded already, else when it has loaded
        (`_adapter_ready`). Starts loading the adapter (host tier) when it is not."""
        if adapter is None:
            return
        fut = self.registry.prepare(adapter)
        if fut.done() and fut.exception() is None:
            activation_start(fut.result().policy, prompt_ids, adapter)

    def _check_capacity_locked(self, adding: int = 1):
        """Room in the wait queue for `adding` prompts (0: no bound, only a running engine)."""
        if not self._accepting:
            raise UnavailableError("the engine is shutting down; no new requests are accepted")
        limit = self.config.max_queued
        if adding > limit:                                # no retry can help: a client error
            raise RequestError(f"this submission brings {adding} prompts; the request queue holds at most "
                               f"{limit} (max_queued; the server's --max-queued)", "prompt")
        queued = self.queued
        if queued + adding > limit:
            if adding > 1 and queued + 1 <= limit:
                raise QueueFullError(f"the request queue has room for {limit - queued} more prompt(s) and this "
                                     f"submission brings {adding} ({limit} waiting at most); retry later")
            raise QueueFullError(f"the request queue is full ({limit} waiting requests); retry later")

    def cancel(self, req: Request) -> None:
        """Stops a queued or running request at the next step (finish_reason "cancelled")."""
        self._end_early(req, "cancelled")

    def _end_at_stop_string(self, req: Request) -> None:
        """The consumer found a stop string in the request's text (serve/output.py): the engine stops
        generating for it at the next step and counts it as finished by "stop", as the client sees it."""
        self._end_early(req, "stop")

    def _end_early(self, req: Request, reason: str) -> None:
        req.cancelled = True
        with self._lock:
            self._endings += 1
        self._cancelled.append((req, reason))
        self._wake.set()

    def generate(self, requests: Seq) -> list[Result]:
        """Synchronous: submits GenerationRequests (or (prompt_ids, adapter, sampling[, stop]) tuples)
        and steps until all are done; one Result per completion, in order (n > 1: the item's n in a
        row). All or nothing (`submit_many`): a bad request leaves nothing queued."""
        if self._thread is not None:
            raise RuntimeError("engine is running in the background; use submit() + wait()")
        handles = [req for reqs in self.submit_many(requests, queue_limit=False) for req in reqs]
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

    @property
    def limits(self) -> RequestLimits:
        """What this engine can represent (serve/validation.py checks requests against it); built
        once per tokenizer (a server sets one after construction)."""
        cached = self.__dict__.get("_limits")
        if cached is not None and cached[0] is self.tokenizer:
            return cached[1]
        c = self.config
        limits = RequestLimits(self.runner.cfg.vocab_size, c.max_model_len, c.max_num_seqs,
                               self.pool.capacity * c.block_size, self.scheduler.fits_ever, self.tokenizer is not None,
                               c.max_request_sequences, c.max_request_prompt_logprob_tokens)
        self._limits = (self.tokenizer, limits)
        return limits

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

    def sequence(self, req: Request) -> Sequence | None:
        """The engine-side sequence of a live request (its tokens, KV blocks, status), or None."""
        with self._lock:
            return self._seqs.get(req)

    def add_token_hook(self, hook: Callable[[Request, int], None]) -> None:
        """Calls hook(request, token) before each sampled token is recorded; an exception fails that
        request alone (as any error in its own token handling)."""
        self._token_hooks.append(hook)

    def health(self) -> dict:
        """The loop's liveness: wedged when its thread died or one step has run past wedge_timeout."""
        now = time.monotonic()
        started, thread = self._step_started, self._thread      # each read once: shutdown may clear them
        step_age = 0.0 if started is None else now - started
        running = thread is not None
        alive = running and thread.is_alive() and not self._stop.is_set()
        wedged = (running and not alive and self._accepting) or step_age > self.config.wedge_timeout
        return {"loop_running": alive, "wedged": wedged, "accepting": self._accepting,
                "step_in_progress_s": round(step_age, 3),
                "last_step_age_s": None if self._last_step_end is None else round(now - self._last_step_end, 3),
                "steps": self.steps, "queued": self.queued, "max_queued": self.config.max_queued,
                "running": self.active, "decode_rows": self.config.max_num_seqs,
                "saturation": round(self.active / self.config.max_num_seqs, 3),
                "queue_saturation": round(self.queued / max(1, self.config.max_queued), 3),
                "kv_blocks": self.pool.capacity, "kv_blocks_used": self.pool.capacity - self.pool.num_available,
                "kv_usage": round(self.pool.usage(), 3),
                "warmup_pending": len(self._warm_pending) + self._warm_running,
                "warmup_failed": len(self._warm_skipped), "warmup_skipped": list(self._warm_skipped),
                "cpu_decode": "xla" if self.step_runner.native is None else "native",
                "cpu_binding": "bound" if self._binding.bound_to is not None else "unbound"}

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> None:
        if self._bind:                         # cpu_binding="on": whichever thread steps the engine
            self._binding.bind()
        self._step_started = time.monotonic()
        try:
            with self._state:
                self._drain_inbox()
                self._sweep()
                carry_on = self._inflight is not None and self._only_inflight_runs()
            if carry_on:                       # async scheduling: nothing new, the decode pipeline goes on
                self._run_decode(None, self.config.num_scheduler_steps, keep=True)
                return
            if self._inflight is not None:     # new work: hand out the call in flight first
                self._run_decode(None, 0)
            with self._state:
                plan = self.scheduler.schedule(self._adapter_ready)
                for seq, err in self._load_failures:
                    self._terminate(seq.req, error=EngineError(err.public_message, err.status, err.code))
                self._load_failures.clear()
                if plan.preempted:
                    log.info("preempted %s (KV pool exhausted); they will be recomputed",
                             [s.req.request_id for s in plan.preempted])
            if plan.copies:
                self._run_copies(plan)
            decode = [s for s in plan.decode if not s.req.finished and s.status == DECODE]
            # a failed block copy that lost the pool requeued the running sequences: their chunks go
            prefill = [ch for ch in plan.prefill if ch.seq.status == PREFILL and not ch.seq.req.finished]
            if prefill:
                handoff = self.config.num_scheduler_steps > 1
                if self._run_prefill(prefill, decode if handoff else None):
                    return                     # the step's decode call went with the prefill
                decode = [s for s in decode if not s.req.finished and s.status == DECODE]
            if decode:
                quiet = not plan.prefill and not self._inbox and not self.scheduler.waiting
                self._run_decode(decode, self.config.num_scheduler_steps if quiet else 1, keep=quiet)
        finally:
            if self._new_tokens:
                self.metrics.generated_tokens += self._new_tokens
                self._new_tokens = 0
            self.steps += 1
            self._last_step_end = time.monotonic()
            self._step_started = None

    def _drain_inbox(self):
        with self._lock:
            while self._inbox:
                self.scheduler.add(self._inbox.popleft())

    def _sweep(self):
        """Ends cancelled and expired requests, queued or running: the ones `cancel` named since the
        last sweep, and those at the top of the deadline heap (no per-request work per step)."""
        while self._cancelled:
            req, reason = self._cancelled.popleft()
            if not req.finished and req in self._seqs:
                self._terminate(req, reason)
        now, expired = time.monotonic(), []
        with self._lock:                                    # submit threads push
            heap = self._deadlines
            while heap and heap[0][0] < now:
                expired.append(heapq.heappop(heap)[2]())
            if len(heap) > 2 * len(self._seqs) + 1024:      # finished requests wait for their deadline: drop them
                self._deadlines = [e for e in heap if (r := e[2]()) is not None and not r.finished]
                heapq.heapify(self._deadlines)
        for req in expired:
            if req is not None and not req.finished and req in self._seqs:
                self._terminate(req, error=DeadlineExceededError(
                    f"request {req.request_id} exceeded its deadline; {len(req.tokens)} tokens were generated"))

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether the sequence's adapter version is resolved (loaded); then, once, where an activated
        (aLoRA) adapter starts acting on its prompt (a prompt without the invocation fails here)."""
        ref = seq.ref
        if ref is None:
            return True
        try:
            entry = self.registry.resolve(ref)
            if entry is not None and seq.adapter_start is None:
                seq.adapter_start = activation_start(entry.policy, seq.tokens[:seq.plen], ref.name)
            return entry is not None
        except RequestError as e:                       # the adapter cannot be loaded: this request fails
            self._load_failures.append((seq, e))
            return False

    def _run_prefill(self, chunks: list[Chunk], decode: list[Sequence] | None = None) -> bool:
        """One prefill call for `chunks`; its first tokens go to the rows that complete their prompt.

        With `decode` (async scheduling, num_scheduler_steps > 1: the running sequences this step
        decodes, possibly none) the step's first decode call is dispatched right behind the prefill,
        before the host has read the prefill's tokens (`_hand_off`): it holds `decode` and the
        sequences this prefill completes, which take their input token from the prefill's output on
        the device. The host's handling of the prefill then overlaps that decode call, and the
        prefill -> decode boundary is no host round trip (vLLM v1's async scheduling). Returns
        whether the step's decode call was made (then it is processed or left in flight here)."""
        try:
            call = self.step_runner.prefill_call(chunks)
        except Exception:  # noqa: BLE001 - host-side data of one of these requests: find it
            log.exception("could not prepare prefill for %s", [ch.seq.req.request_id for ch in chunks])
            if len(chunks) == 1:
                self._terminate(chunks[0].seq.req, error=_engine_failure("preparing its prompt", chunks[0].seq.req))
            else:
                for ch in chunks:
                    self._run_prefill([ch])
            return False
        try:
            out = self.step_runner.run(call)
        except Exception:  # noqa: BLE001 - the call could not be made: retry chunk by chunk
            self._prefill_failed(chunks)
            return False
        first, handed = self._hand_off(chunks, out, decode) if decode is not None else (None, set())
        try:
            host = to_host(out)
        except Exception:  # noqa: BLE001 - the call failed on the device
            if not handed:
                self._prefill_failed(chunks)
                return False
            # the handed-off sequences are already decoding: not retried chunk by chunk, failed
            # (the device failed, not one request's data: a data error fails the dispatch above)
            log.exception("prefill step failed on the device for requests %s", [ch.seq.req.request_id for ch in chunks])
            self.metrics.step_failures["prefill"] += 1
            self._recover_cache()
            with self._state:                                   # the handed rows' blocks were registered early
                self.pool.reset_prefix_cache()
            for ch in chunks:
                if ch.seq in handed or len(chunks) == 1:
                    self._terminate(ch.seq.req, error=_engine_failure("prefilling its prompt", ch.seq.req))
            return False
        nxt = host["tokens"]
        with self._state:
            for r, ch in enumerate(chunks):
                seq = ch.seq
                early = seq in handed                           # its bookkeeping was done by `_hand_off`
                if seq.req.finished or not early and (seq.num_computed != ch.start or seq.status != PREFILL):
                    continue                                    # ended, or requeued by a lost pool's recovery
                if not early:
                    seq.num_computed += ch.length
                    self.metrics.prompt_tokens += ch.length
                    self.scheduler.register_computed(seq)
                if seq.prompt_logprobs and "prompt_logprob" in host:
                    self._record_prompt_logprobs(seq, ch, host, r)
                if seq.num_computed == len(seq.tokens):
                    if not early:
                        self.scheduler.prefill_done(seq)       # decodes next (PreFT: its adapter slot is free)
                    if seq.prompt_logprobs:
                        for s_ in [seq, *seq.forks]:
                            s_.req.emit(("prompt_logprobs", seq.prompt_logprobs))
                        seq.prompt_logprobs = []               # sent (a recompute after preemption resends nothing)
                    forks = self._fork(seq, out["logits"], r) if seq.forks else []
                    self._accept_safely(seq, int(nxt[r]), token_entry(host, r, seq.req.sampling.logprobs))
                    for kid, tok, lp in forks:
                        self._accept_safely(kid, tok, lp)
        if first is None:
            return False
        # a chain (and a call left in flight) only when nothing waits for the scheduler: no request
        # queued and no prompt part-way through its chunks (its next chunk would wait on the chain)
        quiet = (not self._inbox and not self.scheduler.waiting
                 and all(s.status == DECODE for s in self.scheduler.running))
        self._inflight = first
        self._run_decode(None, self.config.num_scheduler_steps - 1 if quiet else 0, keep=quiet)
        return True

    def _prefill_failed(self, chunks: list[Chunk]) -> None:
        """A prefill call failed: rebuild the pool if it was consumed, then retry chunk by chunk (only
        the chunk that fails by itself fails its request)."""
        log.exception("prefill step failed for requests %s", [ch.seq.req.request_id for ch in chunks])
        self.metrics.step_failures["prefill"] += 1
        self._recover_cache()
        if len(chunks) > 1:
            for ch in chunks:
                if not ch.seq.req.finished and ch.seq.num_computed == ch.start and ch.seq.blocks:
                    self._run_prefill([ch])
        elif not chunks[0].seq.req.finished:
            self._terminate(chunks[0].seq.req, error=_engine_failure("prefilling its prompt", chunks[0].seq.req))

    def _hand_off(self, chunks: list[Chunk], out, decode: list[Sequence]) -> tuple[DecodeStep | None, set]:
        """Dispatches the step's first decode call right behind the prefill call `out` (not read
        yet): the rows of `decode` (input tokens from the host) and the sequences whose prompt (or
        recompute) this prefill completes, with room for a token after the first and a KV home for
        its position, and no parallel samples waiting on their prefill (their first tokens come
        from its logits); those take their input token from the prefill's output on the device.
        Their prefill bookkeeping (computed positions, prefix-cache blocks, PreFT's slot unpinned:
        the prefill call holds the bank it read) is done here, before the tokens are known.
        Returns (the decode call, the handed-off sequences); (None, empty) when there is no row or
        the call cannot be made (the rows then decode as usual, next step)."""
        handed, rows, fit = [], [], []
        with self._state:
            for r, ch in enumerate(chunks):
                s, req = ch.seq, ch.seq.req
                n = ch.start + ch.length                        # positions computed after this call
                if not (req.finished or s.status != PREFILL or s.forks or s.num_computed != ch.start
                        or n != len(s.tokens) or self._room_of(s) < 2):
                    fit.append((r, ch, n))
            grown = self.scheduler.grow_many([ch.seq for _, ch, _ in fit], [n + 1 for _, _, n in fit])
            for (r, ch, n), ok in zip(fit, grown):              # a home for the first decode position
                if not ok:
                    continue
                s = ch.seq
                s.num_computed = n
                self.metrics.prompt_tokens += ch.length
                self.scheduler.register_computed(s)
                self.scheduler.prefill_done(s)
                handed.append(s)
                rows.append(r)
        seqs = decode + handed
        if not seqs:
            return None, set()
        src = np.full(len(seqs), -1, np.int32)
        src[len(decode):] = rows
        try:
            first = self.step_runner.dispatch_decode(seqs, handoff=(out, src))
        except Exception:  # noqa: BLE001 - not attributable: every row of the call is affected
            log.exception("decode step failed; failing requests %s", [s.req.request_id for s in seqs])
            self.metrics.step_failures["decode"] += 1
            for s in seqs:
                self._terminate(s.req, error=_engine_failure("decoding", s.req))
            self._recover_cache()
            return None, set(handed)
        first.room = self._room(seqs) - (src >= 0)       # the handed rows' first token is not seen yet
        return first, set(handed)

    def _record_prompt_logprobs(self, seq: Sequence, ch: Chunk, host: dict, r: int):
        k = seq.req.sampling.prompt_logprobs
        for j in range(ch.length):
            pos = ch.start + j + 1
            if pos < seq.plen and seq.prompt_logprobs[pos] is None:
                seq.prompt_logprobs[pos] = prompt_entry(host, r, j, k)

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
            self.scheduler.fork(parent, kid)                  # shares its blocks and adapter version
            live.append(kid)
        if not live:
            return []
        sp = parent.req.sampling
        try:
            host = to_host(self.step_runner.sample_forks(logits, row, live, sp.logprobs is not None))
        except Exception:  # noqa: BLE001 - these requests' own sampling: fail them alone
            log.exception("could not sample the first tokens of %s", [k.req.request_id for k in live])
            for kid in live:
                self._terminate(kid.req, error=_engine_failure("sampling its first token", kid.req))
            return []
        return [(kid, int(host["tokens"][i]), token_entry(host, i, sp.logprobs)) for i, kid in enumerate(live)]

    # ---- decode ----------------------------------------------------------------------------
    def _run_copies(self, plan):
        """Copy-on-write before anything reads or writes this step (a failure fails the decode rows)."""
        try:
            self.step_runner.copy_blocks(plan.copies)
        except Exception:  # noqa: BLE001
            log.exception("block copy failed; failing decoding requests %s", [s.req.request_id for s in plan.decode])
            self.metrics.step_failures["decode"] += 1
            for s in plan.decode:
                self._terminate(s.req, error=_engine_failure("decoding", s.req))
            self._recover_cache()

    def _only_inflight_runs(self) -> bool:
        """Whether this step has nothing to do but continue the decode call left in flight: no request
        waiting, none prefilling, and the running sequences exactly that call's (a row it could not
        continue, e.g. for want of a KV block, goes back through the scheduler)."""
        if self._inbox or self.scheduler.waiting:
            return False
        running = self.scheduler.running
        live = [s for s in self._inflight.seqs if not s.req.finished]
        return len(live) == len(running) and set(live) == set(running)

    def _run_decode(self, seqs: list[Sequence] | None, iterations: int = 1, keep: bool = False):
        """`iterations` decode calls for the running sequences `seqs` (None: continue the call in
        flight, `_inflight`). Every call after the first is dispatched before the host has seen the
        previous call's tokens (its input tokens stay on the device): the host's token handling
        overlaps the device's next step. A sequence that stops on a token the host has not seen yet
        has one extra token computed and discarded.

        `keep` (num_scheduler_steps > 1, a quiet step): the last call is left in flight and the step
        returns (vLLM's async scheduling); the next step dispatches its successor before handing out
        its tokens, or, when there is new work, hands them out first. So the device never waits for
        the host between steps, and a step's last tokens reach the requests at the start of the next."""
        c = self.config
        pending, self._inflight = self._inflight, None          # dispatched, not yet processed
        if seqs is None:
            seqs = pending.seqs
        try:
            for it in range(iterations):
                if pending is None:
                    rows = [s for s in seqs if not s.req.finished and s.status == DECODE]
                    if not rows:
                        break
                    pending = self.step_runner.dispatch_decode(rows)
                    pending.room = self._room(rows)
                    continue
                prev = pending
                pending = self._continue_decode(prev)
                self._process_decode(prev)
                if pending is None:
                    break
            if pending is not None:
                if keep and c.num_scheduler_steps > 1:
                    self._inflight = pending
                else:
                    self._process_decode(pending)
        except Exception:  # noqa: BLE001 - not attributable: every running request is affected
            log.exception("decode step failed; failing running requests %s", [s.req.request_id for s in seqs])
            self.metrics.step_failures["decode"] += 1
            for s in seqs:
                self._terminate(s.req, error=_engine_failure("decoding", s.req))
            self._recover_cache()

    def _grow(self, seqs: list[Sequence], upto: list[int]) -> list[bool]:
        """KV blocks for positions < upto[i] of each of `seqs` (`Scheduler.grow_many`); False: none left."""
        with self._state:
            return self.scheduler.grow_many(seqs, upto)

    def _room_of(self, s: Sequence) -> int:
        """Tokens the sequence may still generate (its request's budget, the context length)."""
        return min(s.req.sampling.max_new_tokens - len(s.req.tokens), self.config.max_model_len - len(s.tokens))

    def _room(self, seqs: list[Sequence]) -> np.ndarray:
        """`_room_of` each sequence, as an array."""
        return np.fromiter(map(self._room_of, seqs), np.int64, len(seqs))

    def _continue_decode(self, prev: DecodeStep) -> DecodeStep | None:
        """The next call of a pipelined chain, dispatched before the host has seen `prev`'s tokens:
        its rows that may still generate a token after `prev`'s (`room`), are neither finished nor
        cancelled, and have a home for the positions the call reaches (blocks are allocated only
        for the rows whose positions enter a block they lack: `DecodeRows.advance` finds them, the
        scheduler grows them). One call fuses `decode_steps_per_call` steps
        (`StepRunner.fused_steps`). Per-row work is vectorized over the `DecodeStep` arrays; None
        when no row continues."""
        steps = self.step_runner.fused_steps()
        room = prev.room - prev.steps                           # tokens each row may generate after prev's
        seqs, hand = prev.seqs, prev.handout
        if hand is None:                                        # the chain's per-row handles, read once
            hand = prev.handout = Handout(seqs)
        nxt = prev.positions + prev.steps                       # the first position the call writes
        ended = hand.ended(self._endings)
        if not ended and room.min() >= steps:                   # the common case: every row goes on, `steps` tokens
            keep = reach = None
        else:
            keep = room >= 1
            if ended:
                keep &= ~hand.ended_rows()
            reach = nxt + np.minimum(steps, room)               # positions < reach need a home: the later
                                                                # ones' tokens are dropped (written to no block)
        # the rows whose positions enter a block they lack get one from the scheduler (`_grow`); a row
        # the pool cannot grow leaves the call and goes back through the scheduler next step
        step = self.step_runner.continue_decode(prev, keep, steps, positions=nxt, reach=reach, grow=self._grow)
        if step is not None:
            if step.seqs is seqs:                               # the same rows, in the same order:
                step.room, step.handout = room, hand            # the chain's per-row handles go on
            else:                                               # some left (`keep`, or no block for them)
                step.room = room[np.isin(prev.rows, step.rows)]
        return step

    def _process_decode(self, step: DecodeStep):
        """Hands a decode call's tokens to its requests (the one host transfer of the call; a fused
        call's k tokens per row in order, the rest of a row that stopped dropped). Which rows are
        the common case is decided column-wise (`Handout.special`: no stop token among its
        tokens, no token hook, no log-probabilities; `step.room`: the tokens it may still
        generate - its request's budget and the context). Those take one tight loop with one
        event per row (`Handout.give`, through the chain's per-row handles), and so do the rows
        whose k tokens are exactly their last (then finished: "length"); every other row takes
        `_process_row`, token by token through `_accept`. With a prefix cache, a row whose
        positions complete a KV block registers it (a row that ends with such a block takes
        `_process_row`: it registers before its last token)."""
        host, k = to_host(step.out), step.steps
        toks = host["tokens"][step.rows]                        # one gather + conversion, not one per row
        now, seqs, room = time.monotonic(), step.seqs, step.room
        hand = step.handout
        if hand is None:
            hand = step.handout = Handout(seqs)
        with self._state:
            if "logprob" in host or self._token_hooks:
                special = np.ones(len(seqs), bool)
            else:
                special = hand.special(toks, k, self.scheduler.preemptions, self._endings)
            tokens = toks.tolist()
            if self.pool.enable_prefix_cache:                   # no cache: no block to register
                pos, bs = step.positions, self.config.block_size
                full = (pos + k) // bs > pos // bs
            else:
                full = None
            last, ends = room <= k, ()
            if last.any():                                      # rows whose budget ends in this call
                ends = (room == k) & ~special                   # exactly its last k tokens
                if full is not None:
                    ends &= ~full
                special |= last & ~ends
                ends = np.flatnonzero(ends).tolist()
            rest = np.flatnonzero(special).tolist()
            if len(rest) < len(seqs):
                gaps = hand.give(tokens, k, now, None if not rest else (~special).tolist())
                self._new_tokens += len(gaps) * k
                self.metrics.inter_token.observe_many(gaps)
                if k > 1:                                       # a fused call's tokens arrive together
                    self.metrics.inter_token.observe_n(0.0, len(gaps) * (k - 1))
                if ends:                                        # their last tokens are in
                    self._finish_many([seqs[i].req for i in ends], "length")
                if full is not None:                            # they go on: their full blocks are registered
                    for i in np.flatnonzero(full & ~special).tolist():
                        self.scheduler.register_computed(seqs[i])
            for i in rest:
                self._process_row(seqs[i], i, tokens[i], step, host, full is not None and bool(full[i]), now)

    def _process_row(self, s: Sequence, i: int, toks, step: DecodeStep, host: dict, register: bool, now: float):
        """`_process_decode` for sequence `s` on row i of `step` (its token, or a fused call's
        tokens `toks`), token by token through `_accept`: a token hook, log-probabilities, stop
        tokens, its last tokens. A block the call completes (`register`) is registered before the
        token that ends the request (once the call's earlier tokens are in: a block's hash covers
        the tokens fed at its positions), else after its tokens."""
        req, k = s.req, step.steps
        if req.finished or s.status != DECODE:
            return
        s.num_computed += k
        for token in ([toks] if k == 1 else toks):
            if req.finished:
                break
            if register and self._ends_with(s, token):
                self.scheduler.register_computed(s)             # the token that ends it: blocks first
                register = False
            self._accept_safely(s, token, token_entry(host, int(step.rows[i]), req.sampling.logprobs)
                                if "logprob" in host else None, now)
        if register and not req.finished:
            self.scheduler.register_computed(s)

    def _recover_cache(self):
        """After a failed call: if the donated KV pool was consumed, rebuild it, forget the prefix
        cache, and requeue every running sequence for recompute (prompt + generated tokens)."""
        self._inflight = None                                   # its rows are gone with the failed call
        if not self.step_runner.cache_lost():
            return
        with self._state:
            running = list(self.scheduler.running)
            log.error("KV cache lost in a failed step; requeueing %s for recompute",
                      [s.req.request_id for s in running])
            for s in reversed(running):
                self.scheduler.preempt(s)
            self.pool.reset_prefix_cache()
            self.step_runner.reset_cache()

    # ---- tokens ----------------------------------------------------------------------------
    def _accept_safely(self, seq: Sequence, token: int, logprob=None, now: float | None = None):
        try:
            self._accept(seq, token, logprob, now)
        except Exception:  # noqa: BLE001 - this request's own token handling: fail it alone
            log.exception("request %s: could not process its token", seq.req.request_id)
            self._terminate(seq.req, error=_engine_failure("processing its output", seq.req))

    def _accept(self, seq: Sequence, token: int, logprob=None, now: float | None = None):
        """Records a sampled token (and its log-prob entry, when asked for); retires the request
        when it is finished. `now`: the time the call's tokens reached the host (one clock read per call)."""
        req = seq.req
        for hook in self._token_hooks:
            hook(req, token)
        if now is None:
            now = time.monotonic()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.submitted_at)
        else:
            self.metrics.inter_token.observe(now - req.last_token_at)
        req.last_token_at = now
        self._new_tokens += 1
        reason = self._ends_with(seq, token)
        if reason == "stop":                    # not kept, but named, with its log-prob entry (vLLM lists it)
            req.stop_token_id = token
            req.emit(("stop_token", (token, logprob)))
            return self._terminate(req, "stop")
        seq.tokens.append(token)
        req.tokens.append(token)
        if logprob is not None:
            req.emit(("logprobs", [logprob]))
        req.emit(("tokens", [token]))
        if reason:
            return self._terminate(req, reason)

    def _ends_with(self, seq: Sequence, token: int) -> str | None:
        """How `token`, the next one `seq` generates, ends its request: "stop" (a stop token, not
        kept), "length" (its last: the request's budget or the context), or None."""
        req = seq.req
        if token in req.stop_token_ids:
            return "stop"
        if len(req.tokens) + 1 >= req.sampling.max_new_tokens or len(seq.tokens) + 1 >= self.config.max_model_len:
            return "length"
        return None

    def _terminate(self, req: Request, reason: str | None = None, error: EngineError | None = None):
        """The one way a request ends (finish or error); safe from any thread, the first call wins."""
        if req.settle():
            self._retire([req], reason, error)

    def _finish_many(self, reqs: list[Request], reason: str) -> None:
        """`_terminate(req, reason)` for requests that end normally on the same call: their
        sequences leave the scheduler in one pass (`Scheduler.remove_many`)."""
        reqs = [r for r in reqs if r.settle()]
        if reqs:
            self._retire(reqs, reason, None)

    def _retire(self, reqs: list[Request], reason: str | None, error: EngineError | None) -> None:
        """The requests' end, once each has been settled (`Request.settle`) by this thread: their
        sequences, blocks and adapter references go, then a parallel sample's siblings waiting on
        its prefill, then the result and the ("finished", reason) or ("error", e) event."""
        kids = []
        with self._state:
            seqs = []
            for req in reqs:
                seq = self._seqs.pop(req, None)
                if seq is not None:
                    if seq.forks:             # ended before its prefill: its siblings end with it
                        kids += seq.forks
                        seq.forks = []
                    seqs.append(seq)
            self.scheduler.remove_many(seqs)
            with self._lock:
                self._endings += len(reqs)
                if self._inbox:
                    for seq in seqs:
                        if seq in self._inbox:
                            self._inbox.remove(seq)
        for req in reqs:
            self.registry.release(req.adapter_ref)
        for kid in kids:
            self._terminate(kid.req, reason, error)
        if error is not None:
            for req in reqs:
                req.error = error
                self.metrics.requests_failed[error.code] += 1
                req.emit(("error", error))
            return
        self.metrics.requests_finished[reason] += len(reqs)
        for req in reqs:
            if req.result is None:  # the engine's view; a consumer (serve/output.py) adds text and stop strings
                req.result = Result(req.request_id, req.adapter, list(req.tokens), None, reason, len(req.prompt_ids),
                                    stop_token_id=req.stop_token_id if reason == "stop" else None)
            req.emit(("finished", reason))

    # ---- compile everything up front -------------------------------------------------------
    def warmup_tasks(self):
        """(label, run) per program to compile (serve/warmup.py)."""
        return warmup_tasks(self.step_runner)

    def warmup(self, progress: Callable[[str], None] | None = None) -> float:
        """Compiles every prefill and decode shape before serving, so no request stalls the running
        streams on a compile. A task that fails is retried once after the others, then skipped (one log
        line each time, as the background warm-up). Returns the seconds it took."""
        if self.busy:
            raise RuntimeError("warmup() runs before any request is submitted")
        t0 = time.monotonic()
        tasks = self.warmup_tasks()
        retry = []
        for i, (label, run) in enumerate(tasks):
            if progress:
                progress(f"compiling {i + 1}/{len(tasks)}: {label}")
            if not self._run_warm_task(label, run, 0, "warm-up"):
                retry.append((label, run))
        for label, run in retry:
            if progress:
                progress(f"compiling again: {label}")
            self._run_warm_task(label, run, 1, "warm-up")
        self._freeze_heap()
        return time.monotonic() - t0

    def _freeze_heap(self) -> None:
        if self.config.freeze_gc:
            freeze_heap(self.config.gc_gen0_threshold)
            self._froze_heap = True

    def warm_in_background(self) -> int:
        """Queues every warm-up task for the engine thread, which runs one whenever no request is
        waiting or running (serve/warmup.py). Returns the number of tasks queued."""
        tasks = self.warmup_tasks()
        with self._lock:
            self._warm_pending.extend((label, run, 0) for label, run in tasks)
        self._warm_started = time.monotonic()
        self._wake.set()
        return len(tasks)

    def _run_warm_task(self, label: str, run: Callable[[], object], failures: int, kind: str) -> bool:
        """Runs one warm-up task; True when it compiled. A first failure logs one WARNING line (the
        caller retries it once after the others), a second one ERROR line and records the shape as
        skipped (/health warmup_skipped; it compiles on first use)."""
        try:
            run()
            return True
        except Exception as e:  # noqa: BLE001 - requests then compile that shape on demand
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            log.debug("warm-up task %r failed", label, exc_info=True)
            self._recover_cache()
            if failures == 0:
                log.warning("%s of %r failed (%s); retrying it once", kind, label, why)
            else:
                log.error("%s of %r failed again (%s); skipped, it compiles on first use", kind, label, why)
                with self._lock:
                    self._warm_skipped.append(f"{label} ({why})")
            return False

    def _warm_one(self) -> None:
        """Runs the next background warm-up task (engine thread, idle only). A task that fails is
        retried once after the others, then skipped (its shape compiles on first use); the rest go on."""
        with self._lock:
            if not self._warm_pending:
                return
            label, run, failures = self._warm_pending.popleft()
            self._warm_running = 1
        try:
            if not self._run_warm_task(label, run, failures, "background warm-up") and failures == 0:
                with self._lock:
                    self._warm_pending.append((label, run, 1))
        finally:
            self._warm_running = 0
        if not self._warm_pending and self._warm_started is not None:
            skipped = len(self._warm_skipped)
            log.info("background warm-up done in %.1f s%s", time.monotonic() - self._warm_started,
                     f" ({skipped} shape(s) skipped)" if skipped else "")
            self._warm_started = None
            self._freeze_heap()

    # ---- background loop -------------------------------------------------------------------
    def start(self) -> "Engine":
        with self._lifecycle:
            if self._thread is None:
                self._stop.clear()
                self._accepting = True
                self._thread = threading.Thread(target=self._loop, name="preft-engine", daemon=True)
                self._thread.start()
        return self

    def shutdown(self, grace: float = 0.0, join_timeout: float = 5.0) -> None:
        """Stops accepting requests, lets in-flight ones run for up to `grace` seconds, then fails
        every request still live (HTTP 503) and stops the loop. Returns within about
        grace + join_timeout seconds even if a step is stuck (the stuck thread is abandoned).
        Idempotent and thread-safe: concurrent callers run one after the other, and a later one
        finds the loop stopped."""
        self._accepting = False
        with self._lifecycle:
            thread = self._thread
            end = time.monotonic() + max(0.0, grace)
            while thread is not None and thread.is_alive() and self.busy and time.monotonic() < end:
                time.sleep(0.02)
            self._stop.set()
            self._wake.set()
            if thread is not None:
                thread.join(timeout=join_timeout)
                if thread.is_alive():
                    log.error("engine step still running after shutdown timeout; abandoning it")
                self._thread = None
        for req in self.live_requests():
            self._terminate(req, error=EngineError("the server is shutting down", 503, "unavailable"))
        self._binding.release()
        if self._froze_heap:
            self._froze_heap = False
            thaw_heap()

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
