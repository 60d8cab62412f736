"""Prometheus metrics for `/metrics`: the only module that imports prometheus_client.

Sources: the engine's `StepStats` (one per step, on the engine thread), the `EngineSnapshot` it
publishes (queues, slots, cache counters; read when scraped, server/bridge.py), each API
call's timings (`RequestTimer`, on the event loop), and counters the server keeps itself
(admission and auth refusals, read at scrape time).

Hot paths stay cheap: per step and per token, values go into plain-Python `_Buckets` (a bisect
and two adds, no lock: one writer thread each) that become Prometheus families only when
scraped. prometheus_client's own (locked) metrics
are used for what happens once per API call.

Cardinality (RELIABILITY S12): every label value comes from a fixed set (tiers, step phases,
refusal reasons) or from the tenants configured in the API-keys file; anything else is folded
into "other". No request field (model, user, session id) ever becomes a label.

Speculative decoding: drafted / accepted tokens per draft source are read at scrape time from
any object with `num_draft_tokens` and `num_accepted_tokens` dicts keyed by source: the
engine's snapshot in the server (empty without speculation, so the series exist at zero), or
a `SpeculationStats` directly.
"""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ultrafast.request import ServiceTier

TIERS = tuple(t.api_name for t in ServiceTier)
STEP_PHASES = ("schedule", "execute", "sample", "update")
DRAFT_SOURCES = ("ngram", "prediction", "draft")  # engine/speculation.py's draft sources
REFUSAL_REASONS = (
    "queue_full",
    "slo_unattainable",
    "rate_limit_requests",
    "rate_limit_tokens",
    "missing_api_key",
    "invalid_api_key",
    "tenant_disabled",
    "priority_not_allowed",
    "scope_not_allowed",
    "other",
)
ANONYMOUS_TENANT = "anonymous"  # every call when the server runs without --api-keys
OTHER = "other"
GC_GENERATIONS = (0, 1, 2)


class EngineCounts(Protocol):
    """What a scrape reads of the engine: EngineSnapshot and EngineOccupancy both fit."""

    @property
    def num_waiting_by_tier(self) -> tuple[int, ...]: ...
    @property
    def num_running_by_tier(self) -> tuple[int, ...]: ...
    @property
    def num_kv_slots_running(self) -> int: ...
    @property
    def num_kv_slots_total(self) -> int: ...
    @property
    def num_prefix_queries(self) -> int: ...
    @property
    def num_prefix_query_tokens(self) -> int: ...
    @property
    def num_prefix_hit_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...


# Per-token gaps and step phases are sub-millisecond on a GPU: fine buckets around the 2 ms alert.
_FAST_BUCKETS_S = (
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)
_REQUEST_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024, 2048)


class ServerMetrics:
    def __init__(
        self,
        tenants: Iterable[str] = (),
        device_kind: str = "cpu",
        alert_priority_itl_p99_s: float = 0.0,
    ):
        """tenants: the configured tenant names (the only tenant label values besides
        "anonymous" and "other"). alert_priority_itl_p99_s > 0 exports the per-token p99
        threshold the shipped alert compares against; 0 leaves the alert without a threshold
        (it never fires)."""
        self.registry = CollectorRegistry()
        self.tenants = frozenset(tenants) | {ANONYMOUS_TENANT}
        reg = self.registry

        def histogram(name: str, doc: str, labels: tuple, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.ttft_s = histogram(
            "ultrafast_time_to_first_token_seconds",
            "Arrival to first output token, per API call",
            ("tier",),
            _REQUEST_BUCKETS_S,
        )
        self.itl_s = {tier: _Buckets(_FAST_BUCKETS_S) for tier in TIERS}  # per token
        self.e2e_s = histogram(
            "ultrafast_e2e_request_latency_seconds",
            "Arrival to last token, per API call",
            ("tier",),
            _REQUEST_BUCKETS_S,
        )
        self.queue_wait_s = histogram(
            "ultrafast_queue_wait_seconds",
            "Arrival to first KV slot, per API call",
            ("tier",),
            _REQUEST_BUCKETS_S,
        )
        # per step, written by the engine thread only
        self.step_phase_s = {phase: _Buckets(_FAST_BUCKETS_S) for phase in STEP_PHASES}
        self.batch_seqs = _Buckets(_BATCH_BUCKETS)
        self.batch_tokens = _Buckets(_BATCH_BUCKETS)
        self.busy_s = 0.0
        # Python's cyclic GC stops every thread while it runs (watch_gc); one writer at a time:
        # CPython never runs two collections at once
        self.gc_pause_s = {str(gen): _Buckets(_FAST_BUCKETS_S) for gen in GC_GENERATIONS}
        self._gc_started_s = 0.0
        self._occupancy_source: Callable[[], EngineCounts] | None = None
        self.prompt_tokens = Counter(
            "ultrafast_prompt_tokens", "Prompt tokens, per tenant", ("tenant",), registry=reg
        )
        self.generation_tokens = Counter(
            "ultrafast_generation_tokens", "Output tokens, per tenant", ("tenant",), registry=reg
        )
        self.guard_cuts = Counter(
            "ultrafast_guard_cuts",
            "Choices cut by the output guard (finish_reason content_filter)",
            registry=reg,
        )
        info = Gauge(
            "ultrafast_engine_info",
            "Constant 1; the device the engine runs on",
            ("device_kind",),
            registry=reg,
        )
        info.labels(device_kind if device_kind in ("cpu", "gpu") else OTHER).set(1)
        if alert_priority_itl_p99_s > 0:
            Gauge(
                "ultrafast_alert_priority_itl_p99_threshold_seconds",
                "Threshold of the priority per-token p99 alert (deploy/prometheus/alerts.yml)",
                registry=reg,
            ).set(alert_priority_itl_p99_s)
        self._refusal_sources: list[Callable[[], dict]] = []
        self._in_flight_source: Callable[[], dict] | None = None
        self._speculation_source: Callable[[], object] | None = None
        reg.register(_ScrapeTimeCollector(self))
        for tier in TIERS:  # every series exists from the start, so rates and alerts work
            for family in (self.ttft_s, self.e2e_s, self.queue_wait_s):
                family.labels(tier)
        for tenant in self.tenants | {OTHER}:
            self.prompt_tokens.labels(tenant)
            self.generation_tokens.labels(tenant)

    # ---- label values ------------------------------------------------------------------------

    def tenant_label(self, tenant: str) -> str:
        if not tenant:
            return ANONYMOUS_TENANT
        return tenant if tenant in self.tenants else OTHER

    # ---- sources -----------------------------------------------------------------------------

    def add_refusal_source(self, read: Callable[[], dict]) -> None:
        """A reason -> count dict read at scrape time (admission, auth)."""
        self._refusal_sources.append(read)

    def set_in_flight_source(self, read: Callable[[], dict]) -> None:
        """tier name -> admitted API calls, read at scrape time."""
        self._in_flight_source = read

    def set_speculation_source(self, read: Callable[[], object]) -> None:
        """Returns cumulative draft counters per source (the engine snapshot), or None."""
        self._speculation_source = read

    def set_occupancy_source(self, read: Callable[[], EngineCounts]) -> None:
        """Returns the engine's latest EngineSnapshot (or EngineOccupancy), at scrape time."""
        self._occupancy_source = read

    def on_step(self, stats) -> None:
        """One engine step's StepStats (engine thread: keep it cheap)."""
        if stats.num_seqs:
            phases = (
                stats.schedule_time_s,
                stats.execute_time_s,
                stats.sample_time_s,
                stats.update_time_s,
            )
            for phase, seconds in zip(STEP_PHASES, phases):
                self.step_phase_s[phase].observe(seconds)
            self.busy_s += sum(phases)
            self.batch_seqs.observe(stats.num_seqs)
            self.batch_tokens.observe(stats.num_tokens)

    def watch_gc(self) -> Callable[[], None]:
        """Time every collection of Python's cyclic garbage collector, on any thread, into
        ultrafast_gc_pause_seconds: a pause holds the GIL, so it lands on whichever token was
        due. Returns the function that stops watching."""

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_started_s = time.perf_counter()
            else:
                pause = time.perf_counter() - self._gc_started_s
                self.gc_pause_s[str(info["generation"])].observe(pause)

        gc.callbacks.append(on_gc)
        return lambda: gc.callbacks.remove(on_gc)

    def request_timer(self, tier: ServiceTier, tenant: str, arrival_s: float) -> RequestTimer:
        return RequestTimer(self, tier.api_name, self.tenant_label(tenant), arrival_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Timings of one API call (all its choices), observed as outputs reach the HTTP layer."""

    def __init__(self, metrics: ServerMetrics, tier: str, tenant: str, arrival_s: float):
        self.metrics = metrics
        self.tier = tier
        self.tenant = tenant
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None
        self._last_token_s: dict[int, float] = {}  # choice -> when its last token arrived
        self._done = False

    def output(
        self, choice: int, num_new_tokens: int, queue_time_s: float, now_s: float | None = None
    ) -> None:
        if not num_new_tokens:
            return
        now_s = time.monotonic() if now_s is None else now_s
        m = self.metrics
        if self.first_token_s is None:
            self.first_token_s = now_s
            m.ttft_s.labels(self.tier).observe(now_s - self.arrival_s)
            m.queue_wait_s.labels(self.tier).observe(queue_time_s)
        last = self._last_token_s.get(choice)
        if last is not None:  # k tokens in one output (speculative): k gaps of gap/k each
            gap_s = (now_s - last) / num_new_tokens
            m.itl_s[self.tier].observe(gap_s, num_new_tokens)
        self._last_token_s[choice] = now_s

    def finish(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Called once when the call ends (done, stopped, aborted or failed)."""
        if self._done:
            return
        self._done = True
        m = self.metrics
        if self.first_token_s is not None:
            m.e2e_s.labels(self.tier).observe(max(self._last_token_s.values()) - self.arrival_s)
        m.prompt_tokens.labels(self.tenant).inc(num_prompt_tokens)
        m.generation_tokens.labels(self.tenant).inc(num_output_tokens)


class _ScrapeTimeCollector:
    """Series computed when scraped: prefix-cache counts, refusals, admitted calls per tier."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def describe(self):
        return []  # unchecked collector: its families vary with configuration

    def collect(self):
        m = self.metrics
        occ = m._occupancy_source() if m._occupancy_source else None
        yield from self._engine_families(m, occ)
        queries, query_tokens, hit_tokens = (
            (0, 0, 0)
            if occ is None
            else (occ.num_prefix_queries, occ.num_prefix_query_tokens, occ.num_prefix_hit_tokens)
        )
        yield _counter("ultrafast_prefix_cache_queries", "Prefix-cache lookups", queries)
        yield _counter(
            "ultrafast_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            query_tokens,
        )
        yield _counter(
            "ultrafast_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            hit_tokens,
        )
        yield _counter(
            "ultrafast_preemptions",
            "Running requests preempted for a higher tier "
            "(they resume by recomputing, nothing lost)",
            occ.num_preemptions if occ else 0,
        )
        refused = CounterMetricFamily(
            "ultrafast_admissions_refused", "API calls refused, by reason", labels=("reason",)
        )
        counts = {reason: 0 for reason in REFUSAL_REASONS}
        for read in m._refusal_sources:
            for reason, n in read().items():
                key = reason if reason in counts else OTHER
                counts[key] += n
        for reason, n in counts.items():
            refused.add_metric((reason,), n)
        yield refused
        stats = m._speculation_source() if m._speculation_source else None
        for name, attr, doc in (
            ("ultrafast_spec_draft_tokens", "num_draft_tokens", "Draft tokens proposed"),
            (
                "ultrafast_spec_accepted_tokens",
                "num_accepted_tokens",
                "Draft tokens accepted by the target model",
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=("source",))
            counts = {source: 0 for source in DRAFT_SOURCES + (OTHER,)}
            for source, n in dict(getattr(stats, attr, None) or {}).items():  # copy: engine thread
                counts[source if source in counts else OTHER] += n
            for source, n in counts.items():
                family.add_metric((source,), n)
            yield family
        in_flight = GaugeMetricFamily(
            "ultrafast_admitted_requests", "API calls admitted and not finished", labels=("tier",)
        )
        current = m._in_flight_source() if m._in_flight_source else {}
        for tier in TIERS:
            in_flight.add_metric((tier,), current.get(tier, 0))
        yield in_flight

    @staticmethod
    def _engine_families(m: ServerMetrics, occ: EngineCounts | None):
        yield _histogram(
            "ultrafast_inter_token_latency_seconds",
            "Gap between consecutive output tokens of one choice",
            "tier",
            m.itl_s,
        )
        yield _histogram(
            "ultrafast_step_phase_seconds", "Engine step time by phase", "phase", m.step_phase_s
        )
        yield _histogram(
            "ultrafast_batch_size_seqs", "Sequences per engine step", None, {None: m.batch_seqs}
        )
        yield _histogram(
            "ultrafast_batch_size_tokens", "Tokens per engine step", None, {None: m.batch_tokens}
        )
        yield _histogram(
            "ultrafast_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, by generation",
            "generation",
            m.gc_pause_s,
        )
        yield _counter(
            "ultrafast_engine_busy_seconds",
            "Engine time spent in steps (rate = utilization)",
            m.busy_s,
        )
        for name, doc, attr in (
            ("ultrafast_queue_depth", "Requests waiting for a KV slot", "num_waiting_by_tier"),
            ("ultrafast_running_requests", "Requests holding a KV slot", "num_running_by_tier"),
        ):
            family = GaugeMetricFamily(name, doc, labels=("tier",))
            values = getattr(occ, attr, None) or (0,) * len(TIERS)
            for tier, n in zip(TIERS, values):
                family.add_metric((tier,), n)
            yield family
        yield GaugeMetricFamily(
            "ultrafast_kv_slots_running",
            "KV slots owned by a running request",
            value=occ.num_kv_slots_running if occ else 0,
        )
        yield GaugeMetricFamily(
            "ultrafast_kv_slots_total", "KV slots", value=occ.num_kv_slots_total if occ else 0
        )


class _Buckets:
    """A histogram's counts without locks: one writer thread, read (copied) at scrape time."""

    def __init__(self, upper_bounds: tuple):
        self.upper_bounds = upper_bounds
        self.counts = [0] * (len(upper_bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.upper_bounds, value)] += times
        self.sum += value * times

    def cumulative(self) -> tuple[list, float]:
        counts, total, running = list(self.counts), self.sum, 0
        buckets = []
        for bound, n in zip([*map(str, self.upper_bounds), "+Inf"], counts):
            running += n
            buckets.append((bound, running))
        return buckets, total


def _histogram(name: str, doc: str, label: str | None, by_value: dict) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=(label,) if label else ())
    for value, hist in by_value.items():
        buckets, total = hist.cumulative()
        family.add_metric((value,) if label else (), buckets, total)
    return family


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def exported_metric_names(metrics: ServerMetrics) -> set[str]:
    """Every sample name the registry exposes (`_bucket`, `_sum`, `_count`, `_total`, ...)."""
    return {sample.name for family in metrics.registry.collect() for sample in family.samples}
