"""Prompt logprobs from the ggml and torch executors, driven by the engine (chunked prefill,
batched with a plain request), equal transformers' log-softmax over the same ids.

f32 GGUF with an f32 KV cache and float32 torch: both agree with transformers to ~1e-5.
"""

from __future__ import annotations

import pytest
import torch

from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.request import Request, SamplingParams

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

ATOL = 1e-4
PROMPT = [(i * 37 + 11) % 390 + 3 for i in range(30)]
OTHER = [44, 12, 310, 7, 7, 90, 123, 250, 18, 66, 301]
TOP = 3


def make_executor(kind, tiny_llama_dir, tiny_llama_gguf_f32):
    if kind == "ggml":
        pytest.importorskip("llama_cpp")
        from ultrafast.executors.ggml_exec import GgmlExecutor

        return GgmlExecutor(
            tiny_llama_gguf_f32, num_slots=3, max_model_len=128, kv_cache_dtype="f32"
        )
    from ultrafast.executors.torch_exec import TorchExecutor

    return TorchExecutor(
        tiny_llama_dir, num_slots=3, max_model_len=128, device="cpu", dtype="float32"
    )


def run(engine, requests):
    outputs = {r.request_id: [] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


@pytest.mark.parametrize("kind", ["ggml", "torch"])
def test_prompt_logprobs_equal_transformers(
    kind, tiny_llama_dir, tiny_llama_gguf_f32, tiny_hf_model_factory
):
    executor = make_executor(kind, tiny_llama_dir, tiny_llama_gguf_f32)
    try:
        engine = EngineCore(
            executor,
            SchedulerConfig(
                max_num_seqs=3,
                max_num_batched_tokens=64,
                max_prefill_chunk_tokens=8,
                max_model_len=128,
            ),
        )
        greedy = dict(temperature=0.0, ignore_eos=True)
        plain = Request("plain", list(PROMPT), SamplingParams(max_tokens=6, **greedy))
        run(engine, [plain])  # leaves the prompt's KV cached: scoring must recompute it
        scored = Request(
            "scored",
            list(PROMPT),
            SamplingParams(
                max_tokens=6, logprobs=True, top_logprobs=1, prompt_logprobs=TOP, **greedy
            ),
        )
        score_only = Request(
            "score-only", list(OTHER), SamplingParams(max_tokens=0, prompt_logprobs=0, **greedy)
        )
        outputs = run(engine, [scored, score_only])
    finally:
        executor.close()
    hf = tiny_hf_model_factory("llama")
    for request in (scored, score_only):
        ids = request.prompt_token_ids
        with torch.no_grad():
            expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
        (entries,) = [
            o.prompt_logprobs for o in outputs[request.request_id] if o.prompt_logprobs is not None
        ]
        assert entries[0] is None and len(entries) == len(ids)
        got = torch.tensor([e.logprob for e in entries[1:]])
        want = expected.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert [e.token_id for e in entries[1:]] == ids[1:]
        top_n = request.sampling_params.prompt_logprobs
        for entry, row in zip(entries[1:], expected):
            values, top_ids = torch.topk(row, top_n) if top_n else (row[:0], row[:0].long())
            assert [t for t, _ in entry.top] == top_ids.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in entry.top]), values, atol=ATOL, rtol=0
            )
    # scoring the prompt changes nothing about the answer
    assert scored.output_token_ids == plain.output_token_ids
    assert score_only.output_token_ids == [] and outputs["score-only"][-1].finish_reason == "length"


@pytest.mark.parametrize("kind", ["ggml", "torch"])
def test_a_bad_scoring_request_fails_alone(kind, tiny_llama_dir, tiny_llama_gguf_f32):
    from ultrafast.core.types import ScheduledSeq, StepPlan

    executor = make_executor(kind, tiny_llama_dir, tiny_llama_gguf_f32)
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    try:
        result = executor.execute(
            StepPlan(
                [
                    # 4 scoring rows, but the prompt has only 3 tokens after position 0
                    ScheduledSeq(
                        "past-prompt",
                        0,
                        OTHER[:4],
                        0,
                        0,
                        params,
                        0,
                        0,
                        OTHER[:4],
                        num_prompt_logits=4,
                    ),
                    ScheduledSeq(
                        "too-many-rows",
                        1,
                        OTHER[:3],
                        0,
                        1,
                        params,
                        0,
                        0,
                        OTHER,
                        num_prompt_logits=3,
                    ),
                    ScheduledSeq(
                        "fine", 2, OTHER[:5], 0, 1, params, 0, 0, OTHER[:5], num_prompt_logits=4
                    ),
                ]
            )
        )
    finally:
        executor.close()
    assert set(result.errors) == {"past-prompt", "too-many-rows"}
    assert [e.token_id for e in result.prompt_logprobs["fine"]] == OTHER[1:5]
    assert len(result.sampled_token_ids["fine"]) == 1
