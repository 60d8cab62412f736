"""server/metrics.py: engine step stats and request timings become the documented series, and label
values stay in their fixed sets whatever the requests carry (docs/RELIABILITY.md S12)."""

from prometheus_client.parser import text_string_to_metric_families

from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.executors.fake_exec import FakeExecutor
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.server.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics, name, **labels):
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_engine_steps_feed_queue_depth_kv_prefix_and_step_phases():
    metrics = ServerMetrics()
    assert value(metrics, "ultrafast_kv_slots_total") == 0  # no engine yet: zeros, no error
    engine = EngineCore(
        FakeExecutor(num_slots=2), SchedulerConfig(max_num_seqs=2, max_model_len=256)
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = list(range(1, 40))
    for i, tier in enumerate([ServiceTier.PRIORITY, ServiceTier.DEFAULT, ServiceTier.DEFAULT]):
        engine.add_request(Request(f"r{i}", prompt, params, tier=tier))
    metrics.set_occupancy_source(engine.occupancy)
    engine.step()
    metrics.on_step(engine.last_stats)
    assert value(metrics, "ultrafast_running_requests", tier="priority") == 1
    assert value(metrics, "ultrafast_running_requests", tier="default") == 1
    assert value(metrics, "ultrafast_queue_depth", tier="default") == 1
    assert value(metrics, "ultrafast_kv_slots_running") == 2
    assert value(metrics, "ultrafast_kv_slots_total") == 2
    num_steps = 1
    while engine.has_work():
        engine.step()
        metrics.on_step(engine.last_stats)
        num_steps += 1
    assert value(metrics, "ultrafast_queue_depth", tier="default") == 0
    assert value(metrics, "ultrafast_kv_slots_running") == 0
    # the third request reuses the first two's cached prompt blocks
    assert value(metrics, "ultrafast_prefix_cache_queries_total") == 3
    assert value(metrics, "ultrafast_prefix_cache_hit_tokens_total") >= 32
    assert value(metrics, "ultrafast_prefix_cache_query_tokens_total") == 3 * 38
    steps = value(metrics, "ultrafast_step_phase_seconds_count", phase="execute")
    assert 0 < steps <= num_steps
    assert value(metrics, "ultrafast_batch_size_seqs_sum") >= 3
    assert value(metrics, "ultrafast_engine_busy_seconds_total") > 0


def test_speculative_counts_are_read_from_the_engine_spec_stats():
    metrics = ServerMetrics()
    stats = None
    metrics.set_speculation_source(lambda: stats)
    # before speculative decoding (or with it off): the series exist at zero
    assert value(metrics, "ultrafast_spec_draft_tokens_total", source="draft") == 0

    class SpeculationStats:  # the shape of engine/speculation.py's cumulative counters
        num_draft_tokens = {"draft": 40, "ngram": 10, "weird": 2}
        num_accepted_tokens = {"draft": 30, "ngram": 4}

    stats = SpeculationStats()
    assert value(metrics, "ultrafast_spec_draft_tokens_total", source="draft") == 40
    assert value(metrics, "ultrafast_spec_accepted_tokens_total", source="draft") == 30
    assert value(metrics, "ultrafast_spec_accepted_tokens_total", source="ngram") == 4
    assert value(metrics, "ultrafast_spec_draft_tokens_total", source="other") == 2
    assert value(metrics, "ultrafast_spec_accepted_tokens_total", source="prediction") == 0


def test_request_timer_ttft_itl_e2e_and_tenant_tokens():
    metrics = ServerMetrics(tenants=["acme"])
    timer = metrics.request_timer(ServiceTier.PRIORITY, "acme", arrival_s=0.5)
    timer.output(0, 1, queue_time_s=0.01, now_s=0.6)
    timer.output(0, 1, queue_time_s=0.01, now_s=0.61)
    timer.output(0, 2, queue_time_s=0.01, now_s=0.615)  # two tokens at once: two 2.5 ms gaps
    timer.finish(num_prompt_tokens=7, num_output_tokens=4)
    timer.finish(num_prompt_tokens=7, num_output_tokens=4)  # idempotent
    assert value(metrics, "ultrafast_time_to_first_token_seconds_count", tier="priority") == 1
    assert (
        abs(value(metrics, "ultrafast_time_to_first_token_seconds_sum", tier="priority") - 0.1)
        < 1e-9
    )
    assert value(metrics, "ultrafast_inter_token_latency_seconds_count", tier="priority") == 3
    assert (
        value(metrics, "ultrafast_inter_token_latency_seconds_bucket", tier="priority", le="0.003")
        == 2
    )  # 2.5 ms twice; the 10 ms gap is above
    assert (
        abs(value(metrics, "ultrafast_e2e_request_latency_seconds_sum", tier="priority") - 0.115)
        < 1e-9
    )
    assert value(metrics, "ultrafast_prompt_tokens_total", tenant="acme") == 7
    assert value(metrics, "ultrafast_generation_tokens_total", tenant="acme") == 4
    assert value(metrics, "ultrafast_e2e_request_latency_seconds_count", tier="default") == 0


def test_s12_label_values_come_from_fixed_sets():
    metrics = ServerMetrics(tenants=["acme"])
    before = set(samples(metrics))
    for i in range(10_000):  # 10k distinct tenant-ish strings and refusal reasons
        timer = metrics.request_timer(ServiceTier.DEFAULT, f"tenant-{i}", arrival_s=0.0)
        timer.output(0, 1, 0.0, now_s=0.5)
        timer.finish(1, 1)
    metrics.add_refusal_source(lambda: {f"reason-{i}": 1 for i in range(10_000)})
    after = samples(metrics)
    assert set(after) == before
    assert after[("ultrafast_prompt_tokens_total", (("tenant", "other"),))] == 10_000
    assert after[("ultrafast_admissions_refused_total", (("reason", "other"),))] == 10_000


def test_alert_threshold_is_exported_only_when_configured():
    assert not any(
        n == "ultrafast_alert_priority_itl_p99_threshold_seconds"
        for n, _ in samples(ServerMetrics())
    )
    metrics = ServerMetrics(device_kind="gpu", alert_priority_itl_p99_s=0.002)
    assert value(metrics, "ultrafast_alert_priority_itl_p99_threshold_seconds") == 0.002
    assert value(metrics, "ultrafast_engine_info", device_kind="gpu") == 1


def test_gc_pauses_are_timed_by_generation_while_watched():
    import gc

    metrics = ServerMetrics()
    unwatch = metrics.watch_gc()
    try:
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
    finally:
        unwatch()
    full = value(metrics, "ultrafast_gc_pause_seconds_count", generation="2")
    young = value(metrics, "ultrafast_gc_pause_seconds_count", generation="0")
    assert full >= 1 and young >= 1
    assert value(metrics, "ultrafast_gc_pause_seconds_sum", generation="2") > 0
    gc.collect()  # no longer watched
    assert value(metrics, "ultrafast_gc_pause_seconds_count", generation="2") == full


def test_freezing_the_startup_heap_takes_its_objects_out_of_collections():
    import gc

    from ultrafast.server.build import freeze_startup_heap

    survivor = [object() for _ in range(1000)]
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(survivor)
        assert id(survivor) not in {id(o) for o in gc.get_objects(generation=2)}
    finally:
        gc.unfreeze()
