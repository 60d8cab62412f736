"""The wide path by need (executors/wide_lazy.py) on the demo model: nothing of it at start but
feature detection; a pass before it is ready runs on llama.cpp and gives llama.cpp's tokens
exactly; once its weights are in and its routing decided, long chunks take it; a cached
decision skips the timing; an idle executor does not hold the bf16 weights."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("llama_cpp")

from tests.model.fresh_process import child_only, run_in_fresh_process  # noqa: E402
from tests.model.test_wide_pass import (  # noqa: E402
    DEMO_GGUF,
    _wide_unavailable,
    generate,
    plain,
    prompts,
    seq,
)
from ultrafast.core.types import StepPlan  # noqa: E402

KWARGS = dict(num_slots=8, max_model_len=256, flash_attn=True, n_threads=1)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    why = _wide_unavailable()
    if why:
        pytest.skip(f"wide pass not available: {why}")
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))


@pytest.fixture(autouse=True)
def patient_needing_pass(monkeypatch):
    """The pass that needs the weights of a cached decision waits for the load however long
    a busy machine makes it (the tests assert what it does once they are in, not how fast
    the demo model's load is; the slow-load test sets its own wait)."""
    from ultrafast.executors import wide_lazy

    monkeypatch.setattr(wide_lazy, "LOAD_WAIT_S", 120.0)


def by_need(mode="on"):
    from ultrafast.executors.wide_exec import WideGgmlExecutor

    return WideGgmlExecutor(DEMO_GGUF, wide_pass=mode, by_need=True, **KWARGS)


def count_wide_passes(ex, monkeypatch) -> list[int]:
    """The prefill chunks of each torch pass: into llama.cpp (wide decode off) or over the
    mirror (on)."""
    calls: list[int] = []
    prefill, step = ex._wide_prefill, ex._torch_step

    def spy_prefill(seqs, spare_threads=0):
        calls.append(len(seqs))
        return prefill(seqs, spare_threads)

    def spy_step(chunks, decodes, spare_threads):
        if chunks:
            calls.append(len(chunks))
        return step(chunks, decodes, spare_threads)

    monkeypatch.setattr(ex, "_wide_prefill", spy_prefill)
    monkeypatch.setattr(ex, "_torch_step", spy_step)
    return calls


def long_prompts(vocab: int) -> list[list[int]]:
    """Two prompts of 140 tokens: together (280) a pass that needs the wide path."""
    return [(p * 8)[:140] for p in prompts(vocab, 2)]


def step(ex, chunks: list[list[int]], first_slot: int = 0) -> None:
    """One pass prefilling each chunk from position 0 in its own slot."""
    result = ex.execute(StepPlan([seq(first_slot + i, c, 0) for i, c in enumerate(chunks)]))
    assert not result.errors, result.errors


def ready(ex) -> None:
    """Wait for the background load, then time the routing as the idle engine would, in slot
    3: free in the pool's eyes, though llama.cpp may still hold a finished request's KV."""
    ex.wide_lazy.wait_loaded(120)
    time_until_decided(ex, [3])


def time_until_decided(ex, free: list[int]) -> None:
    """Idle ticks until the path is decided: the GEMM kernels first (the decode timing
    depends on them), then both paths."""
    for _ in range(3):
        if not ex.wide_lazy.wants_time():
            return
        assert ex.wide_lazy.time_now(free, lambda: False)
    assert not ex.wide_lazy.wants_time()


def test_start_loads_nothing_and_a_pass_before_ready_is_exact(monkeypatch):
    with plain(DEMO_GGUF, **KWARGS) as ref:
        batch = long_prompts(ref.vocab_size)
        want, _ = generate(ref, batch)
    with by_need() as ex:
        assert ex.wide is None and ex.wide_lazy.state == "by need"
        assert ex.wide_status.startswith("by need: weights load at the first")
        wide_passes = count_wide_passes(ex, monkeypatch)
        got, _ = generate(ex, batch, margins_of=False)  # the first pass starts the load
        assert got == want and not wide_passes
        assert ex.wide_lazy.state in ("loading", "untimed")


def test_the_wide_path_is_used_once_ready_and_its_decision_cached(monkeypatch):
    from ultrafast.executors import cost_cache

    with by_need() as ex:
        batch = long_prompts(ex.vocab_size)
        step(ex, [batch[0]])  # one 140-token prompt (a long chat question): no need
        step(ex, [batch[0][:31]] * 8)  # 248 tokens in chunks too short to route: no need
        assert ex._slot_lens[3] == 31  # (finished: the timing may overwrite it)
        assert ex.wide_lazy.state == "by need"
        step(ex, batch)  # 280 tokens in two long chunks: needed
        assert ex.wide_lazy.state == "loading"
        ready(ex)
        assert ex.wide is not None and ex.wide_status.startswith("on (on): prefill chunks of")
        assert f"; {ex.wide.fused_status}" in ex.wide_status  # the elementwise path, said once
        assert ex.wide_status.count("elementwise: ") == 1
        assert ex._slot_lens[3] == 0  # the timing's scratch slot left empty
        wide_passes = count_wide_passes(ex, monkeypatch)
        step(ex, [batch[1]], first_slot=4)  # once on, any chunk from the threshold takes it
        assert wide_passes == [1]
        identity = ex.wide_lazy.identity()
        cached = cost_cache.read_cache(identity)
        assert cached["wide_min_tokens"] == ex.wide_min_tokens
        # one free slot is too few to time decode steps: --wide-pass on takes the least width
        assert "decode steps" in ex.wide_status and ex.mirror is not None
        assert cached["decode_on_width"] == ex.decode_router.on_width == 4


def test_decode_steps_are_timed_in_the_free_slots_with_the_routing():
    from ultrafast.executors import cost_cache

    with by_need() as ex:
        step(ex, long_prompts(ex.vocab_size))  # needed
        ex.wide_lazy.wait_loaded(120)
        assert ex.wide_lazy.wants_time()
        free = [4, 5, 6, 7]
        time_until_decided(ex, free)
        assert "4 wide" in ex.wide_status  # the decode step measured at width 4, both paths
        assert all(ex._slot_lens[s] == 0 for s in free)  # the scratch slots left empty
        assert ex.decode_router.on_width >= 4 and ex.mirror is not None
        cached = cost_cache.read_cache(ex.wide_lazy.identity())
        assert cached["decode_on_width"] == ex.decode_router.on_width


def forbid_timing(monkeypatch) -> None:
    """A cached decision must not time the paths again."""
    from ultrafast.executors import wide_lazy

    def no_timing(*args, **kwargs):
        raise AssertionError("timed although the decision was cached")

    monkeypatch.setattr(wide_lazy, "time_wide_path", no_timing)


def test_a_cached_decision_skips_the_timing(monkeypatch):
    from ultrafast.executors import cost_cache

    with by_need() as ex:  # the decision another start made on this CPU, file and flags
        decision = {"wide_min_tokens": 40, "decode_on_width": 6, "status": "x"}
        cost_cache.write_cache(ex.wide_lazy.identity(), decision)
    with by_need() as ex:
        assert "routing cached: chunks of >= 40 tokens" in ex.wide_status
        forbid_timing(monkeypatch)
        batch = long_prompts(ex.vocab_size)
        step(ex, [batch[0][:39]] * 7)  # 273 tokens under the cached threshold: no need
        assert ex.wide_lazy.state == "by need"
        wide_passes = count_wide_passes(ex, monkeypatch)
        step(ex, [batch[0][:40]] * 7)  # 280 at it: the load starts, the pass waits for it
        assert ex.wide_min_tokens == 40 and wide_passes == [7]
        assert ex.wide_status.startswith("on (on, routing cached)")
        assert ex.wide_status.count("elementwise: ") == 1
        step(ex, [batch[1]], first_slot=7)
        assert wide_passes == [7, 1]
        assert ex.decode_router.on_width == 6 and ex.mirror is not None  # cached as well


def test_a_cached_decode_only_decision(monkeypatch):
    """Prefill not faster, decode steps at longer contexts faster: the path loads at a pass
    of many prompts (their decodes come next), routes no chunk alone, and the router takes
    the cached positions."""
    from ultrafast.executors import cost_cache
    from ultrafast.executors.wide_route import DECODE_ONLY

    with by_need() as ex:
        decision = {
            "wide_min_tokens": DECODE_ONLY,
            "decode_on_width": 0,
            "decode_from_positions": {"4": 300},
            "status": "x",
        }
        cost_cache.write_cache(ex.wide_lazy.identity(), decision)
    with by_need() as ex:
        assert "routing cached: decode steps only" in ex.wide_status
        forbid_timing(monkeypatch)
        wide_passes = count_wide_passes(ex, monkeypatch)
        step(ex, [long_prompts(ex.vocab_size)[0][:40]] * 7)  # 280 tokens: the load starts
        ex.wide_lazy.wait_loaded(120)
        ex.wide_lazy.poll()
        assert ex.wide_status.startswith("decode only (on, routing cached)")
        assert ex.wide_min_tokens == DECODE_ONLY and wide_passes == []  # no chunk alone
        assert ex.decode_router.from_positions == {4: 300} and ex.decode_router.enabled


def test_the_gemms_are_timed_on_the_idle_engine_after_the_load(monkeypatch):
    """The background load only builds the GEMMs (timed beside serving passes, the choice of
    packed or plain weights scattered between starts); the idle engine times them, giving
    way to a request, and then wants no more time. The machine is made to read quiet: timed
    beside another busy process the groups are dropped by design (time_gemms), and that
    made this test fail wherever something else ran."""
    from ultrafast.cpu_contention import BusyWindow
    from ultrafast.executors import cost_cache

    monkeypatch.setattr(BusyWindow, "others_busy_cores", lambda self: 0.0)

    with by_need() as ex:
        decision = {"wide_min_tokens": 40, "decode_on_width": 6, "status": "x"}
        cost_cache.write_cache(ex.wide_lazy.identity(), decision)
    with by_need() as ex:
        step(ex, [long_prompts(ex.vocab_size)[0][:40]] * 7)  # the load; the path turns on
        assert ex.wide_lazy.state == "on" and ex.wide.gemms_untimed
        assert ex.wide_lazy.wants_time()
        assert ex.wide_lazy.time_now([], lambda: True)  # a request came: nothing timed
        assert ex.wide.gemms_untimed and ex.wide_lazy.wants_time()
        assert ex.wide_lazy.time_now([], lambda: False)
        assert not ex.wide.gemms_untimed and not ex.wide_lazy.wants_time()
        assert "timed when the engine is next idle" not in ex.wide.gemm_status


def forbid_gemm_timing(monkeypatch) -> None:
    """Cached GEMM choices must not be timed again."""
    from ultrafast.executors import wide_forward

    def no_timing(*args, **kwargs):
        raise AssertionError("a GEMM timed although its choice was cached")

    monkeypatch.setattr(wide_forward, "fastest_kernel", no_timing)


def cache_routing_and_gemms(kernels: object) -> list[int]:
    """A cached routing decision and GEMM choice record (`kernels`) as an earlier start on
    this CPU, file and flags left them; the row counts a load builds."""
    from ultrafast.executors import cost_cache
    from ultrafast.executors.wide_forward import gemm_row_counts

    with by_need() as ex:
        decision = {"wide_min_tokens": 40, "decode_on_width": 6, "status": "x"}
        cost_cache.write_cache(ex.wide_lazy.identity(), decision)
        rows = gemm_row_counts(ex.max_num_batched_tokens, ex.num_slots)
        cost_cache.write_cache(ex.wide_lazy.gemm_identity(rows), {"kernels": kernels})
    return rows


def test_the_gemm_choice_is_cached_and_a_later_start_takes_it(monkeypatch):
    """Timed once (~60 s for SmolLM2 on two cores), the GEMM kernels' choice is cached with
    the row counts; the next start's load takes it: every layer and the head chosen, the
    copies no count needs freed, nothing left to time."""
    from ultrafast.cpu_contention import BusyWindow
    from ultrafast.executors import cost_cache
    from ultrafast.executors.packed_linear import HALVES

    monkeypatch.setattr(BusyWindow, "others_busy_cores", lambda self: 0.0)
    rows = cache_routing_and_gemms(None)  # a record that is no choice: timed
    with by_need() as ex:
        step(ex, [long_prompts(ex.vocab_size)[0][:40]] * 7)
        assert ex.wide.gemm_rows == rows and ex.wide.gemms_untimed  # not taken: timed
        assert ex.wide_lazy.time_now([], lambda: False) and not ex.wide.gemms_untimed
        cached = cost_cache.read_cache(ex.wide_lazy.gemm_identity(rows))
        assert cached["kernels"] == ex.wide.kernel_choices()
        assert "(cached)" not in ex.wide.gemm_status
    wide_rows = max(r for r in rows if r >= 128)
    choice = {"down": {str(wide_rows): HALVES}, "o": {"16": "packed"}}
    cache_routing_and_gemms(choice)
    forbid_gemm_timing(monkeypatch)
    with by_need() as ex:
        step(ex, [long_prompts(ex.vocab_size)[0][:40]] * 7)  # the load takes the choice
        assert ex.wide_lazy.state == "on" and not ex.wide_lazy.wants_time()
        assert not ex.wide.gemms_untimed and ex.wide.kernel_choices() == choice
        assert all(layer.down.kernel_at(wide_rows) == HALVES for layer in ex.wide.layers)
        assert all(not layer.qkv.copies for layer in ex.wide.layers)  # no count needs one
        assert ex.wide.gemm_status.endswith("row counts (cached)")
        assert "(cached)" in ex.wide_status


@pytest.mark.parametrize(
    "record", [{"down": {"16": "no-such-kernel"}}, {"lm": {"16": "plain"}}, {"o": {"x": "plain"}}]
)
def test_a_gemm_record_that_is_no_choice_is_timed_again(monkeypatch, record):
    cache_routing_and_gemms(record)
    with by_need() as ex:
        step(ex, [long_prompts(ex.vocab_size)[0][:40]] * 7)
        assert ex.wide_lazy.state == "on" and ex.wide.gemms_untimed
        assert ex.wide_lazy.wants_time() and not ex.wide.gemms_cached


def test_deciding_at_once_takes_the_cached_gemm_choice(monkeypatch):
    """Offline (LLM, in-process benchmarks): the paths are timed, the GEMMs are not."""
    from ultrafast.executors.packed_linear import HALVES

    rows = cache_routing_and_gemms({"down": {"128": HALVES}})
    assert 128 in rows
    forbid_gemm_timing(monkeypatch)
    with by_need() as ex:
        ex.wide_lazy.decide_now(use_cache=False)
        assert ex.wide is not None and ex.wide.gemms_cached
        assert ex.wide.layers[0].down.kernel_at(128) == HALVES


def test_a_slow_load_leaves_the_needing_pass_on_llama_cpp(monkeypatch):
    """With a cached decision the needing pass waits at most LOAD_WAIT_S for the weights;
    a load that takes longer goes on in the background while passes run on llama.cpp."""
    import threading

    from ultrafast.executors import cost_cache, wide_forward, wide_lazy

    with by_need() as ex:
        decision = {"wide_min_tokens": 40, "decode_on_width": 6, "status": "x"}
        cost_cache.write_cache(ex.wide_lazy.identity(), decision)
    release = threading.Event()
    real = wide_forward.WideForward

    def slow(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(wide_forward, "WideForward", slow)
    monkeypatch.setattr(wide_lazy, "LOAD_WAIT_S", 0.2)
    with by_need() as ex:
        wide_passes = count_wide_passes(ex, monkeypatch)
        step(ex, long_prompts(ex.vocab_size))
        assert ex.wide_lazy.state == "loading" and not wide_passes
        release.set()
        ex.wide_lazy.wait_loaded(120)
        step(ex, [long_prompts(ex.vocab_size)[1]], first_slot=4)
        assert wide_passes == [1] and ex.wide_lazy.state == "on"


def test_closing_waits_for_a_load_in_its_thread(monkeypatch):
    """A load still running when the executor closes ends before close returns: a daemon
    thread left inside torch at the interpreter's exit aborted the process."""
    import threading

    from ultrafast.executors import wide_forward

    release, real = threading.Event(), wide_forward.WideForward

    def slow(*args, **kwargs):
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(wide_forward, "WideForward", slow)
    ex = by_need()
    step(ex, long_prompts(ex.vocab_size))
    loader = ex.wide_lazy._loader
    assert ex.wide_lazy.state == "loading" and loader is not None and loader.is_alive()
    threading.Timer(0.5, release.set).start()
    ex.close()
    assert not loader.is_alive()


def test_a_cached_off_decision_never_loads_the_weights():
    from ultrafast.executors import cost_cache

    with by_need("auto") as ex:
        status = "off (measured not faster: ...): every pass runs on llama.cpp"
        identity = ex.wide_lazy.identity()
        cost_cache.write_cache(identity, {"wide_min_tokens": None, "status": status})
    with by_need("auto") as ex:
        assert ex.wide_status == f"{status} (cached)"
        step(ex, long_prompts(ex.vocab_size))
        assert ex.wide_lazy.state == "off" and ex.wide_lazy._loader is None


def test_an_arriving_request_interrupts_the_timing():
    from ultrafast.executors.ggml_threads import CalibrationInterrupted

    with by_need() as ex:
        step(ex, long_prompts(ex.vocab_size))
        ex.wide_lazy.wait_loaded(120)
        assert ex.wide_lazy.wants_time()
        assert ex.wide_lazy.time_now([], lambda: False)  # the GEMM kernels: no slot needed
        assert ex.wide_lazy.state == "untimed" and ex.wide_lazy.wants_time()
        with pytest.raises(CalibrationInterrupted):
            ex.wide_lazy.time_now([2], lambda: True)
        assert ex.wide is None and ex.wide_lazy.wants_time() and ex._slot_lens[2] == 0
        assert not ex.wide_lazy.time_now([], lambda: False)  # no free slot: later


def test_idle_rss_holds_no_bf16_weights():
    """In a fresh interpreter (memory freed by earlier tests would blur the figures)."""
    run_in_fresh_process(__file__, "test_idle_rss_in_a_fresh_process")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensors(layer):
    """A layer's tensors, a matrix's packed one and the other copies it keeps."""
    from ultrafast.executors.packed_linear import Weight

    for value in vars(layer).values():
        if isinstance(value, Weight):
            yield from (value.packed, *value.copies.values())
        elif value is not None:
            yield value


def test_idle_rss_in_a_fresh_process():
    child_only()
    with by_need() as ex:
        batch = long_prompts(ex.vocab_size)
        step(ex, [batch[0][:40]])  # served, short: no need
        idle = _rss()
        step(ex, batch, first_slot=2)  # the first need
        ex.wide_lazy.wait_loaded(120)
        ex.wide_lazy.poll()
        forward = ex.wide_lazy._loaded
        assert forward is not None and ex.wide is None
        tensors = [forward.embed] + [t for layer in forward.layers for t in _tensors(layer)]
        weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
        grew = _rss() - idle
        print(f"bf16 forward {weight_bytes / 2**20:.1f} MiB, RSS grew {grew / 2**20:.1f} MiB")
        assert weight_bytes >= 8 * 2**20  # large enough to tell apart from noise
        assert grew >= 0.6 * weight_bytes  # they were not resident while idle


def test_weights_that_fail_to_load_leave_every_pass_on_llama_cpp(monkeypatch):
    from ultrafast.executors import wide_forward

    def broken(*args, **kwargs):
        raise OSError("the GGUF went away")

    monkeypatch.setattr(wide_forward, "WideForward", broken)
    with by_need() as ex:
        batch = long_prompts(ex.vocab_size)
        step(ex, batch)
        ex.wide_lazy.wait_loaded(120)
        step(ex, batch, first_slot=2)  # takes the outcome: off, and this pass on llama.cpp
        assert ex.wide is None and not ex.wide_lazy.wants_time()
        assert ex.wide_status == "off (the weights did not load: OSError: the GGUF went away)"


def test_the_load_builds_every_gemm_row_count_a_step_can_have(monkeypatch):
    """oneDNN builds a primitive per GEMM row count (~10-20 ms a served step at a new one):
    the background load runs each of one layer's GEMMs at every count a step of the
    executor's budget beside its slots' decodes can have (padded_rows' values), so no step
    builds one."""
    from ultrafast.executors import packed_linear
    from ultrafast.executors import wide_forward as wf

    assert wf.gemm_row_counts(40, 8) == list(range(1, 33)) + [48]
    counts = wf.gemm_row_counts(512, 32)
    assert counts == list(range(1, 33)) + list(range(48, 545, 16))
    assert max(wf.gemm_row_counts(16384, 64)) == wf.WARM_ROWS_MAX
    built: list[tuple[int, object]] = []
    real = packed_linear.linear

    def spy(x, weight, bias=None):
        built.append((x.shape[0], weight))
        return real(x, weight, bias)

    monkeypatch.setattr(packed_linear, "linear", spy)  # the one packed_linear.build() calls
    with by_need() as ex:
        batch = long_prompts(ex.vocab_size)
        step(ex, batch)  # needs the wide path: the load starts
        ex.wide_lazy.wait_loaded(120)
        want = wf.gemm_row_counts(ex.max_num_batched_tokens, ex.num_slots)
        first = ex.wide_lazy._loaded.layers[0]
        for kind in wf.GEMM_KINDS:  # each count built (then maybe timed) in order
            packed = getattr(first, kind).packed
            assert list(dict.fromkeys(r for r, w in built if w is packed)) == want, kind


def test_a_failed_gemm_build_still_loads_the_wide_path(monkeypatch):
    """Building the row counts ahead is a speed-up only: if it fails, the weights still load
    and the path turns on (the passes build what they meet)."""
    from ultrafast.executors import wide_forward as wf

    def broken(self, row_counts):
        raise RuntimeError("no memory for a primitive")

    monkeypatch.setattr(wf.WideForward, "warm_gemms", broken)
    with by_need() as ex:
        step(ex, long_prompts(ex.vocab_size))
        ready(ex)
        assert ex.wide is not None and ex.wide_lazy.state == "on"


def test_the_loads_and_the_timings_freed_pages_go_back(monkeypatch):
    """glibc keeps freed heap pages (heap_trim.py): the wide path trims after building its
    weights, after building the GEMMs (the process stayed at that transient's peak: SmolLM2
    float32, 2.5 GiB steady where 1.6 sufficed) and after timing the GEMMs, each in order."""
    from ultrafast.cpu_contention import BusyWindow
    from ultrafast.executors import cost_cache, wide_lazy
    from ultrafast.executors import wide_forward as wf

    monkeypatch.setattr(BusyWindow, "others_busy_cores", lambda self: 0.0)
    events: list[str] = []
    monkeypatch.setattr(wide_lazy, "glibc_trim", lambda: events.append("trim") or True)
    for name in ("warm_gemms", "time_gemms"):
        real = getattr(wf.WideForward, name)

        def spied(self, *args, _real=real, _name=name, **kwargs):
            events.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(wf.WideForward, name, spied)
    with by_need() as ex:
        decision = {"wide_min_tokens": 40, "decode_on_width": 0, "status": "x"}
        cost_cache.write_cache(ex.wide_lazy.identity(), decision)
    with by_need() as ex:
        step(ex, [long_prompts(ex.vocab_size)[0][:40]] * 7)  # the load; the path turns on
        ex.wide_lazy.wait_loaded(120)
        assert events == ["trim", "warm_gemms", "trim"]
        assert ex.wide_lazy.time_now([], lambda: False)
        assert events[3:] == ["time_gemms", "trim"]
