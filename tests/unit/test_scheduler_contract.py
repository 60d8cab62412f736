"""The scheduler alone, at the contract: schedule() gives a StepPlan, a hand-built StepResult goes
into update(), and the outputs, the verification records and the scheduler/pool state are
checked exactly. No executor, no engine, no speculator."""

import pytest

from ultrafast.core.kv_pool import KVSlotPool
from ultrafast.core.scheduler import Scheduler, SchedulerConfig
from ultrafast.core.types import Draft, DraftVerification, StepPlan, StepResult
from ultrafast.request import Request, RequestStatus, SamplingParams, ServiceTier

PRIORITY, DEFAULT = ServiceTier.PRIORITY, ServiceTier.DEFAULT


def make(num_slots=2, **overrides):
    pool = KVSlotPool(num_slots)
    config = SchedulerConfig(**{"max_num_seqs": num_slots, "max_model_len": 64, **overrides})
    return Scheduler(config, pool), pool


def request(rid, prompt, max_tokens=8, tier=DEFAULT, arrival_s=1.0, eos=()):
    return Request(
        rid,
        list(prompt),
        SamplingParams(temperature=0.0, max_tokens=max_tokens),
        tier=tier,
        arrival_time_s=arrival_s,
        eos_token_ids=eos,
    )


def seqs(plan):
    """(request id, slot, tokens fed, start position, logits wanted) per scheduled sequence."""
    return [
        (s.request_id, s.slot_id, s.token_ids, s.start_position, s.num_logits) for s in plan.seqs
    ]


def sampled(**tokens):
    return StepResult(sampled_token_ids=tokens)


def new_tokens(outcome):
    return {o.request_id: o.new_token_ids for o in outcome.outputs}


def to_decoding(sched, rid, first_token):
    """Run the steps that prefill `rid` alone; its first output is `first_token`."""
    while True:
        plan = sched.schedule()
        (seq,) = [s for s in plan.seqs if s.request_id == rid]
        result = sampled(**{rid: [first_token]}) if seq.num_logits else StepResult()
        sched.update(plan, result)
        if seq.num_logits:
            return


def test_chunked_prefill_shares_the_budget_and_decodes_go_first():
    sched, pool = make(max_prefill_chunk_tokens=4, max_num_batched_tokens=6)
    sched.add_request(request("a", range(10, 20), arrival_s=1.0))
    sched.add_request(request("b", [30, 31, 32], arrival_s=2.0))

    plan = sched.schedule()
    assert seqs(plan) == [("a", 0, [10, 11, 12, 13], 0, 0), ("b", 1, [30, 31], 0, 0)]
    outcome = sched.update(plan, StepResult())
    assert outcome.outputs == [] and outcome.verifications == []
    assert pool.slots[0].num_computed == 4 and pool.slots[1].num_computed == 2

    # b has one token left (a decode-like step) and goes before a's prefill chunk
    plan = sched.schedule()
    assert seqs(plan) == [("b", 1, [32], 2, 1), ("a", 0, [14, 15, 16, 17], 4, 0)]
    outcome = sched.update(plan, sampled(b=[7]))
    assert new_tokens(outcome) == {"b": [7]}
    assert outcome.outputs[0].num_output_tokens == 1 and not outcome.outputs[0].finished

    plan = sched.schedule()
    assert seqs(plan) == [("b", 1, [7], 3, 1), ("a", 0, [18, 19], 8, 1)]
    outcome = sched.update(plan, sampled(a=[40], b=[8]))
    assert new_tokens(outcome) == {"a": [40], "b": [8]}
    assert sched.requests["a"].num_computed_tokens == 10
    assert sched.requests["a"].output_token_ids == [40]


def test_eos_and_max_tokens_finish_and_free_the_slot():
    sched, pool = make()
    sched.add_request(request("e", [1, 2, 3], eos=(99,)))
    sched.add_request(request("m", [4, 5], max_tokens=2, arrival_s=2.0))
    plan = sched.schedule()
    assert seqs(plan) == [("e", 0, [1, 2, 3], 0, 1), ("m", 1, [4, 5], 0, 1)]
    outcome = sched.update(plan, sampled(e=[10], m=[20]))
    assert [o.finished for o in outcome.outputs] == [False, False]

    plan = sched.schedule()
    assert seqs(plan) == [("e", 0, [10], 3, 1), ("m", 1, [20], 2, 1)]
    outcome = sched.update(plan, sampled(e=[99], m=[21]))
    finished = {
        o.request_id: (o.finish_reason, o.new_token_ids, o.num_output_tokens)
        for o in outcome.outputs
        if o.finished
    }
    assert finished == {"e": ("stop", [99], 2), "m": ("length", [21], 2)}
    assert pool.num_running == 0 and not sched.requests and not sched.running
    assert not sched.has_work()
    # the slots keep the computed tokens as a cached prefix
    assert pool.slots[0].token_ids == [1, 2, 3, 10, 99] and pool.slots[0].num_computed == 4


def test_drafts_ride_a_decode_and_only_the_agreed_prefix_is_kept():
    sched, _ = make()
    sched.add_request(request("a", [1, 2, 3], max_tokens=20))
    to_decoding(sched, "a", 10)
    plan = sched.schedule(drafts={"a": Draft([5, 6, 7], None, "ngram")})
    assert seqs(plan) == [("a", 0, [10, 5, 6, 7], 3, 4)]
    assert plan.draft_sources == {"a": "ngram"}
    # the target agrees with 5 and 6, then says 9 where the draft said 7: verification stops
    outcome = sched.update(plan, sampled(a=[5, 6, 9]))
    assert new_tokens(outcome) == {"a": [5, 6, 9]}
    assert outcome.verifications == [DraftVerification("a", "ngram", 3, 2)]
    a = sched.requests["a"]
    assert a.output_token_ids == [10, 5, 6, 9]
    assert a.num_computed_tokens == 6  # prompt + 10, 5, 6; the rejected 7 is overwritten
    assert (a.num_draft_tokens, a.num_accepted_draft_tokens) == (3, 2)

    # the next step starts where the rejected draft was
    plan = sched.schedule(drafts={"a": Draft([1, 2], None, "prediction")})
    assert seqs(plan) == [("a", 0, [9, 1, 2], 6, 3)]
    outcome = sched.update(plan, sampled(a=[1, 2, 3]))  # all accepted, plus a bonus token
    assert new_tokens(outcome) == {"a": [1, 2, 3]}
    assert outcome.verifications == [DraftVerification("a", "prediction", 2, 2)]
    out = outcome.outputs[0]
    assert (out.num_accepted_prediction_tokens, out.num_rejected_prediction_tokens) == (2, 0)

    # no draft this step: a plain decode, nothing to verify
    plan = sched.schedule()
    assert seqs(plan) == [("a", 0, [3], 9, 1)] and plan.draft_sources == {}
    assert sched.update(plan, sampled(a=[4])).verifications == []


def test_drafts_stop_at_max_tokens_and_a_stop_inside_them_cuts_the_rest():
    sched, _ = make()
    sched.add_request(request("a", [1, 2, 3], max_tokens=4, eos=(5,)))
    to_decoding(sched, "a", 10)
    plan = sched.schedule(drafts={"a": Draft([5, 6, 7, 8, 9], None, "draft")})
    # one output so far, max_tokens 4: at most 2 drafts (+ the target's own token); a request
    # of so few decodes is placed from the top of the pool (slot 1 of 2)
    assert seqs(plan) == [("a", 1, [10, 5, 6], 3, 3)]
    outcome = sched.update(plan, sampled(a=[5, 6, 8]))  # both drafts agree, but 5 is eos
    (out,) = outcome.outputs
    assert (out.new_token_ids, out.finish_reason) == ([5], "stop")
    assert outcome.verifications == [DraftVerification("a", "draft", 2, 1)]  # 6 is not output


def test_drafts_for_a_prefilling_request_are_ignored():
    sched, _ = make(max_prefill_chunk_tokens=2)
    sched.add_request(request("a", [1, 2, 3, 4]))
    plan = sched.schedule(drafts={"a": Draft([5, 6], None, "ngram")})
    assert seqs(plan) == [("a", 0, [1, 2], 0, 0)] and plan.draft_sources == {}


def test_an_error_fails_one_request_and_frees_its_slot():
    sched, pool = make()
    sched.add_request(request("a", [1, 2]))
    sched.add_request(request("b", [3, 4], arrival_s=2.0))
    plan = sched.schedule()
    outcome = sched.update(plan, StepResult(sampled_token_ids={"a": [7]}, errors={"b": "boom"}))
    by_id = {o.request_id: o for o in outcome.outputs}
    assert (by_id["b"].finished, by_id["b"].finish_reason, by_id["b"].error) == (
        True,
        "error",
        "boom",
    )
    assert by_id["b"].new_token_ids == [] and by_id["a"].new_token_ids == [7]
    assert pool.num_running == 1 and list(sched.requests) == ["a"]
    assert seqs(sched.schedule()) == [("a", 0, [7], 2, 1)]


def test_a_priority_arrival_preempts_the_newest_default_request_which_resumes():
    sched, pool = make()
    sched.add_request(request("a", [1, 2], arrival_s=1.0))
    sched.add_request(request("b", [3, 4], arrival_s=2.0))
    sched.update(sched.schedule(), sampled(a=[10], b=[20]))
    sched.add_request(request("p", [5, 6, 7], max_tokens=1, tier=PRIORITY, arrival_s=3.0))

    plan = sched.schedule()
    b = sched.requests["b"]
    assert (b.status, b.slot_id, b.num_computed_tokens, b.num_preemptions) == (
        RequestStatus.PREEMPTED,
        None,
        0,
        1,
    )
    assert sched.num_preemptions == 1 and list(sched.waiting[DEFAULT]) == [b]
    # a default decode still goes first; the priority prefill takes b's slot
    assert seqs(plan) == [("a", 0, [10], 2, 1), ("p", 1, [5, 6, 7], 0, 1)]
    outcome = sched.update(plan, sampled(a=[11], p=[30]))
    assert {o.request_id: o.finish_reason for o in outcome.outputs} == {"a": None, "p": "length"}

    # b recomputes its prompt and its output so far, and carries on with no token lost
    plan = sched.schedule()
    assert seqs(plan) == [("a", 0, [11], 3, 1), ("b", 1, [3, 4, 20], 0, 1)]
    outcome = sched.update(plan, sampled(a=[12], b=[21]))
    assert new_tokens(outcome) == {"a": [12], "b": [21]}
    assert b.output_token_ids == [20, 21] and pool.num_running == 2


def test_abort_frees_the_slot_and_drops_the_tokens_of_a_step_in_flight():
    sched, pool = make()
    sched.add_request(request("a", [1, 2]))
    sched.update(sched.schedule(), sampled(a=[10]))
    plan = sched.schedule()
    sched.abort("a")  # while the step runs
    assert pool.num_running == 0 and not sched.running and sched.has_work()
    outcome = sched.update(plan, sampled(a=[11]))
    (out,) = outcome.outputs
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("a", [], "abort")
    assert not sched.has_work() and sched.schedule().is_empty
    sched.abort("a")  # unknown by now: nothing happens
    assert sched.update(StepPlan(), StepResult()).outputs == []


def test_the_priority_token_budget_caps_steps_with_company_only():
    sched, _ = make(max_num_batched_tokens=64, max_prefill_chunk_tokens=64)
    sched.add_request(request("p", [1, 2], max_tokens=30, tier=PRIORITY))
    to_decoding(sched, "p", 10)
    # alone, a priority stream is not capped: its drafts may use the whole budget
    plan = sched.schedule(
        drafts={"p": Draft([1, 2, 3, 4, 5], None, "ngram")}, priority_token_budget=3
    )
    assert seqs(plan) == [("p", 0, [10, 1, 2, 3, 4, 5], 2, 6)]
    sched.update(plan, sampled(p=[7]))  # the first draft is rejected

    sched.add_request(request("d", list(range(20, 40)), arrival_s=2.0))
    plan = sched.schedule(
        drafts={"p": Draft([1, 2, 3, 4, 5], None, "ngram")}, priority_token_budget=3
    )
    assert seqs(plan) == [("p", 0, [7, 1, 2], 3, 3)]  # the drafts fill the cap: d waits
    sched.update(plan, sampled(p=[8]))
    plan = sched.schedule(priority_token_budget=3)
    assert seqs(plan) == [("p", 0, [8], 4, 1), ("d", 1, [20, 21], 0, 0)]
    sched.update(plan, sampled(p=[9]))
    plan = sched.schedule()  # no cap given: d gets the rest of its prompt at once
    assert seqs(plan) == [("p", 0, [9], 5, 1), ("d", 1, list(range(22, 40)), 2, 1)]


def test_reserved_priority_seats_are_set_through_the_setter_only():
    sched, _ = make(num_slots=3)
    sched.set_reserved_priority_seats({"acme": 2})
    assert sched.reserved_priority_seats == {"acme": 2}
    with pytest.raises(AttributeError):
        sched.reserved_priority_seats = {}
    with pytest.raises(ValueError):
        sched.set_reserved_priority_seats({"acme": -1})
    # another tenant's priority request may take only the seat acme does not hold
    for i, tenant in enumerate(["other", "other", "acme"]):
        r = request(f"r{i}", [1, 2], tier=PRIORITY, arrival_s=1.0 + i)
        r.tenant = tenant
        sched.add_request(r)
    assert [s.request_id for s in sched.schedule().seqs] == ["r0", "r2"]


def test_the_default_token_budget_keeps_every_decode_and_some_prefill():
    from ultrafast.core.scheduler import MIN_PREFILL_TOKENS

    sched, _ = make(num_slots=4, max_num_batched_tokens=512, max_prefill_chunk_tokens=256)
    for rid in ("a", "b"):
        sched.add_request(request(rid, [1, 2], max_tokens=30))
    sched.update(sched.schedule(), sampled(a=[10], b=[10]))  # both prefilled in one step
    sched.add_request(request("long", list(range(100, 160)), arrival_s=2.0))
    plan = sched.schedule(token_budget=5)  # below the decodes + the prefill floor
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [
        ("a", 1),
        ("b", 1),
        ("long", MIN_PREFILL_TOKENS),
    ]
    sched.update(plan, sampled(a=[11], b=[12]))
    plan = sched.schedule(token_budget=2 + 10)  # the floor again: the prompt's last 28 tokens
    assert [(s.request_id, s.num_tokens) for s in plan.seqs][2] == ("long", 60 - MIN_PREFILL_TOKENS)
    sched.add_request(request("next", list(range(200, 250)), arrival_s=3.0))
    sched.update(plan, sampled(a=[13], b=[14], long=[15]))
    plan = sched.schedule(token_budget=3 + 40)  # three decodes now, 40 tokens of prefill
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [
        ("a", 1),
        ("b", 1),
        ("long", 1),
        ("next", 40),
    ]
    sched.update(plan, sampled(a=[16], b=[17], long=[18]))
    plan = sched.schedule()  # no cap: the rest of the prompt at once
    assert [(s.request_id, s.num_tokens) for s in plan.seqs][3] == ("next", 10)


def test_a_priority_prefill_is_never_starved_by_the_step_caps():
    """Both caps are lifted while a priority request has prompt left to compute: its prefill
    comes after the default decodes in the phase order, so a capped step would give it
    nothing while the default streams run."""
    sched, _ = make(num_slots=4, max_num_batched_tokens=512, max_prefill_chunk_tokens=40)
    for rid in ("a", "b"):
        sched.add_request(request(rid, [1, 2], max_tokens=30))
    sched.update(sched.schedule(), sampled(a=[10], b=[10]))
    sched.add_request(request("p", list(range(100, 160)), tier=PRIORITY, arrival_s=2.0))
    plan = sched.schedule(priority_token_budget=2, token_budget=3)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("a", 1), ("b", 1), ("p", 40)]
    sched.update(plan, sampled(a=[11], b=[12]))
    plan = sched.schedule(priority_token_budget=2, token_budget=3)  # 20 prompt tokens left
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("a", 1), ("b", 1), ("p", 20)]
    sched.update(plan, sampled(a=[13], b=[14], p=[15]))
    plan = sched.schedule(priority_token_budget=2, token_budget=3)  # p decodes: capped now
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [("p", 1), ("a", 1)]


def test_a_priority_request_held_back_by_committed_seats_does_not_lift_the_caps():
    from ultrafast.core.scheduler import MIN_PREFILL_TOKENS

    sched, _ = make(num_slots=4, max_num_batched_tokens=512, max_prefill_chunk_tokens=256)
    sched.set_reserved_priority_seats({"acme": 3})  # other tenants share one priority seat
    first = request("o1", [1, 2], max_tokens=30, tier=PRIORITY)
    first.tenant = "other"
    sched.add_request(first)
    sched.add_request(request("a", [1, 2], max_tokens=30))
    sched.update(sched.schedule(), sampled(o1=[10], a=[10]))
    second = request("o2", [3, 4, 5], tier=PRIORITY, arrival_s=2.0)
    second.tenant = "other"  # no seat for it while o1 runs: it cannot prefill
    sched.add_request(second)
    sched.add_request(request("long", list(range(100, 160)), arrival_s=3.0))
    plan = sched.schedule(token_budget=3)
    assert [(s.request_id, s.num_tokens) for s in plan.seqs] == [
        ("o1", 1),
        ("a", 1),
        ("long", MIN_PREFILL_TOKENS),
    ]
