"""The async bridge between the engine thread and the event loop: no thread per waiting request.

The engine puts a request's events into an `AsyncSink` from its own thread; the sink hands them to
the event loop with `call_soon_threadsafe`. Handlers await them with a deadline and, while waiting,
watch for the client going away, cancelling the request (which frees its decode row, its KV
blocks and its adapter reference at the engine's next step).
"""
from __future__ import annotations

import asyncio
import time

from serve.errors import DeadlineExceededError

POLL_S = 0.1             # how often a waiting handler checks for a client disconnect
DEADLINE_MARGIN_S = 5.0  # the engine ends expired requests itself; this is the backstop


class ClientGone(Exception):
    """The client disconnected while its request was running (the request was cancelled)."""


class TaggedSink:
    """One of several requests feeding a shared AsyncSink: events arrive there as (tag, event)."""

    def __init__(self, shared: "AsyncSink", tag):
        self.shared, self.tag = shared, tag

    def put(self, event) -> None:          # called from the engine thread
        self.shared.put((self.tag, event))


class AsyncSink:
    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:          # called from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self, deadline: float | None, poll: float | None = None):
        """The next event; raises DeadlineExceededError past `deadline` (+ margin), asyncio.TimeoutError
        after `poll` seconds without one."""
        timeout = None if deadline is None else deadline + DEADLINE_MARGIN_S - time.monotonic()
        if timeout is not None and timeout <= 0:
            raise DeadlineExceededError("the request did not finish before its deadline")
        if poll is not None:
            timeout = poll if timeout is None else min(timeout, poll)
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            if deadline is not None and time.monotonic() > deadline + DEADLINE_MARGIN_S:
                raise DeadlineExceededError("the request did not finish before its deadline") from None
            raise


async def collect_many(engine, reqs, sink: AsyncSink, is_disconnected) -> list:
    """Awaits the Results (in order) of requests feeding one sink through TaggedSinks tagged
    0..len-1. A failure of one cancels the others and raises it; a client that disconnects
    (checked every POLL_S seconds, whether or not tokens are arriving) raises ClientGone, and
    every unfinished request is cancelled."""
    checked = time.monotonic()
    outs = [r.output() for r in reqs]
    results = [None] * len(reqs)
    left = len(reqs)
    deadline = max((r.deadline for r in reqs if r.deadline is not None), default=None)
    try:
        while left:
            try:
                tag, event = await sink.get(deadline, POLL_S)
                events = outs[tag].handle(event)
            except asyncio.TimeoutError:
                tag, events = None, []
            for kind, payload in events:
                if kind == "done":
                    results[tag] = payload
                    left -= 1
                elif kind == "error":
                    raise payload
            if time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if await is_disconnected():
                    raise ClientGone()
        return results
    finally:
        for r, out in zip(reqs, outs):
            if not out.done:
                engine.cancel(r)
