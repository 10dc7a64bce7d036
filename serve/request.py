"""A request's life in the engine: queued -> running -> exactly one terminal event.

The engine puts token-level events into `Request.events` (a `queue.SimpleQueue` by default: its put
takes no Python-level lock, the engine thread's hot path; or any object with `.put`, e.g. the
server's asyncio bridge):

    ("tokens", [token_ids])          zero or more, as tokens are produced
    ("logprobs", [entries])          before each "tokens" event when `sampling.logprobs` is set:
                                     per token (logprob, [(id, logprob)] * k)
    ("prompt_logprobs", entries)     once, when `sampling.prompt_logprobs` is set: per prompt token
                                     (entry 0 is None: nothing predicts the first token)
    ("finished", reason)             "stop" (stop token), "length" or "cancelled"
    ("error", EngineError)           failed: engine fault, deadline, shutdown

The consumer turns them into text with `serve.output.RequestOutput` (stop strings, UTF-8 hold-back;
it builds the `Result`, which lives there so the imports go one way: request -> output);
`wait()` and `stream()` do that for blocking callers and yield ("delta", (ids, text)) then
("done", Result).

`Request.settle()` is the single place a request becomes terminal; it returns True exactly once, so
whoever wins (the engine thread, a shutdown, a deadline sweep) releases the adapter reference and
emits the terminal event, and every other path sees `finished` and leaves it alone.
"""
from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Sequence

from preft_jax.sampling import SamplingParams
from serve.errors import DeadlineExceededError, EngineError
from serve.output import RequestOutput, Result   # noqa: F401 - Result: a request's outcome, re-exported

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One submission for `Engine.submit_many` / `Engine.generate` (tuples (prompt_ids, adapter,
    sampling[, stop]) work too): `n` completions of one prompt (OpenAI `n`); `events`: one sink per
    completion (default: each request's own queue); `request_id` (default: a new id; with n > 1 the
    completions are `<id>-<i>`); `timeout`: seconds (default `EngineConfig.request_timeout`);
    `group`: the client request it belongs to, the unit the scheduler shares steps between (default:
    this submission)."""
    prompt_ids: Sequence[int]
    adapter: str | None = None
    sampling: SamplingParams = SamplingParams()
    stop: Sequence[str] = ()
    n: int = 1
    events: Sequence | None = None
    request_id: str | None = None
    timeout: float | None = None
    group: str | None = None


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    adapter: str | None
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    adapter_ref: object = None             # serve.registry.AdapterRef (None: the base model)
    deadline: float | None = None          # time.monotonic() by which the request must end
    group: str | None = None               # the client request it belongs to (its prompts x n): the
                                           # scheduler shares steps fairly between groups
    events: object = dataclasses.field(default_factory=queue.SimpleQueue)   # anything with .put(event)
    tokens: list[int] = dataclasses.field(default_factory=list)    # generated ids (engine side)
    stop_token_id: int | None = None       # the stop token that ended it (engine side; not in `tokens`)
    cancelled: bool = False
    result: Result | None = None
    error: EngineError | None = None
    submitted_at: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    key_data: object = None                # uint32 [2] (an array or two ints): this request's sampling key (set by the engine)
    tokenizer: object = dataclasses.field(default=None, repr=False)      # for wait() / stream()
    on_stop: object = dataclasses.field(default=None, repr=False)        # cancels in the engine
    _output: object = dataclasses.field(default=None, repr=False)
    finished: bool = False                 # terminal (set once, by `settle`; a plain attribute: the
                                           # engine reads it per row per decode call)
    _settle_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def settle(self) -> bool:
        """Marks the request terminal; True for the one caller that does it, False for every other."""
        with self._settle_lock:
            if self.finished:
                return False
            self.finished = True
            return True

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.monotonic() if now is None else now) > self.deadline

    def emit(self, event) -> None:
        """Puts an event into the sink; a broken sink (closed event loop, ...) never reaches the engine."""
        try:
            self.events.put(event)
        except Exception:   # noqa: BLE001 - the consumer is gone; nothing to tell it
            pass

    # ---- consumer side (blocking; the server uses its own async bridge instead) ----------------
    def _timeout(self, timeout: float | None) -> float | None:
        if timeout is not None or self.deadline is None:
            return timeout
        return max(0.0, self.deadline - time.monotonic()) + 5.0

    def output(self):
        if self._output is None:
            self._output = RequestOutput(self, self.tokenizer, self.on_stop)
        return self._output

    def _public_events(self, timeout: float | None):
        out = self.output()
        while True:
            try:
                event = self.events.get(timeout=self._timeout(timeout))
            except queue.Empty:
                raise DeadlineExceededError(f"request {self.request_id} did not finish in time") from None
            for kind, payload in out.handle(event):
                if kind == "error":
                    raise payload
                yield kind, payload
                if kind == "done":
                    return

    def wait(self, timeout: float | None = None) -> Result:
        """Blocks until finished and returns the result (events: a queue.Queue or SimpleQueue). Raises EngineError
        if the request failed, DeadlineExceededError if nothing arrives in time (default: the
        request's deadline plus a margin; None without one)."""
        for kind, payload in self._public_events(timeout):
            if kind == "done":
                return payload
        return self.result

    def stream(self, timeout: float | None = None):
        """Yields ("delta", (token_ids, text)) events and finally ("done", Result); timeout per event."""
        yield from self._public_events(timeout)
