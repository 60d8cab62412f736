"""GgmlExecutor driven the way the engine drives it: StepPlans of ScheduledSeqs and KVCopies.

The reference is transformers' greedy `generate` on the same random weights (f32 GGUF, f32 KV
cache, so llama.cpp and torch agree to ~1e-5 and greedy choices cannot flip). Batching,
chunking, prefix copies, slot reuse and rollback must never change a token.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llama_cpp")

from ultrafast.core.types import KVCopy, ScheduledSeq, StepPlan  # noqa: E402
from ultrafast.executors.ggml_exec import GgmlExecutor  # noqa: E402
from ultrafast.executors.ggml_threads import PREFILL_CALIBRATION_TOKENS  # noqa: E402
from ultrafast.request import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {  # request id -> prompt; lengths differ so a batch mixes prefill and decode
    "a": [5, 17, 99, 200, 3],
    "b": [44, 12, 310, 7, 7, 90, 123, 250, 18, 66, 301, 2, 9, 150, 77, 31, 200],
    "c": [(i * 37 + 11) % 390 + 3 for i in range(40)],
}


@pytest.fixture(scope="module")
def executor(tiny_llama_gguf_f32):
    ex = GgmlExecutor(tiny_llama_gguf_f32, num_slots=4, max_model_len=128, kv_cache_dtype="f32")
    yield ex
    ex.close()


def _seq(request_id, slot_id, token_ids, start, num_logits=1, params=GREEDY, num_output=0):
    return ScheduledSeq(
        request_id=request_id,
        slot_id=slot_id,
        token_ids=list(token_ids),
        start_position=start,
        num_logits=num_logits,
        sampling_params=params,
        sampling_seed=1234,
        num_output_tokens=num_output,
    )


def generate(
    ex,
    prompts: dict[str, list[int]],
    num_new: int,
    slots: dict[str, int] | None = None,
    chunk: int | None = None,
    params=GREEDY,
) -> dict[str, list[int]]:
    """All requests step together: chunked prefill (`chunk` tokens a step), then 1 token a step."""
    slots = slots or {rid: i for i, rid in enumerate(prompts)}
    computed = {rid: 0 for rid in prompts}
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    while any(len(out) < num_new for out in outputs.values()):
        seqs = []
        for rid, prompt in prompts.items():
            if len(outputs[rid]) >= num_new:
                continue
            tokens = prompt + outputs[rid]
            start = computed[rid]
            end = len(tokens) if chunk is None else min(len(tokens), start + chunk)
            seqs.append(
                _seq(
                    rid,
                    slots[rid],
                    tokens[start:end],
                    start,
                    num_logits=1 if end == len(tokens) else 0,
                    params=params,
                    num_output=len(outputs[rid]),
                )
            )
            computed[rid] = end
        result = ex.execute(StepPlan(seqs))
        assert not result.errors
        for rid, sampled in result.sampled_token_ids.items():
            outputs[rid].extend(sampled)
    return outputs


def _hf_greedy(hf_model, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=num_new,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_transformers_generate(executor, tiny_hf_model_factory):
    hf_model = tiny_hf_model_factory("llama")
    for rid in ("a", "c"):
        expected = _hf_greedy(hf_model, PROMPTS[rid], 32)
        assert generate(executor, {rid: PROMPTS[rid]}, 32)[rid] == expected


def test_batched_equals_alone(executor):
    alone = {rid: generate(executor, {rid: p}, 12)[rid] for rid, p in PROMPTS.items()}
    assert generate(executor, PROMPTS, 12) == alone
    assert generate(executor, PROMPTS, 12, chunk=7) == alone  # chunked prefill mixed with decode


def test_plan_order_does_not_change_tokens(executor):
    """The executor runs sequences in slot order (one forward pass per run of consecutive
    slots): a plan listing them in another order, or in scattered slots, gets each request's
    own tokens back, with logits rows matched to the right request."""
    alone = {rid: generate(executor, {rid: p}, 12)[rid] for rid, p in PROMPTS.items()}
    reversed_slots = {"a": 3, "b": 1, "c": 0}  # plan order a, b, c: slots descending, a gap
    assert generate(executor, PROMPTS, 12, slots=reversed_slots) == alone
    params = SamplingParams(temperature=1.0, top_k=50, seed=7)
    sampled = {
        rid: generate(executor, {rid: p}, 8, params=params)[rid] for rid, p in PROMPTS.items()
    }
    assert generate(executor, PROMPTS, 8, slots=reversed_slots, params=params) == sampled


def test_seeded_sampling_batched_equals_alone(executor):
    params = SamplingParams(temperature=1.0, top_k=50, seed=7)
    alone = {rid: generate(executor, {rid: p}, 8, params=params)[rid] for rid, p in PROMPTS.items()}
    assert generate(executor, PROMPTS, 8, params=params) == alone


@pytest.mark.parametrize("path", ["cells", "seq_cp"])
def test_kv_copy_prefix_reuse(executor, monkeypatch, path):
    """A prefix copied across slots gives the tokens computing it would: through the state
    API, only the prefix's cells (llama.cpp's seq_cp copies the whole stream buffer), or,
    where that path cannot read the KV (a layout it does not know), through seq_cp."""
    import llama_cpp

    from ultrafast.executors import ggml_kv_rows

    copied_streams = []
    real_cp = llama_cpp.llama_memory_seq_cp
    monkeypatch.setattr(
        llama_cpp, "llama_memory_seq_cp", lambda *a: copied_streams.append(a[1:3]) or real_cp(*a)
    )
    if path == "seq_cp":

        def unreadable(chunk):
            raise ggml_kv_rows.KVLayoutError("a layout this reader does not know (test)")

        monkeypatch.setattr(ggml_kv_rows, "parse_chunk", unreadable)
    prefix, suffix = PROMPTS["c"][:30], [8, 9, 10, 11]
    expected = generate(executor, {"full": prefix + suffix}, 10, slots={"full": 3})["full"]
    generate(executor, {"owner": prefix + [1, 2, 3]}, 4, slots={"owner": 0})  # slot 0 caches it

    plan = StepPlan(
        [_seq("reuse", 1, suffix, len(prefix))],
        kv_copies=[KVCopy(src_slot_id=0, dst_slot_id=1, num_tokens=len(prefix))],
    )
    outputs = executor.execute(plan).sampled_token_ids["reuse"]
    for i in range(9):
        step = _seq("reuse", 1, outputs[-1:], len(prefix) + len(suffix) + i, num_output=i + 1)
        outputs += executor.execute(StepPlan([step])).sampled_token_ids["reuse"]
    assert outputs == expected
    assert copied_streams == ([] if path == "cells" else [(0, 1)])


def test_kv_copy_leaves_source_intact(executor):
    prompt = PROMPTS["b"]
    expected = generate(executor, {"x": prompt}, 6, slots={"x": 0})["x"]
    first = executor.execute(StepPlan([_seq("x", 0, prompt, 0)])).sampled_token_ids["x"]
    copy = KVCopy(src_slot_id=0, dst_slot_id=2, num_tokens=10)
    other = _seq("y", 2, [300, 301], 10)  # diverges from slot 0 after the copied prefix
    tokens = (
        first
        + executor.execute(
            StepPlan([other, _seq("x", 0, first, len(prompt))], kv_copies=[copy])
        ).sampled_token_ids["x"]
    )
    for _i in range(4):
        step = _seq("x", 0, tokens[-1:], len(prompt) + len(tokens) - 1)
        tokens += executor.execute(StepPlan([step])).sampled_token_ids["x"]
    assert tokens == expected


def test_slot_reused_at_lower_start_position(executor):
    fresh = generate(executor, {"new": PROMPTS["a"]}, 10, slots={"new": 3})["new"]
    generate(executor, {"old": PROMPTS["c"]}, 20, slots={"old": 0})  # slot 0 now holds 60 tokens
    assert generate(executor, {"new": PROMPTS["a"]}, 10, slots={"new": 0})["new"] == fresh

    # rejected drafts: feed the real token plus 3 wrong drafts, then resume one position later
    prompt = PROMPTS["b"]
    expected = generate(executor, {"r": prompt}, 6, slots={"r": 1})["r"]
    first = executor.execute(StepPlan([_seq("r", 1, prompt, 0)])).sampled_token_ids["r"]
    drafted = executor.execute(
        StepPlan([_seq("r", 1, first + [1, 1, 1], len(prompt), num_logits=4)])
    ).sampled_token_ids["r"]
    tokens = first + drafted[:1]  # only the real token's prediction is kept
    for _i in range(4):
        step = _seq("r", 1, tokens[-1:], len(prompt) + len(tokens) - 1)
        tokens += executor.execute(StepPlan([step])).sampled_token_ids["r"]
    assert tokens == expected


def test_bad_requests_fail_alone(executor):
    expected = generate(executor, {"good": PROMPTS["a"]}, 1, slots={"good": 0})["good"]
    plan = StepPlan(
        [
            _seq("bad_token", 1, [5, executor.vocab_size + 3], 0),
            _seq("good", 0, PROMPTS["a"], 0),
            _seq("gap", 2, [5, 6], 100),  # slot 2 never held 100 positions
            _seq("too_long", 3, [5] * 10, 125),
        ]
    )
    result = executor.execute(plan)
    assert result.sampled_token_ids == {"good": expected}
    assert set(result.errors) == {"bad_token", "gap", "too_long"}
    assert "token id" in result.errors["bad_token"]
    assert result.execute_time_s > 0 and result.sample_time_s > 0


def test_invalid_batch_raises_clear_error(executor):
    """Two sequences on one slot break llama.cpp's batch rules: a RuntimeError, not a crash."""
    plan = StepPlan([_seq("p", 0, [5, 6, 7], 0), _seq("q", 0, [8, 9], 0)])
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        executor.execute(plan)
    assert generate(executor, {"a": PROMPTS["a"]}, 2)["a"]  # still usable afterwards


def test_properties_budget_and_close(tiny_llama_gguf_f32):
    ex = GgmlExecutor(
        tiny_llama_gguf_f32,
        num_slots=2,
        max_model_len=64,  # default f16 KV
        max_num_batched_tokens=8,
    )
    assert (ex.num_slots, ex.max_model_len, ex.vocab_size) == (2, 64, 400)
    assert len(generate(ex, {"a": PROMPTS["a"]}, 3)["a"]) == 3
    result = ex.execute(StepPlan([_seq("x", 0, [5] * 5, 0), _seq("y", 1, [6] * 5, 0)]))
    assert (
        list(result.sampled_token_ids) == ["x"] and "max_num_batched_tokens" in result.errors["y"]
    )
    assert ex.execute(StepPlan()).sampled_token_ids == {}
    ex.close()
    ex.close()
    with pytest.raises(FileNotFoundError):
        GgmlExecutor("/nonexistent.gguf", 1, 16)


def test_more_threads_for_multi_token_passes_keep_the_tokens(executor, tiny_llama_gguf_f32):
    ex = GgmlExecutor(
        tiny_llama_gguf_f32,
        num_slots=4,
        max_model_len=128,
        kv_cache_dtype="f32",
        n_threads=1,
        n_threads_batch=2,
    )
    try:
        assert (ex.n_threads, ex.n_threads_batch) == (1, 2)
        # prefills run on 2 threads, 1-token decodes on 1: the same greedy tokens as 1 thread
        assert generate(ex, PROMPTS, 12) == generate(executor, PROMPTS, 12)
    finally:
        ex.close()


def test_a_step_with_spare_threads_runs_on_fewer_and_the_next_on_all(tiny_llama_gguf_f32):
    ex = GgmlExecutor(
        tiny_llama_gguf_f32, num_slots=2, max_model_len=64, kv_cache_dtype="f32", n_threads=2
    )
    try:
        plan = StepPlan([_seq("a", 0, [1, 2, 3], 0)], spare_threads=1)
        assert not ex.execute(plan).errors
        assert ex._threads_now == (1, 1)  # a core left to the grammar compile
        assert not ex.execute(StepPlan([_seq("a", 0, [4], 3)])).errors
        assert ex._threads_now == (2, 2)
        plan = StepPlan([_seq("a", 0, [5], 4)], spare_threads=5)  # never below one thread
        assert not ex.execute(plan).errors and ex._threads_now == (1, 1)
    finally:
        ex.close()


def test_thread_calibration_leaves_slots_empty_and_tokens_unchanged(
    executor, tiny_llama_gguf_f32, monkeypatch
):
    from ultrafast.executors import ggml_threads

    # every width, however busy the machine (its time budget is the unit tests' business)
    monkeypatch.setattr(ggml_threads, "CALIBRATION_BUDGET_S", float("inf"))
    ex = GgmlExecutor(
        tiny_llama_gguf_f32, num_slots=4, max_model_len=128, kv_cache_dtype="f32", threads_auto=True
    )
    try:
        expected = generate(executor, PROMPTS, 12)
        plan = ex.calibrate_threads()
        # decodes capped at the 4 slots, and one prefill chunk
        assert ex.thread_plan is plan and plan.widths == (1, 2, 4, PREFILL_CALIBRATION_TOKENS)
        assert all(1 <= t <= max(ex.n_threads, 2) for t in plan.threads)
        assert ex._slot_lens == [0, 0, 0, 0]
        assert all(llama_pos_max(ex, slot) == -1 for slot in range(4))
        # passes now switch thread counts by width: the tokens stay the same
        assert generate(ex, PROMPTS, 12) == expected
    finally:
        ex.close()


def test_calibration_times_each_candidate_on_its_own_thread_count(tiny_llama_gguf_f32, monkeypatch):
    """The passes timed for a candidate run on that many threads (once they all ran on the
    executor's default count, so every candidate measured the same and one thread won)."""
    from ultrafast.executors import ggml_exec

    ex = GgmlExecutor(
        tiny_llama_gguf_f32, num_slots=4, max_model_len=256, kv_cache_dtype="f32", n_threads=2
    )
    seen = set()
    decode = ggml_exec.llama_cpp.llama_decode

    def spy(ctx, batch):
        seen.add(ex._threads_now)
        return decode(ctx, batch)

    monkeypatch.setattr(ggml_exec.llama_cpp, "llama_decode", spy)
    monkeypatch.setattr(ggml_exec, "physical_cores", lambda: 2)
    try:
        ex.calibrate_threads()
        assert {(1, 1), (2, 2)} <= seen
    finally:
        ex.close()


def llama_pos_max(ex: GgmlExecutor, slot: int) -> int:
    import llama_cpp

    return llama_cpp.llama_memory_seq_pos_max(ex._memory, slot)
