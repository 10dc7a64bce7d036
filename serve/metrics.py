"""Prometheus text-format metrics (no dependency): counters, gauges and histograms.

`EngineMetrics` is what the engine counts; the server adds per-request HTTP counters and renders
everything with `render()` at GET /metrics.
"""
from __future__ import annotations

import bisect
import collections
import threading
import time

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=DEFAULT_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out, cum = [], 0
        with self._lock:
            for le, c in zip(self.buckets + (float("inf"),), self.counts):
                cum += c
                le_s = "+Inf" if le == float("inf") else repr(le)
                out.append(f'{name}_bucket{{{labels}{sep}le="{le_s}"}} {cum}')
            out.append(f"{name}_sum{{{labels}}} {self.sum}" if labels else f"{name}_sum {self.sum}")
            out.append(f"{name}_count{{{labels}}} {self.count}" if labels else f"{name}_count {self.count}")
        return out


class RateWindow:
    """Events per second over the last `window` seconds (e.g. generated tokens/s)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._events.append((now, n))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window:
            self._events.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._events) / self.window


class EngineMetrics:
    """Counters the engine updates from its thread (plain ints: single writer)."""

    def __init__(self):
        self.requests_submitted = 0
        self.requests_finished: collections.Counter = collections.Counter()   # by finish reason
        self.requests_failed: collections.Counter = collections.Counter()     # by error code
        self.step_failures: collections.Counter = collections.Counter()       # prefill / decode / other
        self._generated = 0
        self.prompt_tokens = 0
        self.by_mode: collections.Counter = collections.Counter()          # requests per serving mode
        self.tokens_per_s = RateWindow()
        self.ttft = Histogram()
        self.inter_token = Histogram((0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))

    @property
    def generated_tokens(self) -> int:
        return self._generated

    @generated_tokens.setter
    def generated_tokens(self, value: int) -> None:
        self.tokens_per_s.add(value - self._generated)
        self._generated = value


def _label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(families: list[tuple[str, str, str, list]]) -> str:
    """families: (name, type, help, samples); a sample is (labels dict, value) or a Histogram
    (with an optional labels dict as (labels, Histogram))."""
    out = []
    for name, kind, help_text, samples in families:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(labels.items()))
            if isinstance(value, Histogram):
                out.extend(value.lines(name, lab))
            else:
                out.append(f"{name}{{{lab}}} {float(value)}" if lab else f"{name} {float(value)}")
    return "\n".join(out) + "\n"
