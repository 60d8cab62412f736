"""Prometheus series of the tiered KV cache (kvcache/), computed at scrape time.

L1 = the KV slots, L2 = host memory, L3 = disk and/or Redis. A tier that failed (full disk,
Redis outage) shows in `ultrafast_kv_tier_errors` and `ultrafast_kv_tier_degraded`; its
turns recompute, nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ultrafast.kvcache.manager import REFUSAL_LABELS, RESTORE_LATENCY_BUCKETS_S, KVCacheSnapshot


class KVCacheCollector:
    def __init__(self, read: Callable[[], KVCacheSnapshot | None]):
        self.read = read

    def describe(self):
        return []  # unchecked: the tiers vary with configuration

    def collect(self):
        snap = self.read()
        if snap is None:
            return
        for name, doc, values in (
            (
                "ultrafast_kv_tier_hit_tokens",
                "Prompt tokens whose KV came from a tier (L1 slots, L2 host, L3 disk/Redis)",
                snap.hit_tokens,
            ),
            (
                "ultrafast_kv_tier_evictions",
                "KV dropped from a tier (L1: cached slots written back before reuse)",
                snap.evictions,
            ),
            (
                "ultrafast_kv_tier_errors",
                "Failed tier reads/writes (full disk, Redis outage): those turns recompute",
                snap.errors,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=("tier",))
            for tier, n in values.items():
                family.add_metric((tier,), n)
            yield family
        for name, doc, gauge_values in (
            ("ultrafast_kv_tier_bytes", "Bytes of KV held by a tier", snap.bytes_held),
            ("ultrafast_kv_tier_budget_bytes", "Hard byte limit of a tier", snap.budget_bytes),
            (
                "ultrafast_kv_tier_degraded",
                "1 while a tier is failing and skipped (turns recompute)",
                {k: int(v) for k, v in snap.degraded.items()},
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=("tier",))
            for tier, n in gauge_values.items():
                gauge.add_metric((tier,), n)
            yield gauge
        yield CounterMetricFamily(
            "ultrafast_kv_saved_bytes", "KV bytes exported from slots", value=snap.bytes_saved
        )
        yield CounterMetricFamily(
            "ultrafast_kv_restored_bytes", "KV bytes imported into slots", value=snap.bytes_restored
        )
        refused = CounterMetricFamily(
            "ultrafast_kv_blobs_refused",
            "Saved KV refused (corrupt, truncated, another model/tenant): the turn recomputed",
            labels=("reason",),
        )
        for reason in (*REFUSAL_LABELS, "other"):
            refused.add_metric((reason,), snap.refusals.get(reason, 0))
        yield refused
        for name, doc, value in (
            (
                "ultrafast_kv_restores_skipped",
                "Restores skipped as slower than recomputing",
                snap.num_skipped_slower,
            ),
            ("ultrafast_kv_fetch_waits", "Requests held for an L3 read", snap.num_fetch_waits),
            (
                "ultrafast_kv_fetch_timeouts",
                "L3 reads that took too long (the request recomputed)",
                snap.num_fetch_timeouts,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        buckets, running = [], 0
        for bound, n in zip(
            [*map(str, RESTORE_LATENCY_BUCKETS_S), "+Inf"], snap.restore_latency_buckets
        ):
            running += n
            buckets.append((bound, running))
        latency = HistogramMetricFamily(
            "ultrafast_kv_restore_seconds", "Time to import a saved KV prefix into a slot"
        )
        latency.add_metric((), buckets, snap.restore_latency_sum_s)
        yield latency
