"""Prometheus series of the model residency cache, read from the registry at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ultrafast.server.residency.registry import LOAD_BUCKETS_S

MODEL_METRIC_NAMES = (
    "ultrafast_model_loads",
    "ultrafast_model_evictions",
    "ultrafast_model_preloads",
    "ultrafast_model_preload_hits",
    "ultrafast_model_load_failures",
    "ultrafast_model_cold_calls",
    "ultrafast_model_load_seconds",
    "ultrafast_model_resident",
    "ultrafast_model_resident_bytes",
)


class ResidencyCollector:
    def __init__(self, registry):
        self.registry = registry

    def describe(self):
        return []  # unchecked: collected at scrape time

    def collect(self):
        r = self.registry
        loads = CounterMetricFamily(
            "ultrafast_model_loads", "Model loads, by reason", labels=("reason",)
        )
        for reason, n in r.loads.items():
            loads.add_metric((reason,), n)
        yield loads
        evictions = CounterMetricFamily(
            "ultrafast_model_evictions", "Model unloads, by reason", labels=("reason",)
        )
        for reason, n in r.evictions.items():
            evictions.add_metric((reason,), n)
        yield evictions
        yield CounterMetricFamily(
            "ultrafast_model_preloads",
            "Models loaded ahead of their predicted call",
            value=r.loads["preload"],
        )
        yield CounterMetricFamily(
            "ultrafast_model_preload_hits",
            "Calls served by a model a preload brought in",
            value=r.preload_hits,
        )
        yield CounterMetricFamily(
            "ultrafast_model_load_failures", "Model loads that failed", value=r.load_failures
        )
        yield CounterMetricFamily(
            "ultrafast_model_cold_calls",
            "Calls that found their model not loaded and waited for it",
            value=r.cold_calls,
        )
        yield _load_histogram(r.load_bucket_counts, r.load_seconds_sum)
        resident = GaugeMetricFamily(
            "ultrafast_model_resident", "1 while the model is loaded", labels=("model",)
        )
        for e in r.entries.values():
            resident.add_metric((e.name,), 1 if e.status == "loaded" else 0)
        yield resident
        yield GaugeMetricFamily(
            "ultrafast_model_resident_bytes",
            "Bytes charged to the resident budget (loaded and loading models)",
            value=r.used_bytes(),
        )


def _load_histogram(counts: list[int], total_s: float) -> HistogramMetricFamily:
    """Every load's time, cumulative buckets as Prometheus wants them."""
    buckets, running = [], 0
    for bound, n in zip([*map(str, LOAD_BUCKETS_S), "+Inf"], counts, strict=True):
        running += n
        buckets.append((bound, running))
    return HistogramMetricFamily(
        "ultrafast_model_load_seconds",
        "Model load time (engine build and warm-up)",
        buckets=buckets,
        sum_value=total_s,
    )
