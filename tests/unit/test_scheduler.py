"""Scheduler + KV pool against the fake executor: batching, chunking, tiers, preemption, aborts."""

import collections

import pytest

from tests.unit.engine_driver import prompt, run_all
from ultrafast.config import EngineConfig
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.executors.fake_exec import FakeExecutor, reference_tokens
from ultrafast.request import Request, SamplingParams, ServiceTier

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_engine(num_slots=4, **overrides):
    executor = FakeExecutor(num_slots=num_slots)
    config = SchedulerConfig(**{"max_num_seqs": num_slots, "max_model_len": 256, **overrides})
    return EngineCore(executor, config), executor


def test_single_request_matches_reference():
    engine, _ = make_engine()
    out, finish = run_all(engine, [Request("a", prompt(1, 10), GREEDY)])
    assert out["a"] == reference_tokens(prompt(1, 10), 12)
    assert finish["a"] == "length"


def test_concurrent_requests_equal_each_alone():
    lengths = [3, 40, 17, 70, 5, 33]
    requests = [Request(f"r{i}", prompt(i, n), GREEDY) for i, n in enumerate(lengths)]
    engine, executor = make_engine(max_num_batched_tokens=32, max_prefill_chunk_tokens=16)
    out, _ = run_all(engine, requests, arrivals=[0, 0, 2, 3, 9, 9])
    for i, n in enumerate(lengths):
        assert out[f"r{i}"] == reference_tokens(prompt(i, n), 12)
    assert max(len(p.seqs) for p in executor.plans) > 1  # they really were batched
    assert all(p.num_scheduled_tokens <= 32 for p in executor.plans)
    assert all(len(s.token_ids) <= 16 for p in executor.plans for s in p.seqs)


def test_long_prompt_is_chunked_and_samples_only_at_the_end():
    engine, executor = make_engine(max_num_batched_tokens=64, max_prefill_chunk_tokens=20)
    out, _ = run_all(engine, [Request("a", prompt(2, 50), GREEDY)])
    chunks = [s for p in executor.plans for s in p.seqs]
    assert [len(s.token_ids) for s in chunks[:3]] == [20, 20, 10]
    assert [s.num_logits for s in chunks[:3]] == [0, 0, 1]
    assert out["a"] == reference_tokens(prompt(2, 50), 12)


def test_by_default_long_prompts_prefill_one_after_another():
    """The default chunk is the whole step budget: of two long prompts that arrive together
    the first takes every prefill token until its last chunk, so its first token comes after
    half the work instead of both coming at the end (in lockstep chunks of half the budget,
    4 x 1,000-token prompts on the AMX Xeon: first tokens 1.24 / 1.24 / 2.74 / 2.74 s against
    0.65 / 1.44 / 2.19 / 2.91 s)."""
    config = SchedulerConfig()
    assert config.max_prefill_chunk_tokens == config.max_num_batched_tokens
    served = EngineConfig(model="m")  # the server's engine: the same defaults
    assert served.prefill_chunk_tokens == served.max_num_batched_tokens == 1024
    wider = EngineConfig(model="m", max_num_batched_tokens=2048)  # the chunk follows the budget
    assert wider.prefill_chunk_tokens == 2048
    executor = FakeExecutor(num_slots=4, max_model_len=2048)
    engine = EngineCore(executor, SchedulerConfig(max_num_seqs=4, max_model_len=2048))
    long_prompt = config.max_num_batched_tokens + 100
    engine.add_request(Request("a", prompt(6, long_prompt), GREEDY))
    engine.add_request(Request("b", prompt(7, long_prompt), GREEDY))
    engine.step()
    engine.step()
    first, second = ([(s.request_id, s.num_tokens) for s in p.seqs] for p in executor.plans)
    assert first == [("a", config.max_num_batched_tokens)]
    assert second == [("a", 100), ("b", config.max_num_batched_tokens - 100)]


def test_decodes_go_before_new_prefill_and_priority_first():
    engine, executor = make_engine(max_num_batched_tokens=8, max_prefill_chunk_tokens=8)
    engine.add_request(Request("d", prompt(3, 4), GREEDY))
    engine.step()  # d prefilled, now decoding
    engine.add_request(Request("long", prompt(4, 30), GREEDY))
    engine.add_request(Request("p", prompt(5, 4), GREEDY, tier=ServiceTier.PRIORITY))
    engine.step()
    seqs = executor.plans[-1].seqs
    assert seqs[0].request_id == "d" and seqs[0].num_tokens == 1
    assert seqs[1].request_id == "p"  # priority prefill before the default prefill
    assert sum(s.num_tokens for s in seqs) <= 8


def test_one_pass_per_length_keeps_other_lengths_out_of_priority_steps():
    engine, executor = make_engine(one_pass_per_length=True)
    tokens = collections.defaultdict(list)

    def step() -> list[str]:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        return [s.request_id for s in executor.plans[-1].seqs]

    engine.add_request(Request("d", prompt(3, 4), GREEDY))
    step()  # d prefilled, now decoding
    engine.add_request(Request("p", prompt(5, 4), GREEDY, tier=ServiceTier.PRIORITY))
    assert step() == ["p"]  # its prefill runs alone
    assert step() == ["p", "d"]  # both decode: one length, one pass
    engine.add_request(Request("late", prompt(6, 9), GREEDY))
    assert "late" not in step()  # a default prefill waits while the priority request decodes
    while engine.has_work():
        step()
    assert tokens["d"] == reference_tokens(prompt(3, 4), 12)
    assert tokens["p"] == reference_tokens(prompt(5, 4), 12)
    assert tokens["late"] == reference_tokens(prompt(6, 9), 12)


def test_prefix_cache_reuses_finished_request_kv():
    engine, executor = make_engine()
    shared = prompt(6, 40)
    run_all(engine, [Request("a", shared + [1, 2], GREEDY)])
    out, _ = run_all(engine, [Request("b", shared + [3], GREEDY)])
    first = next(s for p in executor.plans for s in p.seqs if s.request_id == "b")
    assert first.start_position == 40  # two 16-token blocks, then the 8 shared tokens after them
    assert out["b"] == reference_tokens(shared + [3], 12)


def test_a_conversation_keeps_its_kv_when_another_shares_only_its_system_prompt():
    engine, executor = make_engine(num_slots=2)
    system = prompt(8, 16)  # one block shared by both conversations
    a1 = system + prompt(9, 30)
    out, _ = run_all(engine, [Request("a1", a1, GREEDY)])
    out.update(run_all(engine, [Request("b1", system + prompt(10, 20), GREEDY)])[0])
    a2 = a1 + out["a1"] + prompt(11, 5)  # a's next turn: history, answer, new text
    out.update(run_all(engine, [Request("a2", a2, GREEDY)])[0])
    first = {s.request_id: s for p in reversed(executor.plans) for s in p.seqs}
    assert first["b1"].start_position == 16  # the system prompt, copied into the free slot
    assert first["a2"].start_position == len(a1) + 12 - 1  # all of a's computed history
    for rid, tokens in (("a1", a1), ("b1", system + prompt(10, 20)), ("a2", a2)):
        assert out[rid] == reference_tokens(tokens, 12)


def test_prefix_cache_is_isolated_per_tenant():
    engine, executor = make_engine()
    shared = prompt(7, 40)
    run_all(engine, [Request("a", shared, GREEDY, tenant="alice")])
    run_all(engine, [Request("b", shared, GREEDY, tenant="bob")])
    first = next(s for p in executor.plans for s in p.seqs if s.request_id == "b")
    assert first.start_position == 0


def test_prefix_copied_from_a_running_request():
    engine, executor = make_engine(
        num_slots=2, max_num_batched_tokens=64, max_prefill_chunk_tokens=64
    )
    shared = prompt(8, 36)
    engine.add_request(Request("a", shared, SamplingParams(temperature=0.0, max_tokens=40)))
    engine.step()
    engine.add_request(Request("b", shared + [5], GREEDY))
    out, _ = run_all(engine, [])
    assert any(p.kv_copies for p in executor.plans)
    assert engine.scheduler.requests == {}


def test_priority_preempts_default_and_nothing_is_lost():
    engine, executor = make_engine(num_slots=2)
    long_params = SamplingParams(temperature=0.0, max_tokens=30)
    requests = [
        Request("d1", prompt(9, 20), long_params),
        Request("d2", prompt(10, 20), long_params),
        Request("p", prompt(11, 20), GREEDY, tier=ServiceTier.PRIORITY),
    ]
    out, finish = run_all(engine, requests, arrivals=[0, 0, 5])
    assert engine.scheduler.num_preemptions >= 1
    assert out["d1"] == reference_tokens(prompt(9, 20), 30)
    assert out["d2"] == reference_tokens(prompt(10, 20), 30)
    assert out["p"] == reference_tokens(prompt(11, 20), 12)
    assert set(finish.values()) == {"length"}


def test_flex_yields_to_default():
    engine, executor = make_engine(num_slots=1)
    requests = [
        Request("f", prompt(12, 5), GREEDY, tier=ServiceTier.FLEX),
        Request("d", prompt(13, 5), GREEDY),
    ]
    out, _ = run_all(engine, requests)
    first = executor.plans[0].seqs[0].request_id
    assert first == "d"
    assert out["f"] == reference_tokens(prompt(12, 5), 12)


def test_abort_frees_slot_and_reports_once():
    engine, _ = make_engine(num_slots=1)
    engine.add_request(Request("a", prompt(14, 5), SamplingParams(temperature=0.0, max_tokens=100)))
    engine.step()
    engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort")]
    assert engine.pool.num_running == 0 and not engine.has_work()


def test_eos_and_stop_token_ids_end_generation():
    ref = reference_tokens(prompt(15, 6), 12)
    engine, _ = make_engine()
    eos = Request("e", prompt(15, 6), GREEDY, eos_token_ids=(ref[3],))
    out, finish = run_all(engine, [eos])
    assert out["e"] == ref[: ref.index(ref[3]) + 1] and finish["e"] == "stop"
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(ref[2],))
    out, finish = run_all(engine, [Request("s", prompt(15, 6), stop)])
    assert out["s"][-1] == ref[2] and finish["s"] == "stop"


def test_context_limit_finishes_with_length():
    engine, _ = make_engine(max_model_len=20)
    out, finish = run_all(engine, [Request("a", prompt(16, 15), SamplingParams(max_tokens=50))])
    assert len(out["a"]) == 5 and finish["a"] == "length"


def test_prompt_over_context_is_refused():
    engine, _ = make_engine(max_model_len=20)
    with pytest.raises(ValueError, match="context"):
        engine.add_request(Request("a", prompt(17, 20), GREEDY))


def test_out_of_vocab_prompt_is_refused():
    engine, _ = make_engine()
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request(Request("a", [1, 500], GREEDY))


def test_one_failing_request_does_not_affect_the_others():
    engine, executor = make_engine()
    executor.fail_request_ids.add("bad")
    out, finish = run_all(
        engine, [Request("bad", prompt(18, 5), GREEDY), Request("ok", prompt(19, 5), GREEDY)]
    )
    assert finish == {"bad": "error", "ok": "length"}
    assert out["ok"] == reference_tokens(prompt(19, 5), 12)
    assert engine.pool.num_running == 0


def test_waiting_queue_is_bounded():
    engine, _ = make_engine(max_waiting=2)
    engine.add_request(Request("a", [1], GREEDY))
    engine.add_request(Request("b", [1], GREEDY))
    with pytest.raises(OverflowError):
        engine.add_request(Request("c", [1], GREEDY))


def test_priority_step_budget_caps_steps_but_keeps_priority_decodes():
    engine, executor = make_engine(max_num_batched_tokens=64, max_prefill_chunk_tokens=64)
    engine.add_request(
        Request(
            "p",
            prompt(20, 4),
            SamplingParams(temperature=0.0, max_tokens=20),
            tier=ServiceTier.PRIORITY,
        )
    )
    engine.step()
    engine.budget.priority_tokens = 5  # fixed: this engine has no ITL target to size it
    engine.add_request(Request("long", prompt(21, 60), GREEDY))
    for _ in range(4):
        engine.step()
        seqs = executor.plans[-1].seqs
        assert seqs[0].request_id == "p" and seqs[0].num_tokens == 1
        assert executor.plans[-1].num_scheduled_tokens <= 5
    out, _ = run_all(engine, [])
