"""Prompt logprobs through the engine contract: the scheduler asks for scoring rows, files what
comes back by position and hands it out once; the fake executor and the row splitter fill them.

The scheduler tests build StepResults by hand (no executor), so every figure is known.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.core.kv_pool import KVSlotPool
from ultrafast.core.scheduler import Scheduler, SchedulerConfig
from ultrafast.core.types import RequestOutput, ScheduledSeq, StepPlan, StepResult, TokenLogprobs
from ultrafast.engine.core import EngineCore
from ultrafast.executors.fake_exec import FakeExecutor, next_token
from ultrafast.executors.fake_scoring import reference_prompt_logprobs
from ultrafast.executors.prompt_scoring import split_prompt_rows
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.server.bridge import merge_outputs

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


def scoring(max_tokens=0, top=1, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=True, prompt_logprobs=top, **kw
    )


def make_scheduler(chunk=4, num_slots=2, max_num_seqs=2) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            max_prefill_chunk_tokens=chunk,
            max_model_len=64,
        ),
        KVSlotPool(num_slots),
    )


def answer(plan: StepPlan, sampled=7) -> StepResult:
    """A StepResult by hand: row j of a sequence scores its token with logprob -(position)."""
    result = StepResult()
    for seq in plan.seqs:
        first = seq.start_position + 1
        result.prompt_logprobs[seq.request_id] = [
            TokenLogprobs(seq.prompt_token_ids[first + j], -float(first + j), [(0, -0.5)])
            for j in range(seq.num_prompt_logits)
        ]
        if seq.num_logits:
            result.sampled_token_ids[seq.request_id] = [sampled] * seq.num_logits
            result.logprobs[seq.request_id] = [TokenLogprobs(sampled, -0.25)] * seq.num_logits
    return result


def update(sched: Scheduler, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
    """The outputs of Scheduler.update (the one place that knows its return type)."""
    return sched.update(plan, result).outputs


def run(sched: Scheduler, answer_fn=answer) -> list[RequestOutput]:
    outputs = []
    while sched.has_work():
        plan = sched.schedule()
        outputs += update(sched, plan, answer_fn(plan))
    return outputs


def test_scoring_rows_cover_every_prompt_token_once_and_max_tokens_0_generates_nothing():
    sched = make_scheduler(chunk=4)
    sched.add_request(Request("r", list(PROMPT), scoring()))
    plans, outputs = [], []
    while sched.has_work():
        plans.append(sched.schedule())
        outputs += update(sched, plans[-1], answer(plans[-1]))
    seqs = [p.seqs[0] for p in plans]
    assert [(s.start_position, s.num_tokens, s.num_prompt_logits, s.num_logits) for s in seqs] == [
        (0, 4, 4, 0),
        (4, 4, 4, 0),
        (8, 2, 1, 0),
    ]
    (out,) = outputs
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    assert [e.token_id for e in out.prompt_logprobs[1:]] == PROMPT[1:]
    assert [e.logprob for e in out.prompt_logprobs[1:]] == [-float(i) for i in range(1, 10)]


def test_prompt_logprobs_come_with_the_first_token_only():
    sched = make_scheduler(chunk=64)
    sched.add_request(Request("r", list(PROMPT), scoring(max_tokens=3)))
    outputs = run(sched)
    plan_rows = [o.prompt_logprobs for o in outputs]
    assert plan_rows[0] is not None and len(plan_rows[0]) == len(PROMPT)
    assert plan_rows[1:] == [None, None]
    assert [o.new_token_ids for o in outputs] == [[7], [7], [7]]


def test_a_prompt_of_one_token_scores_nothing_but_still_answers():
    sched = make_scheduler()
    sched.add_request(Request("r", [5], scoring(max_tokens=1)))
    (out,) = run(sched)
    assert out.prompt_logprobs == [None] and out.new_token_ids == [7]


def test_missing_prompt_logprobs_fail_the_request_alone():
    sched = make_scheduler(chunk=64)
    sched.add_request(Request("scored", list(PROMPT), scoring(max_tokens=2)))
    sched.add_request(Request("plain", list(PROMPT), SamplingParams(max_tokens=2, temperature=0.0)))

    def forgetful(plan):
        result = answer(plan)
        result.prompt_logprobs.clear()
        return result

    outputs = run(sched, forgetful)
    scored = [o for o in outputs if o.request_id == "scored"]
    assert scored[-1].finish_reason == "error" and "prompt logprobs" in scored[-1].error
    assert scored[-1].prompt_logprobs is None
    plain = [o for o in outputs if o.request_id == "plain"]
    assert plain[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in plain) == 2


def test_a_scoring_request_takes_no_cached_prefix():
    sched = make_scheduler(chunk=64)
    long_prompt = list(range(1, 41))
    sched.add_request(Request("warm", list(long_prompt), SamplingParams(max_tokens=1)))
    run(sched)
    sched.add_request(Request("again", list(long_prompt), SamplingParams(max_tokens=1)))
    plan = sched.schedule()
    assert plan.seqs[0].start_position > 0  # a plain request reuses the cached prefix
    update(sched, plan, answer(plan))
    run(sched)
    sched.add_request(Request("scored", list(long_prompt), scoring()))
    plan = sched.schedule()
    assert plan.seqs[0].start_position == 0 and not plan.kv_copies
    assert plan.seqs[0].num_prompt_logits == len(long_prompt) - 1


def test_preempted_mid_prefill_rescores_from_the_start():
    sched = make_scheduler(chunk=4, num_slots=1, max_num_seqs=1)
    sched.add_request(Request("low", list(PROMPT), scoring(), tier=ServiceTier.FLEX))
    plan = sched.schedule()
    update(sched, plan, answer(plan))  # 4 of 10 prompt tokens scored
    sched.add_request(
        Request("high", [1, 2, 3], SamplingParams(max_tokens=1), tier=ServiceTier.PRIORITY)
    )
    outputs = run(sched)
    assert sched.num_preemptions == 1
    (low,) = [o for o in outputs if o.request_id == "low"]
    assert [e.logprob for e in low.prompt_logprobs[1:]] == [-float(i) for i in range(1, 10)]


def test_max_tokens_0_needs_prompt_scoring():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(max_tokens=0, prompt_logprobs=21)
    assert not SamplingParams(temperature=0.0, prompt_logprobs=0).plain_greedy


def test_fake_executor_scores_the_prompt_like_its_reference():
    executor = FakeExecutor.for_tokenizer(
        DEMO_MODEL_DIR / "tokenizer.json", num_slots=2, step_s=0.0
    )
    engine = EngineCore(
        executor,
        SchedulerConfig(
            max_num_seqs=2, max_num_batched_tokens=32, max_prefill_chunk_tokens=8, max_model_len=128
        ),
    )
    words = executor.output_ids
    prompt = [words[0], words[1]]
    for i in range(6):  # alternately the fake model's own next token and one it would not pick
        predicted = next_token(prompt, words)
        prompt.append(predicted if i % 2 else next(w for w in words if w != predicted))
    request = Request("r", list(prompt), scoring(max_tokens=0, top=1))
    engine.add_request(request)
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    (out,) = outputs
    expected = reference_prompt_logprobs(prompt, lambda context: next_token(context, words))
    assert [None if e is None else e.logprob for e in out.prompt_logprobs] == expected
    assert 0.0 in expected and any(v is not None and v < 0 for v in expected)


@pytest.mark.parametrize("as_numpy", [True, False])
def test_split_prompt_rows_scores_rows_and_keeps_the_sampled_ones(as_numpy):
    torch.manual_seed(0)
    logits = torch.randn(7, 11)
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    seqs = [  # a: 3 scoring rows then 1 sampled; b: sampled only; c: 2 scoring rows
        ScheduledSeq("a", 0, [1, 2, 3, 4], 0, 1, params, 0, 0, [1, 2, 3, 4], num_prompt_logits=3),
        ScheduledSeq("b", 1, [9], 5, 1, SamplingParams(), 0, 0, [9] * 6),
        ScheduledSeq("c", 2, [5, 6], 2, 0, params, 0, 0, [0, 0, 5, 6, 7], num_prompt_logits=2),
    ]
    sampled, scores = split_prompt_rows(seqs, logits.numpy() if as_numpy else logits)
    assert np.allclose(np.asarray(sampled), logits[[3, 4]].numpy())
    reference = torch.log_softmax(logits, dim=-1)
    for rid, rows, targets in (("a", [0, 1, 2], [2, 3, 4]), ("c", [5, 6], [6, 7])):
        entries = scores[rid]
        assert [e.token_id for e in entries] == targets
        for entry, row, target in zip(entries, rows, targets):
            assert entry.logprob == pytest.approx(reference[row, target].item(), abs=1e-6)
            top_ids = torch.topk(reference[row], 2).indices.tolist()
            assert [t for t, _ in entry.top] == top_ids
    assert "b" not in scores
    with pytest.raises(ValueError):
        split_prompt_rows(seqs, logits[:6])


def test_a_merged_stream_output_keeps_the_prompt_logprobs():
    entries = [None, TokenLogprobs(3, -1.0)]
    first = RequestOutput("r", [1], prompt_logprobs=entries)
    merged = merge_outputs(first, RequestOutput("r", [2]))
    assert merged.new_token_ids == [1, 2] and merged.prompt_logprobs is entries
