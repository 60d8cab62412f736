"""The grammar's cost kept off the step: a compile still running when its request arrives
(the prompt prefills meanwhile, nothing is sampled until the matcher exists, other requests
keep stepping), forced drafts sized by the measured step costs, and the mask applied to the
logits in one pass. Fake executor over the demo vocabulary, as test_grammar_engine.py."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch

from tests.unit.engine_driver import run_all
from tests.unit.test_grammar_engine import SCHEMA, SPEC, engine, request, text
from tests.unit.test_grammar_engine import runtime as runtime  # noqa: F401 (fixture)
from tests.unit.test_grammar_engine import tok as tok  # noqa: F401 (fixture)
from ultrafast.engine.grammar_stage import (
    COMPILE_SPARE_THREADS,
    COMPILE_STEP_S,
    FORCED_DRAFT_RETRY_STEPS,
    FORCED_WORTH_REUSE_CALLS,
)
from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.cache import GrammarError
from ultrafast.grammar.mask import AllowedIdsCache, allowed_bools, apply_mask_numpy, set_bits
from ultrafast.request import ServiceTier


def worth(core, available):
    """The grammar stage's forced-draft count, as a step with no other request asks it."""
    return core.grammar_stage.forced_drafts_worth(available, core.costs, lone=True)


def step_until(core, outputs, condition, limit=200):
    for _ in range(limit):
        if condition():
            return
        for out in core.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                outputs.setdefault("finished:" + out.request_id, []).append(out.finish_reason)
    raise AssertionError("condition never held")


@pytest.mark.parametrize("keeps_logits", [True, False])
def test_a_compiling_request_prefills_and_waits_while_others_decode(
    tok,
    runtime,  # noqa: F811
    keeps_logits,
):
    want, _ = run_all(engine(tok, runtime)[0], [request(tok, "c", prompt="a longer prompt here")])
    core, executor = engine(tok, runtime, keeps_logits=keeps_logits)
    core.costs.single_decode_s = 0.001  # a model whose steps are shorter than a compile
    compiling: Future = Future()
    slow = request(tok, "c", prompt="a longer prompt here")
    slow.grammar_pending = compiling
    core.add_request(slow)
    core.add_request(request(tok, "free", None, max_tokens=30))
    outputs: dict = {}
    step_until(core, outputs, lambda: len(outputs.get("free", [])) >= 10)
    # the free request decoded step after step; the constrained one sampled nothing
    assert "c" not in outputs or outputs["c"] == []
    mine = [s for p in executor.plans for s in p.seqs if s.request_id == "c"]
    if keeps_logits:  # the whole prompt is in, its last row's logits kept for the grammar
        assert slow.num_computed_tokens == slow.num_prompt_tokens
        assert [s.defer_sample for s in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].num_logits == 1 and "c" in core.grammar_stage.kept
    else:  # all but the one token whose logits need the grammar
        assert slow.num_computed_tokens == slow.num_prompt_tokens - 1
        assert all(s.num_logits == 0 and not s.defer_sample for s in mine)
    # every step so far left a core to the compile
    assert executor.plans and all(p.spare_threads == COMPILE_SPARE_THREADS for p in executor.plans)
    runtime.compile(SPEC)
    compiling.set_result(None)
    num_plans = len(executor.plans)
    for out in core.step():  # the matcher is made at the start of the step
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            outputs.setdefault("finished:" + out.request_id, []).append(out.finish_reason)
    if keeps_logits:  # its first token straight from the kept row, returned before any pass
        assert outputs["c"] and not core.grammar_stage.kept and len(executor.plans) == num_plans
    step_until(core, outputs, lambda: not core.has_work())
    last_prompt_pass = [
        s
        for p in executor.plans[num_plans:]
        for s in p.seqs
        if s.request_id == "c" and s.start_position == slow.num_prompt_tokens - 1
    ]
    assert len(last_prompt_pass) == (0 if keeps_logits else 1)  # no pass of its own when kept
    assert all(p.spare_threads == 0 for p in executor.plans[num_plans:])  # all cores again
    assert outputs["c"] == want["c"]  # the same tokens as a request compiled up front
    jsonschema.validate(json.loads(text(tok, outputs["c"])), SCHEMA)
    assert outputs["finished:c"] == ["stop"] and not core.grammar_stage.compiling


def test_steps_stay_short_while_a_grammar_compiles(tok, runtime):  # noqa: F811
    core, executor = engine(tok, runtime)
    for _ in range(20):  # 1 ms a step plus 0.05 ms a token: ~20 tokens fit COMPILE_STEP_S
        core.costs.observe(1, 1, 0.00105, 0.00105)
        core.costs.observe(1, 101, 0.00605, 0.00605)
    short = core.costs.token_budget(COMPILE_STEP_S)
    assert short is not None and short < 100
    compiling: Future = Future()
    slow = request(tok, "c", prompt="word " * 150)
    slow.grammar_pending = compiling
    core.add_request(slow)
    core.step()
    core.step()
    # a prefill chunk per step no larger than the short budget (or the minimum prefill)
    assert all(p.num_scheduled_tokens <= max(short, 32) for p in executor.plans)
    runtime.compile(SPEC)
    compiling.set_result(None)
    core.step()  # the compile is noticed: the rest of the prompt in one full step
    assert executor.plans[-1].num_scheduled_tokens > max(short, 32)


def test_a_model_whose_steps_outlast_a_compile_keeps_every_core(tok, runtime):  # noqa: F811
    core, executor = engine(tok, runtime)
    for _ in range(20):  # 10 ms a lone decode: the prefill hides the compile
        core.costs.observe(1, 1, 0.01, 0.01)
        core.costs.observe(1, 101, 0.05, 0.05)
    compiling: Future = Future()
    slow = request(tok, "c", prompt="word " * 150)
    slow.grammar_pending = compiling
    core.add_request(slow)
    core.step()
    assert executor.plans[-1].spare_threads == 0
    assert executor.plans[-1].num_scheduled_tokens > 100  # no short steps either
    compiling.set_result(None)


def test_any_compile_under_way_leaves_a_core_and_its_steps_teach_the_costs_nothing(tok):
    """A compile on another thread (the server starts one before the prompt is tokenized, so
    its request is not in the engine yet) timeshares with every pass on all cores: steps leave
    it a core while it runs, and their times (contention, not the model) are not learned."""
    import threading

    from ultrafast.grammar.matcher import GrammarRuntime

    own = GrammarRuntime.for_tokenizer(tok, tok.vocab_size)  # its cache's compile is held
    core, executor = engine(tok, own)
    core.costs.single_decode_s = 0.001  # a model whose steps are shorter than a compile
    entered, release = threading.Event(), threading.Event()
    compile_for_real = own.cache._compile

    def held_compile(spec):
        entered.set()
        release.wait(10)
        return compile_for_real(spec)

    own.cache._compile = held_compile
    worker = threading.Thread(target=own.compile, args=(SPEC,))
    worker.start()
    try:
        assert entered.wait(10) and own.compiles_running == 1
        core.add_request(request(tok, "free", None, max_tokens=50))
        outputs: dict = {}
        step_until(core, outputs, lambda: len(outputs.get("free", [])) >= 5)
        assert all(p.spare_threads == COMPILE_SPARE_THREADS for p in executor.plans)
        assert core.costs.single_decode_s == 0.001  # nothing learned from those steps
    finally:
        release.set()
        worker.join(10)
    assert own.compiles_running == 0
    num_plans = len(executor.plans)
    step_until(core, outputs, lambda: len(outputs["free"]) >= 10)
    assert all(p.spare_threads == 0 for p in executor.plans[num_plans:])  # every core again
    assert core.costs.single_decode_s != 0.001  # and the steps are learned from again


def test_a_cached_grammar_starts_without_a_thread_hop(runtime):  # noqa: F811
    class NoPool:
        def submit(self, *args):
            raise AssertionError("a cached spec went to the compile pool")

    runtime.compile(SPEC)
    done = runtime.start_compile(SPEC, NoPool())
    assert done.done() and done.result() is None
    bad = _never_compiles()
    with pytest.raises(GrammarError):
        runtime.compile(bad)
    failed = runtime.start_compile(bad, NoPool())  # a cached failure is answered at once too
    assert failed.done() and isinstance(failed.exception(), GrammarError)
    with ThreadPoolExecutor(1) as pool:  # a new one does go to the pool
        fresh = GrammarSpec.from_json_schema({"type": "integer", "minimum": 7})
        assert fresh not in runtime.cache
        runtime.start_compile(fresh, pool).result(timeout=30)
        assert fresh in runtime.cache


def test_a_failed_compile_aborts_its_request_only(tok, runtime):  # noqa: F811
    core, _ = engine(tok, runtime)
    failed: Future = Future()
    bad = request(tok, "bad", grammar=_never_compiles())
    bad.grammar_pending = failed
    core.add_request(bad)
    core.add_request(request(tok, "good"))
    outputs: dict = {}
    step_until(core, outputs, lambda: bool(outputs.get("good")))
    failed.set_exception(GrammarError("no"))
    step_until(core, outputs, lambda: not core.has_work())
    assert outputs["finished:bad"] == ["abort"] and not outputs.get("bad")
    jsonschema.validate(json.loads(text(tok, outputs["good"])), SCHEMA)


def test_a_request_aborted_while_compiling_is_forgotten(tok, runtime):  # noqa: F811
    core, _ = engine(tok, runtime)
    pending: Future = Future()
    r = request(tok, "gone")
    r.grammar_pending = pending
    core.add_request(r)
    core.step()
    core.abort("gone")
    pending.set_result(None)
    outputs: dict = {}
    step_until(core, outputs, lambda: not core.has_work())
    assert not core.grammar_stage.compiling and r.grammar_matcher is None


def test_forced_drafts_are_dropped_when_a_wider_pass_costs_more_than_it_saves(
    tok,
    runtime,  # noqa: F811
):
    want, _ = run_all(engine(tok, runtime)[0], [request(tok, "f")])
    core, executor = engine(tok, runtime)
    costs = core.costs
    for _ in range(20):  # a line fit, then lone passes: two tokens cost three one-token steps
        costs.observe(1, 1, 0.001, 0.001)
        costs.observe(1, 8, 0.004, 0.004)
    costs.lone_pass_s[1], costs.lone_pass_s[2] = 0.001, 0.003
    costs.lone_pass_s[3:] = [0.01] * (len(costs.lone_pass_s) - 3)
    assert worth(core, 5) == 0
    core.grammar_stage.forced_idle_steps = -(10**6)  # no retry of a wider pass within this test
    got, _ = run_all(core, [request(tok, "f")])
    assert got["f"] == want["f"]
    assert not any(s.num_logits > 1 for p in executor.plans for s in p.seqs)
    # now and then one forced draft rides anyway, so a width timed in a load spike is retimed
    core.grammar_stage.forced_idle_steps = 0
    taken = [worth(core, 5) for _ in range(2 * FORCED_DRAFT_RETRY_STEPS)]
    assert taken.count(1) == 2 and set(taken) == {0, 1}


def test_no_forced_draft_is_reused_for_a_while_then_recomputed(tok, runtime):  # noqa: F811
    core, _ = engine(tok, runtime)
    costs = core.costs
    for _ in range(20):
        costs.observe(1, 1, 0.001, 0.001)
        costs.observe(1, 8, 0.004, 0.004)
    costs.lone_pass_s[1], costs.lone_pass_s[2] = 0.001, 0.003  # a draft costs a step: none
    core.grammar_stage.forced_idle_steps = -(10**6)  # no retry ride within this test
    assert worth(core, 1) == 0
    costs.lone_pass_s[2] = 0.0011  # now one pays, but "none" still stands for a while
    assert worth(core, 2) == 1  # each count of forced tokens is its own entry
    taken = [worth(core, 1) for _ in range(FORCED_WORTH_REUSE_CALLS)]
    assert taken[:-1] == [0] * (FORCED_WORTH_REUSE_CALLS - 1)
    assert taken[-1] == 1 and worth(core, 1) == 1  # a paying k is never reused


def test_forced_drafts_all_ride_when_passes_are_cheap(tok, runtime):  # noqa: F811
    core, _ = engine(tok, runtime)
    for _ in range(20):
        core.costs.observe(1, 1, 0.001, 0.001)
        core.costs.observe(1, 8, 0.0012, 0.0012)
    assert worth(core, 5) == 5


@pytest.mark.parametrize("vocab,words", [(100, 5), (4096, 128), (49153, 1537), (70, 2)])
def test_the_one_pass_mask_matches_the_row_by_row_one(vocab, words):
    rng = np.random.default_rng(vocab)
    mask = rng.integers(-(2**31), 2**31 - 1, size=(3, words), dtype=np.int64).astype(np.int32)
    logits = rng.random((3, vocab), dtype=np.float32)
    want = logits.copy()
    for r in range(3):
        np.putmask(want[r], ~allowed_bools(mask[r], vocab), -np.inf)
    apply_mask_numpy(logits, mask)
    assert np.array_equal(logits, want)
    if vocab > 32 * words:  # ids past the mask are never allowed
        assert np.isneginf(logits[:, 32 * words :]).all()


def _never_compiles():
    from ultrafast.grammar import GrammarSpec

    # spelled for llguidance itself: from_json_schema refuses this schema before any compile
    return GrammarSpec('start: %json {"type":"integer","minimum":5,"maximum":2}\n', "json_schema")


@pytest.mark.parametrize("as_numpy", [True, False])
def test_greedy_under_masks_equals_masking_every_row(as_numpy):
    from ultrafast.core.types import ScheduledSeq
    from ultrafast.request import SamplingParams
    from ultrafast.sampling.sampler import sample_plan

    vocab, rows = 300, 40
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[::3, 5] = logits[::3, 17] = 9.0  # ties: the first maximum must win in both paths
    mask = rng.integers(-(2**31), 2**31 - 1, size=(rows, (vocab + 31) // 32), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[1::2, 0] |= 1 << 5  # some rows allow their unmasked argmax, some do not
    seqs = []
    for i in range(0, rows, 4):  # 4 positions each (a decode with 3 drafts)
        seqs.append(
            ScheduledSeq(f"s{i}", 0, [1, 2, 3, 4], 0, 4, SamplingParams(temperature=0.0), 1, 0)
        )
        seqs[-1].token_mask = mask[i : i + 4]
    want = logits.copy()
    apply_mask_numpy(want, mask)
    want_ids = want.argmax(-1).tolist()
    got = sample_plan(seqs, logits.copy() if as_numpy else torch.from_numpy(logits.copy()))
    for i, s in enumerate(seqs):  # the batch argmax path: every position's greedy id
        assert got.sampled_token_ids[s.request_id] == want_ids[4 * i : 4 * i + 4]


@pytest.mark.parametrize("vocab", [300, 333])
@pytest.mark.parametrize("allowed", [3, 160])
def test_masked_argmax_blocks_ids_past_a_short_mask(vocab, allowed, monkeypatch):
    from ultrafast.sampling import sampler

    rng = np.random.default_rng(vocab + allowed)
    mask = np.zeros(10, dtype=np.int32)  # a 10-word mask: 320 ids
    set_bits(mask, rng.choice(320, size=allowed, replace=False).tolist())
    for max_ids in (1024, 0):  # the few-ids search, and blocking the whole row
        monkeypatch.setattr(sampler, "_ALLOWED_IDS", AllowedIdsCache(max_ids=max_ids))
        for _ in range(2):  # a first-seen row, then the same row again
            row = rng.standard_normal(vocab).astype(np.float32)
            row[320:] = 50.0  # the best ids lie past the mask: never allowed
            row[rng.integers(0, min(320, vocab))] = 40.0  # allowed or not: the best in the mask
            want = row.copy()
            want[~allowed_bools(mask, vocab)] = -np.inf
            assert sampler._masked_argmax(row, mask) == int(want.argmax())


def test_allowed_ids_cache_is_bounded_and_remembers_wide_rows():
    cache = AllowedIdsCache(max_entries=3, max_ids=4)
    rows = [np.zeros(4, dtype=np.int32) for _ in range(5)]
    for i, row in enumerate(rows):
        set_bits(row, [i, 64 + i])
    assert cache.get(rows[0]).tolist() == [0, 64]
    assert cache.get(rows[0]) is cache.get(rows[0])  # found again, not recomputed
    for row in rows[1:]:
        cache.get(row)
    assert len(cache) <= 3
    wide = np.full(4, -1, dtype=np.int32)  # every id: more than max_ids
    assert cache.get(wide) is None and cache.get(wide) is None
    assert cache.get(rows[4]).tolist() == [4, 68]


def test_fixed_draft_costs_keep_every_forced_draft(tok, runtime):  # noqa: F811
    from ultrafast.engine.speculation import SpeculationConfig, Speculator

    speculator = Speculator(SpeculationConfig(method="ngram", use_measured_costs=False))
    core, _ = engine(tok, runtime, speculator=speculator)
    for _ in range(20):  # measured: a wider pass never pays
        core.costs.observe(1, 1, 0.001, 0.001)
        core.costs.observe(1, 8, 0.02, 0.02)
    core.costs.lone_pass_s[2:] = [1.0] * (len(core.costs.lone_pass_s) - 2)
    assert worth(core, 4) == 4


@pytest.mark.parametrize("as_numpy", [True, False])
def test_a_deferred_row_is_kept_and_the_others_sampled_as_usual(as_numpy):
    from ultrafast.core.types import ScheduledSeq
    from ultrafast.request import SamplingParams
    from ultrafast.sampling.sampler import sample_keeping_deferred, sample_kept_row, sample_plan

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    greedy = SamplingParams(temperature=0.0)
    a = ScheduledSeq("a", 0, [1], 5, 1, greedy, 1, 0)
    b = ScheduledSeq("b", 1, [1, 2, 3], 0, 1, greedy, 2, 0, defer_sample=True)
    c = ScheduledSeq("c", 2, [4, 5], 7, 2, greedy, 3, 0)  # a decode with one draft: two rows
    wrap = (lambda x: x) if as_numpy else torch.from_numpy
    got = sample_keeping_deferred([a, b, c], wrap(logits.copy()))
    rest = np.concatenate([logits[:1], logits[2:]])
    want = sample_plan([a, c], wrap(rest))
    assert got.sampled_token_ids == want.sampled_token_ids and "b" not in got.sampled_token_ids
    kept = got.kept_logits["b"]
    assert np.array_equal(np.asarray(kept), logits[1])
    # later, under a mask that blocks the row's argmax: the best allowed token
    mask = np.full((1, 2), -1, dtype=np.int32)
    best = int(logits[1].argmax())
    mask[0, best >> 5] &= ~(1 << (best & 31))
    b.token_mask = mask
    sampled = sample_kept_row(b, kept).sampled_token_ids["b"]
    masked = logits[1].copy()
    masked[best] = -np.inf
    assert sampled == [int(masked.argmax())]


def test_a_request_preempted_while_its_logits_are_kept_prefills_again(tok, runtime):  # noqa: F811
    """Its kept row no longer matches its slot: it is dropped, the prompt prefills again and
    the first token is sampled as usual, the same tokens as a grammar compiled up front."""
    want, _ = run_all(engine(tok, runtime)[0], [request(tok, "c", prompt="a longer prompt here")])
    core, _ = engine(tok, runtime, num_slots=1)
    compiling: Future = Future()
    slow = request(tok, "c", prompt="a longer prompt here")
    slow.grammar_pending = compiling
    core.add_request(slow)
    outputs: dict = {}
    step_until(core, outputs, lambda: "c" in core.grammar_stage.kept)
    core.add_request(request(tok, "p", None, tier=ServiceTier.PRIORITY, max_tokens=3))
    step_until(core, outputs, lambda: slow.num_preemptions == 1)
    runtime.compile(SPEC)  # ready while "c" waits for its slot back
    compiling.set_result(None)
    for out in core.step():  # the matcher is made; the kept row no longer matches: dropped
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not core.grammar_stage.kept and not outputs.get("c") and slow.num_computed_tokens == 0
    step_until(core, outputs, lambda: not core.has_work())
    assert outputs["c"] == want["c"]
