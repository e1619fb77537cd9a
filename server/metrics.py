"""Prometheus metrics of the serving layer, on an explicit ``CollectorRegistry``.

Nothing here is module-global: the runtime creates one ``ServerMetrics`` and passes it to the
service and the app, so two servers in one process (tests) never share counters.

Cost matters on the hot path (512 streams x tens of tokens/s): counters are bumped once per
request, and the two per-write metrics (the output-token counter and the inter-token histogram)
are lock-free loop-thread objects (``LoopCounter``, ``LoopHistogram``) observed once per *write*
to the client, not per token.
Under load one write carries several tokens, so the histogram reports the gap between writes a
client actually sees (which is the delay that matters for a streaming client).

Rank and cache state are read at scrape time by ``StateCollector`` from a snapshot callable, so
the hot path never updates gauges.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300)
_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1, 2, 5)
_QUEUE_BUCKETS_S = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


@dataclass(slots=True)
class StateSnapshot:
    """What the runtime reports at scrape time."""

    rank_group_state: str  # GroupState value, or "loading" before the group exists
    rank_stats: list[dict[str, float]] = field(default_factory=list)  # per rank, EngineStats fields
    cache: dict[str, float] = field(default_factory=dict)  # flat cache gauges (blocks, slots, ...)


RANK_STATES = ("loading", "starting", "ready", "restarting", "stopped", "failed")


class StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], StateSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # The per-rank families depend on the live state; nothing to declare up front.
        return []

    def collect(self) -> Iterable[GaugeMetricFamily]:
        snap = self._snapshot()
        state = GaugeMetricFamily(
            "deepinfer_rank_group_state", "1 for the rank group's current state", labels=["state"]
        )
        for name in RANK_STATES:
            state.add_metric([name], 1.0 if snap.rank_group_state == name else 0.0)
        yield state
        per_rank: dict[str, GaugeMetricFamily] = {}
        for rank, stats in enumerate(snap.rank_stats):
            for key, value in stats.items():
                family = per_rank.get(key)
                if family is None:
                    family = GaugeMetricFamily(f"deepinfer_rank_{key}", f"EngineStats.{key} per rank",
                                               labels=["rank"])
                    per_rank[key] = family
                family.add_metric([str(rank)], float(value))
        yield from per_rank.values()
        for key, value in snap.cache.items():
            yield GaugeMetricFamily(f"deepinfer_cache_{key}", f"cache state: {key}", value=float(value))


class LoopHistogram:
    """A histogram for the per-write hot path: a ``bisect`` and two additions per observation.

    prometheus-client's ``Histogram.observe`` takes a lock and walks the buckets in Python
    (several microseconds); this one is updated only from the event loop's thread, and read at
    scrape time (``/metrics`` is served on the same loop), so it needs no lock.
    """

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc = name, doc
        self.bounds = list(bounds)
        self.counts = [0] * (len(bounds) + 1)  # last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=self.sum)


class LoopCounter:
    """A counter for the hot path (same threading rule as ``LoopHistogram``)."""

    __slots__ = ("name", "doc", "value")

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc, self.value = name, doc, 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.doc, value=self.value)


class _LoopCollector(Collector):
    def __init__(self, metrics: list[LoopHistogram | LoopCounter]) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[HistogramMetricFamily | CounterMetricFamily]:
        return [m.family() for m in self._metrics]

    def collect(self) -> Iterable[HistogramMetricFamily | CounterMetricFamily]:
        return [m.family() for m in self._metrics]


class ServerMetrics:
    """Counters and histograms the service and the app update."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("deepinfer_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.in_flight = Gauge("deepinfer_requests_in_flight", "Requests being served", registry=r)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        # Bumped once per streamed batch (live throughput): the cheap loop-thread counter.
        self.output_tokens = LoopCounter("deepinfer_output_tokens", "Generated tokens streamed or returned")
        self.cached_tokens = Counter("deepinfer_cached_tokens", "Prompt tokens served from cache",
                                     ["tier"], registry=r)
        self.finished = Counter("deepinfer_requests_finished", "Engine requests by finish reason",
                                ["reason"], registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds",
                              "Arrival to first streamed token", ["api"], buckets=_TTFT_BUCKETS_S,
                              registry=r)
        self.inter_token = LoopHistogram("deepinfer_inter_token_seconds",
                                         "Gap between consecutive token writes to one client", _GAP_BUCKETS_S)
        r.register(_LoopCollector([self.output_tokens, self.inter_token]))
        self.queue_time = Histogram("deepinfer_queue_time_seconds", "Admission wait before submit",
                                    buckets=_QUEUE_BUCKETS_S, registry=r)
        self.request_seconds = Histogram("deepinfer_request_duration_seconds", "Whole request",
                                         ["api"], buckets=_TTFT_BUCKETS_S, registry=r)
        self.disconnects = Counter("deepinfer_client_disconnects",
                                   "Requests (streaming or not) the client dropped",
                                   registry=r)
        self.timeouts = Counter("deepinfer_request_timeouts", "Requests cut by request_timeout_secs",
                                registry=r)
        self._state: StateCollector | None = None

    def attach_state(self, snapshot: Callable[[], StateSnapshot]) -> None:
        """Register the scrape-time collector (once)."""
        assert self._state is None, "state collector already attached"
        self._state = StateCollector(snapshot)
        self.registry.register(self._state)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
