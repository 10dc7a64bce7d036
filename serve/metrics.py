"""Serving metrics with prometheus_client.

* `EngineMetrics`: what the engine counts from its own thread (plain ints and counters, a
  tokens/s window, two latency histograms); the engine owns it and knows nothing of HTTP.
* `ServerMetrics`: one `CollectorRegistry` per app (never the process-global one, so two apps in
  one process never mix): the HTTP layer's own counters, plus `EngineCollector`, which reads the
  engine, its KV block pool, scheduler and adapter registry when /metrics is scraped.

Vocabulary: a *decode row* is a row of the decode batch (one running sequence); an *adapter slot*
is a slot of the device adapter bank; a *KV block* is a block of the paged KV cache pool.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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


class LatencyHistogram:
    """A histogram with one writer (the engine thread, once per generated token): `observe` is a
    bisect and two additions, no lock; exported at scrape time as a prometheus histogram family
    (cumulative `le` buckets, `_count`, `_sum`), like prometheus_client's `Histogram`, whose locked
    observe cost the decode loop ~3 us per token."""

    def __init__(self, name: str, doc: str, buckets):
        self.name, self.doc, self.bounds = name, doc, tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)          # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: list[float]) -> None:
        """`observe` of each value (one decode call's rows: they share a few distinct gaps, the
        rows whose previous tokens came from the same call - usually one: one bucket search and
        a C-level count; else one bucket search per distinct value)."""
        if not values:
            return
        counts, bounds, first = self.counts, self.bounds, values[0]
        if values.count(first) == len(values):
            counts[bisect.bisect_left(bounds, first)] += len(values)
        else:
            for value, n in collections.Counter(values).items():
                counts[bisect.bisect_left(bounds, value)] += n
        self.sum += sum(values)

    def observe_n(self, value: float, n: int) -> None:
        """`observe(value)` n times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def collect(self):
        counts, total = list(self.counts), self.sum          # a snapshot (the writer may move on)
        cum = list(itertools.accumulate(counts))
        le = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        yield HistogramMetricFamily(self.name, self.doc, buckets=list(zip(le, cum)), sum_value=total)


class EngineMetrics:
    """Counters the engine updates from its thread (plain ints: single writer). The histograms are
    `LatencyHistogram`s; `EngineCollector` exports them."""

    def __init__(self):
        self.requests_submitted = 0
        self.requests_finished: collections.Counter = collections.Counter()   # by finish reason
        self.requests_failed: collections.Counter = collections.Counter()     # by error code
        self.step_failures: collections.Counter = collections.Counter()       # prefill / decode / other
        self._generated = 0
        self.prompt_tokens = 0
        self.by_mode: collections.Counter = collections.Counter()          # requests per serving mode
        self.tokens_per_s = RateWindow()
        self.ttft = LatencyHistogram("preft_time_to_first_token_seconds", "submit to first token", DEFAULT_BUCKETS)
        self.inter_token = LatencyHistogram("preft_inter_token_seconds", "time between a request's tokens",
                                            INTER_TOKEN_BUCKETS)

    @property
    def generated_tokens(self) -> int:
        return self._generated

    @generated_tokens.setter
    def generated_tokens(self, value: int) -> None:
        self.tokens_per_s.add(value - self._generated)
        self._generated = value


def _counter(name: str, doc: str, value=None, labels: tuple = (), samples=()):
    fam = CounterMetricFamily(name, doc, value, labels=labels or None)
    for values, v in samples:
        fam.add_metric(values, v)
    return fam


def _gauge(name: str, doc: str, value):
    return GaugeMetricFamily(name, doc, value)


class EngineCollector:
    """A prometheus_client custom collector: the engine's state, read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        eng = self.engine
        m, h, reg = eng.metrics, eng.health(), eng.registry
        st, occ, pool = reg.stats, reg.occupancy(), eng.pool.stats
        tiers = ("host", "device")
        yield _counter("preft_requests_submitted_total", "requests accepted by the engine", m.requests_submitted)
        yield _counter("preft_requests_finished_total", "requests finished, by finish reason", labels=("reason",),
                       samples=[((r,), n) for r, n in sorted(m.requests_finished.items())])
        yield _counter("preft_requests_failed_total", "requests failed after acceptance, by error code",
                       labels=("code",), samples=[((c,), n) for c, n in sorted(m.requests_failed.items())])
        yield _counter("preft_step_failures_total", "failed engine steps, by phase", labels=("phase",),
                       samples=[((p,), n) for p, n in sorted(m.step_failures.items())])
        yield _counter("preft_generated_tokens_total", "tokens generated", m.generated_tokens)
        yield _counter("preft_prompt_tokens_total", "prompt tokens prefilled", m.prompt_tokens)
        yield _gauge("preft_generation_tokens_per_second", "generated tokens/s over the last 10 s",
                     m.tokens_per_s.rate())
        yield _gauge("preft_queue_depth", "requests waiting to be admitted", h["queued"])
        yield _gauge("preft_queue_capacity", "max waiting requests before 429", h["max_queued"])
        yield _gauge("preft_running_requests", "requests holding a decode row", h["running"])
        yield _gauge("preft_decode_rows", "rows of the decode batch (sequences that can run at once)",
                     h["decode_rows"])
        yield _gauge("preft_adapters_loaded", "adapters loaded", len(reg.names()))
        yield _gauge("preft_adapters_draining", "adapters unloaded while in use, waiting for their requests to end",
                     occ["draining"])
        yield _gauge("preft_adapter_references", "adapter references held by running or queued requests",
                     occ["references"])
        yield _gauge("preft_engine_wedged", "1 when the engine loop is stuck or dead", int(h["wedged"]))
        yield _counter("preft_requests_by_mode_total", "requests accepted, by serving mode", labels=("mode",),
                       samples=[((k,), n) for k, n in sorted(m.by_mode.items())])
        yield _gauge("preft_kv_blocks", "KV blocks in the pool", h["kv_blocks"])
        yield _gauge("preft_kv_blocks_used", "KV blocks held by sequences", h["kv_blocks_used"])
        yield _counter("preft_prefix_cache_hits_total", "KV blocks served from the prefix cache", pool.hits)
        yield _counter("preft_prefix_cache_misses_total", "cacheable KV blocks computed", pool.misses)
        yield _counter("preft_prefix_cache_evictions_total", "cached KV blocks evicted", pool.evictions)
        yield _counter("preft_preemptions_total", "sequences preempted (recomputed later) when the KV pool ran out",
                       eng.scheduler.preemptions)
        yield _counter("preft_adapter_cache_hits_total", "adapter lookups by tier that found it resident",
                       labels=("tier",), samples=zip([(t,) for t in tiers], (st.host_hits, st.device_hits)))
        yield _counter("preft_adapter_cache_misses_total", "adapter lookups by tier that had to load it",
                       labels=("tier",), samples=zip([(t,) for t in tiers], (st.host_misses, st.device_misses)))
        yield _counter("preft_adapter_cache_evictions_total", "adapters evicted, by tier", labels=("tier",),
                       samples=zip([(t,) for t in tiers], (st.host_evictions, st.device_evictions)))
        yield _counter("preft_adapter_load_failures_total", "adapter loads that failed", st.load_failures)
        yield from st.load_seconds.collect()
        yield _gauge("preft_adapter_slots", "adapter slots of the device bank", occ["device_slots"])
        yield _gauge("preft_adapter_slots_pinned", "adapter slots pinned by running prefills (PreFT) or requests",
                     occ["device_pinned"])
        yield _gauge("preft_adapter_slots_resident", "adapter slots holding an adapter", occ["device_resident"])
        yield _gauge("preft_host_adapter_bytes", "host memory held by loaded adapters", occ["host_bytes"])
        yield from m.ttft.collect()
        yield from m.inter_token.collect()


class ServerMetrics:
    """The app's own registry: HTTP counters and the engine's collector."""

    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=False)
        self.responses = Counter("preft_http_responses", "HTTP responses by route and status code",
                                 ("path", "code"), registry=self.registry)
        self.disconnects = Counter("preft_client_disconnects", "requests cancelled because the client went away",
                                   registry=self.registry)
        self.adapter_loads = Counter("preft_adapter_loads", "run-time adapter loads, by outcome", ("outcome",),
                                     registry=self.registry)
        self.registry.register(EngineCollector(engine))

    def on_response(self, scope, status: int) -> None:
        """Counts one response (LimitsMiddleware's hook) under its route's path template."""
        route = scope.get("route")
        self.responses.labels(getattr(route, "path", "unmatched"), str(status)).inc()

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """(body, content type) for a scrape's Accept header: the Prometheus text format 0.0.4, or
        OpenMetrics when the scraper asks for it."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
