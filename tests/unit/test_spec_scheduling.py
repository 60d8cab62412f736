"""Speculative decoding through the scheduler, against the hash-based fake executor.

The target is the fake executor (any KV or position mistake changes its tokens); the "draft
model" is a second fake executor that agrees with the target always, never, or on a
hash-chosen part of the contexts. Whatever the drafts, the output must be the plain output.
"""

from tests.unit.engine_driver import prompt, run_all
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.engine.draft_model import DraftModelProposer
from ultrafast.engine.speculation import SpeculationConfig, Speculator
from ultrafast.executors.fake_exec import FakeExecutor, next_token, reference_tokens
from ultrafast.request import Request, SamplingParams, ServiceTier

PRIORITY = ServiceTier.PRIORITY


class FakeDraft(FakeExecutor):
    """A fake draft model: the target's next token when `agree(context)`, else a wrong one."""

    def __init__(self, agree, **kwargs):
        super().__init__(**kwargs)
        self.agree = agree

    def execute(self, plan):
        result = super().execute(plan)
        for seq in plan.seqs:
            if seq.num_logits and seq.request_id in result.sampled_token_ids:
                context = self.slots[seq.slot_id]
                token = result.sampled_token_ids[seq.request_id][0]
                if not self.agree(context):
                    result.sampled_token_ids[seq.request_id] = [(token + 1) % self.vocab_size]
        return result


def sometimes(context):
    return next_token(context, range(5)) != 0  # agrees on ~80% of contexts


def make_engine(agree=lambda c: True, num_slots=4, speculation=None, **overrides):
    executor = FakeExecutor(num_slots=num_slots)
    draft = FakeDraft(agree, num_slots=num_slots)
    config = SchedulerConfig(**{"max_num_seqs": num_slots, "max_model_len": 256, **overrides})
    speculation = speculation or SpeculationConfig(
        method="draft", tiers=(PRIORITY,), use_measured_costs=False
    )
    engine = EngineCore(
        executor, config, speculator=Speculator(speculation, DraftModelProposer(draft))
    )
    return engine, executor, draft


def greedy(max_tokens=30, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def drafted_seqs(executor):
    return [s for p in executor.plans for s in p.seqs if s.num_logits > 1]


def test_accept_all_none_and_partial_give_the_plain_output():
    for agree, expect_rate in ((lambda c: True, 1.0), (lambda c: False, 0.0), (sometimes, None)):
        engine, executor, _ = make_engine(agree)
        out, finish = run_all(engine, [Request("a", prompt(1, 10), greedy(), tier=PRIORITY)])
        assert out["a"] == reference_tokens(prompt(1, 10), 30)
        assert finish["a"] == "length"
        assert drafted_seqs(executor)  # drafts really were verified
        rate = engine.speculation_stats.acceptance_rate("draft")
        if expect_rate is not None:
            assert rate == expect_rate
        else:
            assert 0.0 < rate < 1.0
    # all accepted: fewer target steps than tokens
    engine, executor, _ = make_engine()
    run_all(engine, [Request("a", prompt(1, 10), greedy(), tier=PRIORITY)])
    assert len(executor.plans) < 20


def test_several_requests_draft_in_one_step():
    lengths = [3, 40, 17, 5]
    requests = [
        Request(f"r{i}", prompt(i, n), greedy(25), tier=PRIORITY) for i, n in enumerate(lengths)
    ]
    engine, executor, draft = make_engine(
        sometimes, max_num_batched_tokens=64, max_prefill_chunk_tokens=16
    )
    out, _ = run_all(engine, requests, arrivals=[0, 0, 1, 3])
    for i, n in enumerate(lengths):
        assert out[f"r{i}"] == reference_tokens(prompt(i, n), 25)
    assert max(sum(s.num_logits > 1 for s in p.seqs) for p in executor.plans) >= 2
    assert max(len(p.seqs) for p in draft.plans) >= 2  # the draft model batched them too
    assert all(p.num_scheduled_tokens <= 64 for p in executor.plans)


def test_max_tokens_cuts_mid_draft_and_drafts_never_pass_it():
    engine, executor, _ = make_engine()
    for max_tokens in (1, 2, 3, 7):
        out, finish = run_all(
            engine, [Request(f"m{max_tokens}", prompt(2, 8), greedy(max_tokens), tier=PRIORITY)]
        )
        assert out[f"m{max_tokens}"] == reference_tokens(prompt(2, 8), max_tokens)
        assert finish[f"m{max_tokens}"] == "length"
    for seq in drafted_seqs(executor):
        assert seq.num_output_tokens + seq.num_logits <= seq.sampling_params.max_tokens


def test_eos_inside_accepted_drafts_stops_there():
    ref = reference_tokens(prompt(3, 6), 30)
    eos = ref[6]
    engine, executor, _ = make_engine()
    out, finish = run_all(
        engine, [Request("e", prompt(3, 6), greedy(), tier=PRIORITY, eos_token_ids=(eos,))]
    )
    assert out["e"] == ref[: ref.index(eos) + 1] and finish["e"] == "stop"
    # the step that produced the eos had drafts after it, which were dropped
    last = drafted_seqs(executor)[-1]
    assert last.num_output_tokens + last.num_logits > len(out["e"])
    assert engine.pool.num_running == 0 and not engine.scheduler.requests


def test_context_limit_with_drafts():
    engine, _, _ = make_engine(max_model_len=20)
    out, finish = run_all(engine, [Request("a", prompt(4, 12), greedy(50), tier=PRIORITY)])
    assert out["a"] == reference_tokens(prompt(4, 12), 8) and finish["a"] == "length"


def test_preemption_with_drafts_loses_nothing():
    engine, executor, _ = make_engine(
        sometimes,
        num_slots=2,
        speculation=SpeculationConfig(
            method="draft", tiers=(PRIORITY, ServiceTier.DEFAULT), use_measured_costs=False
        ),
    )
    long = greedy(30)
    requests = [
        Request("d1", prompt(9, 20), long),
        Request("d2", prompt(10, 20), long),
        Request("p", prompt(11, 20), greedy(12), tier=PRIORITY),
    ]
    out, finish = run_all(engine, requests, arrivals=[0, 0, 5])
    assert engine.scheduler.num_preemptions >= 1
    assert out["d1"] == reference_tokens(prompt(9, 20), 30)
    assert out["d2"] == reference_tokens(prompt(10, 20), 30)
    assert out["p"] == reference_tokens(prompt(11, 20), 12)
    assert set(finish.values()) == {"length"}


def test_abort_mid_draft_frees_the_slot():
    engine, executor, _ = make_engine(num_slots=1)
    out, finish = run_all(
        engine, [Request("a", prompt(5, 5), greedy(100), tier=PRIORITY)], abort_at={4: "a"}
    )
    assert finish["a"] == "abort"
    assert out["a"] == reference_tokens(prompt(5, 5), 100)[: len(out["a"])]
    assert engine.pool.num_running == 0 and not engine.has_work()
    assert engine.speculator._states == {}  # its speculation state is gone too
    out, _ = run_all(engine, [Request("b", prompt(6, 5), greedy(10), tier=PRIORITY)])
    assert out["b"] == reference_tokens(prompt(6, 5), 10)


def test_flex_and_default_get_no_drafts_by_default():
    engine, executor, _ = make_engine(
        speculation=SpeculationConfig(method="draft", use_measured_costs=False)
    )
    run_all(
        engine,
        [
            Request("f", prompt(7, 5), greedy(10), tier=ServiceTier.FLEX),
            Request("d", prompt(8, 5), greedy(10)),
        ],
    )
    assert not drafted_seqs(executor)
    run_all(engine, [Request("p", prompt(7, 5), greedy(10), tier=PRIORITY)])
    assert drafted_seqs(executor)


def test_adaptive_k_grows_with_acceptance_and_shrinks_without():
    speculation = SpeculationConfig(
        method="draft", max_draft_tokens=6, retry_after_steps=1000, use_measured_costs=False
    )
    engine, executor, _ = make_engine(speculation=speculation)
    run_all(engine, [Request("a", prompt(1, 10), greedy(60), tier=PRIORITY)])
    sizes = [s.num_logits - 1 for s in drafted_seqs(executor)]
    assert sizes[0] < 6 and sizes[-2] == 6 and sizes == sorted(sizes[:-1]) + sizes[-1:]
    engine, executor, _ = make_engine(lambda c: False, speculation=speculation)
    run_all(engine, [Request("a", prompt(1, 10), greedy(60), tier=PRIORITY)])
    sizes = [s.num_logits - 1 for s in drafted_seqs(executor)]
    assert sizes[0] > sizes[-1] and len(sizes) < 10  # shrank to 0 and stopped drafting
    decodes = [s for p in executor.plans for s in p.seqs if s.num_logits == 1][-5:]
    assert all(s.num_tokens == 1 for s in decodes)
    # and a request that turns unpredictable is retried after `retry_after_steps`
    speculation = SpeculationConfig(method="draft", retry_after_steps=5, use_measured_costs=False)
    engine, executor, _ = make_engine(lambda c: False, speculation=speculation)
    run_all(engine, [Request("a", prompt(1, 10), greedy(60), tier=PRIORITY)])
    assert [s.num_logits - 1 for s in drafted_seqs(executor)][-3:] == [1, 1, 1]


def test_best_draft_length_follows_acceptance_and_cost():
    from ultrafast.engine.speculation import best_draft_length

    ks = [best_draft_length(a, 16, 2e-3, 0.5e-3) for a in (0.1, 0.4, 0.6, 0.8, 0.95, 0.99)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] >= 12
    assert best_draft_length(0.8, 16, 2e-3, 0.5e-3, per_draft_s=1e-3) < ks[3]  # costly drafts
    assert best_draft_length(0.8, 3, 2e-3, 0.5e-3) <= 3


def test_priority_step_budget_still_bounds_steps_with_drafts():
    engine, executor, _ = make_engine(max_num_batched_tokens=64, max_prefill_chunk_tokens=64)
    engine.add_request(Request("p", prompt(20, 4), greedy(40), tier=PRIORITY))
    engine.step()
    engine.budget.priority_tokens = 3
    engine.budget.priority_itl_target_s = None  # keep the budget fixed for the test
    engine.add_request(Request("long", prompt(21, 60), greedy(12)))
    for _ in range(6):
        engine.step()
        assert executor.plans[-1].num_scheduled_tokens <= 3
    out, _ = run_all(engine, [])
    assert out["long"] == reference_tokens(prompt(21, 60), 12)
    # a priority stream alone is not capped: the cap protects it from other work only
    engine.add_request(Request("p2", prompt(22, 4), greedy(40), tier=PRIORITY))
    for _ in range(5):
        engine.step()
    assert max(p.num_scheduled_tokens for p in executor.plans[-4:]) > 3


class CopyingTarget(FakeExecutor):
    """A target that mostly repeats what it saw 12 tokens ago (as code does), so the n-gram
    lookup finds drafts; every 7th context breaks the pattern, so some are rejected."""

    def execute(self, plan):
        result = super().execute(plan)
        for seq in plan.seqs:
            if seq.num_logits and seq.request_id in result.sampled_token_ids:
                kv = self.slots[seq.slot_id]
                first = len(kv) - seq.num_logits + 1
                result.sampled_token_ids[seq.request_id] = [
                    self._next(kv[: first + j]) for j in range(seq.num_logits)
                ]
        return result

    def _next(self, context):
        if len(context) < 12 or next_token(context, range(7)) == 0:
            return next_token(context, self.output_ids)
        return context[-12]


def test_ngram_drafts_are_verified_exactly():
    text = prompt(1, 12) * 2
    outs = []
    for method in ("off", "ngram"):
        executor = CopyingTarget(num_slots=2)
        engine = EngineCore(
            executor,
            SchedulerConfig(max_num_seqs=2, max_model_len=256),
            speculator=Speculator(SpeculationConfig(method=method, use_measured_costs=False)),
        )
        out, _ = run_all(
            engine,
            [
                Request("a", text, greedy(60), tier=PRIORITY),
                Request("b", text[3:], greedy(50), tier=PRIORITY),
            ],
        )
        outs.append(dict(out))
    assert outs[0] == outs[1]
    assert [len(outs[1][rid]) for rid in "ab"] == [60, 50]  # no request failed
    stats = engine.speculation_stats
    assert stats.num_draft_tokens["ngram"] > 0
    assert 0.5 < stats.acceptance_rate("ngram") < 1.0
    assert len(executor.plans) < 60  # fewer steps than tokens


def test_prediction_drafts_and_usage_counts():
    ref = reference_tokens(prompt(2, 7), 20)
    prediction = ref[:3] + [1] + ref[4:11] + [2, 3] + ref[13:]  # two edits
    engine, executor, _ = make_engine(
        speculation=SpeculationConfig(method="off", use_measured_costs=False)
    )
    request = Request(
        "a", prompt(2, 7), greedy(20), tier=ServiceTier.FLEX, prediction_token_ids=prediction
    )
    engine.add_request(request)
    last = None
    while engine.has_work():
        for out in engine.step():
            last = out
    assert request.output_token_ids == ref
    assert last.finished and last.num_accepted_prediction_tokens >= 12
    assert last.num_rejected_prediction_tokens >= 2
    assert last.num_accepted_prediction_tokens == request.num_accepted_prediction_tokens


def test_prediction_aligner_follows_insertions_and_substitutions():
    from ultrafast.engine.speculation import PredictionAligner

    prediction = list(range(100, 120))
    aligner = PredictionAligner(prediction)
    assert aligner.lookup(3) == [100, 101, 102]
    output = [100, 101]
    aligner.advance([100, 101], output)
    assert aligner.lookup(2) == [102, 103]
    output += [7]  # substitution of 102
    aligner.advance([7], output)
    assert aligner.lookup(2) == [103, 104]
    output += [55, 56, 108, 109, 110]  # an insertion, then the prediction again
    aligner.advance([55, 56, 108, 109, 110], output)
    assert aligner.lookup(3) == [111, 112, 113]
    aligner.advance(list(range(111, 120)), output + list(range(111, 120)))
    assert aligner.lookup(3) == []


def test_ngram_index_finds_the_latest_earlier_occurrence():
    from ultrafast.engine.speculation import NgramIndex

    index = NgramIndex([1, 2, 3, 4, 9, 1, 2, 3, 5, 6], ngram_min=2, ngram_max=3)
    index.extend([1, 2, 3])
    assert index.lookup(2) == [5, 6]  # the latest "1 2 3" before the suffix
    index.extend([5])
    assert index.lookup(3) == [6, 1, 2]
    index.extend([8])
    assert index.lookup(3) == []  # "5 8" / "3 5 8" never occurred
    index.extend([8])
    assert index.lookup(3) == []  # "8 8": the only "8" pair is the suffix itself
    index.extend([8])
    assert index.lookup(3) == [8, 8, 8]  # "8 8" occurred before: a loop, repeated


def test_a_failing_draft_model_costs_no_request():
    engine, executor, draft = make_engine()

    def broken(plan):
        raise RuntimeError("draft model crashed")

    draft.execute = broken
    out, finish = run_all(engine, [Request("a", prompt(3, 9), greedy(15), tier=PRIORITY)])
    assert out["a"] == reference_tokens(prompt(3, 9), 15) and finish["a"] == "length"
    assert not drafted_seqs(executor)


def test_measured_step_times_override_the_line_in_sizing_k():
    from ultrafast.engine.speculation import best_draft_length

    line = (2e-3, 0.5e-3)  # the line alone: 80% acceptance drafts several tokens
    assert best_draft_length(0.8, 8, *line) >= 3
    # measured: a 2-token pass costs 1.84x a 1-token one and every wider pass more (a CPU
    # switching from its matrix-vector to its matrix kernels): at 80% drafting does not pay
    measured = [
        None,
        0.92e-3,
        1.70e-3,
        2.41e-3,
        2.93e-3,
        3.53e-3,
        4.07e-3,
        4.77e-3,
        5.09e-3,
        5.46e-3,
    ]
    assert best_draft_length(0.8, 8, *line, measured_pass_s=measured) == 0
    assert best_draft_length(0.95, 8, *line, measured_pass_s=measured) >= 5  # it does at 95%
    # a width never timed is judged by the line (so it gets tried), the rest as measured
    partial = [None, 0.92e-3, 1.70e-3]
    cheap_line = (0.3e-3, 0.3e-3)  # says 3 tokens take 1.2 ms
    assert best_draft_length(0.8, 8, *cheap_line, measured_pass_s=partial) >= 2
    assert best_draft_length(0.8, 8, *cheap_line, measured_pass_s=measured) == 0


def test_the_engine_times_lone_steps_by_their_width():
    from ultrafast.engine.step_costs import StepCostModel

    costs = StepCostModel()
    costs.observe(1, 1, 1.1e-3, pass_s=1.0e-3)
    costs.observe(1, 3, 2.6e-3, pass_s=2.5e-3)
    costs.observe(2, 2, 3.0e-3, pass_s=2.9e-3)  # two sequences: not a lone step
    costs.observe(1, 40, 9.0e-3, pass_s=8.9e-3)  # wider than the table
    assert costs.lone_pass_s[1] == 1.0e-3 and costs.lone_pass_s[3] == 2.5e-3
    assert costs.lone_pass_s[2] is None
    costs.observe(1, 1, 2.1e-3, pass_s=2.0e-3)
    assert 1.0e-3 < costs.lone_pass_s[1] < 2.0e-3  # a moving average, not the last reading


def test_no_retries_for_a_source_that_could_never_pay():
    from ultrafast.engine.speculation import Speculator

    class CostlyDraftModel:
        per_draft_s = 2e-3  # a draft costs more than the target's whole step

        def close(self):
            pass

    class Costs:  # the engine's StepCostModel, as read by the speculator
        base_s, per_token_s = 0.5e-3, 0.5e-3
        lone_pass_s = [None, 1.0e-3, 1.6e-3, 2.2e-3]

    speculation = SpeculationConfig(method="auto", retry_after_steps=4)
    speculator = Speculator(speculation, CostlyDraftModel())
    request = Request(
        "r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=500), tier=PRIORITY
    )
    speculator.admit(request)
    state = speculator._state(request)
    assert state.sources == ("ngram", "draft")
    for source in state.sources:
        state.num_accepted[source], state.num_tried[source] = 0.0, 100.0  # nothing accepted
    lengths = {
        source: [speculator._draft_length(state, source, Costs()) for _ in range(40)]
        for source in state.sources
    }
    assert lengths["ngram"].count(1) == 10  # n-gram drafts are nearly free: retried every 4
    assert lengths["draft"].count(1) == 0 and set(lengths["draft"]) == {0}


def _reference_lookup(tokens, k, ngram_min, ngram_max):
    """Prompt lookup by brute force: the longest suffix n-gram's latest earlier occurrence."""
    length = len(tokens)
    for n in range(min(ngram_max, length), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                draft = tokens[end : end + k]
                while len(draft) < k:
                    draft.append(draft[len(draft) - (length - end)])
                return draft
    return []


def test_ngram_index_matches_brute_force_as_it_grows():
    import random

    from ultrafast.engine.speculation import NgramIndex

    rng = random.Random(7)
    for _trial in range(30):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        ngram_min, ngram_max = rng.choice([(1, 4), (2, 3), (1, 1), (3, 5)])
        index = NgramIndex(tokens, ngram_min, ngram_max)
        for _ in range(25):
            k = rng.randrange(1, 6)
            assert index.lookup(k) == _reference_lookup(tokens, k, ngram_min, ngram_max)
            new = [rng.randrange(6) for _ in range(rng.choice([1, 1, 1, 3]))]
            tokens += new
            index.extend(new)


def test_a_conversations_next_turn_takes_over_the_previous_index():
    from ultrafast.engine.speculation import NgramIndex, Speculator

    speculator = Speculator(SpeculationConfig(method="ngram", use_measured_costs=False))
    params = SamplingParams(temperature=0.0, max_tokens=50)

    def start(request_id, prompt, tenant="a"):
        request = Request(request_id, prompt, params, tier=PRIORITY, tenant=tenant)
        speculator.admit(request)
        return request, speculator._state(request)

    turn1, state1 = start("t1", [5, 6, 7, 8, 5, 6])
    turn1.output_token_ids += [7, 9, 9]
    turn1.num_computed_tokens = turn1.num_tokens - 1  # decoding: propose folds the output in
    speculator.propose([turn1])
    first_index = state1.ngram
    assert first_index.tokens == turn1.prompt_token_ids + turn1.output_token_ids
    speculator.release("t1")
    history = turn1.prompt_token_ids + turn1.output_token_ids
    _, other = start("x", history + [1, 2], tenant="b")  # another tenant: a fresh index
    assert other.ngram is not first_index
    turn2, state2 = start("t2", history + [3, 5, 6])
    assert state2.ngram is first_index  # taken over, extended with the new tokens
    fresh = NgramIndex(turn2.prompt_token_ids, 1, 4)
    for k in (1, 3, 6):
        assert (
            state2.ngram.lookup(k)
            == fresh.lookup(k)
            == _reference_lookup(turn2.prompt_token_ids, k, 1, 4)
        )
    _, state3 = start("t3", [9, 9, 9, 1])  # starts otherwise: nothing to take
    assert state3.ngram is not first_index
