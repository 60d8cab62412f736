"""Sampler: each knob changes the distribution the way it should; seeds make draws repeatable."""

import math

import pytest
import torch

from ultrafast.core.types import ScheduledSeq
from ultrafast.request import SamplingParams
from ultrafast.sampling.sampler import filter_logits, sample_plan


def seq(params, request_id="r", seed=1, num_output=0, outputs=(), prompt=(1,), num_logits=1):
    return ScheduledSeq(
        request_id,
        0,
        [1] * num_logits,
        0,
        num_logits,
        params,
        seed,
        num_output,
        list(prompt),
        list(outputs),
    )


def draw(logits, params, seed=1, index=0, **kw):
    s = seq(params, seed=seed, num_output=index, **kw)
    return sample_plan([s], logits.clone().unsqueeze(0)).sampled_token_ids["r"][0]


LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.5, -1.0])


def test_greedy_is_argmax_for_a_batch():
    logits = torch.tensor([[0.0, 5.0, 1.0], [9.0, 1.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    result = sample_plan([seq(greedy, "a"), seq(greedy, "b")], logits)
    assert result.sampled_token_ids == {"a": [1], "b": [0]}


def test_top_k_one_equals_greedy_at_any_temperature():
    params = SamplingParams(temperature=1.5, top_k=1)
    assert {draw(LOGITS, params, seed=s) for s in range(20)} == {1}


def test_same_seed_same_token_and_index_changes_the_draw():
    params = SamplingParams(temperature=1.0)
    assert [draw(LOGITS, params, seed=7, index=i) for i in range(30)] == [
        draw(LOGITS, params, seed=7, index=i) for i in range(30)
    ]
    assert len({draw(LOGITS, params, seed=7, index=i) for i in range(30)}) > 1


def test_sampling_follows_softmax_frequencies():
    params = SamplingParams(temperature=1.0)
    probs = torch.softmax(LOGITS, -1)
    counts = torch.zeros(5)
    n = 3000
    for i in range(n):
        counts[draw(LOGITS, params, seed=3, index=i)] += 1
    # 5 sigma of a binomial, per token
    sigma = torch.sqrt(probs * (1 - probs) / n)
    assert torch.all((counts / n - probs).abs() < 5 * sigma + 1e-3)


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits.clone(), 0, 0.7, 0.0))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(filter_logits(logits.clone(), 0, 0.5, 0.0))
    assert kept.tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(logits.clone(), 0, 1.0, 0.25))
    assert kept.tolist() == [True, True, True, False]


def test_logit_bias_can_force_a_token():
    params = SamplingParams(temperature=0.0, logit_bias=((4, 100.0),))
    assert draw(LOGITS, params) == 4


def test_frequency_and_presence_penalties_push_repeated_tokens_down():
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    assert draw(LOGITS, params, outputs=[1]) == 2  # 3.0 - 1.5 < 2.0
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    assert draw(LOGITS, params, outputs=[1, 1, 1]) == 2


def test_repetition_penalty_counts_the_prompt():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert draw(LOGITS, params, prompt=[1]) == 2  # 3.0 / 2 < 2.0


def test_logprobs_are_raw_log_softmax_with_top_alternatives():
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    result = sample_plan([seq(params)], LOGITS.clone().unsqueeze(0))
    lp = result.logprobs["r"][0]
    expected = torch.log_softmax(LOGITS, -1)
    assert lp.token_id == 1 and math.isclose(lp.logprob, float(expected[1]), rel_tol=1e-5)
    assert [t for t, _ in lp.top] == [1, 2]


def test_several_logits_per_seq_for_drafts():
    logits = torch.tensor([[0.0, 5.0], [6.0, 0.0], [0.0, 1.0]])
    result = sample_plan([seq(SamplingParams(temperature=0.0), num_logits=3)], logits)
    assert result.sampled_token_ids["r"] == [1, 0, 1]


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError):
        sample_plan([seq(SamplingParams(temperature=0.0))], torch.zeros(2, 3))


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-5),
        dict(max_tokens=0),
        dict(frequency_penalty=3),
        dict(top_logprobs=21),
        dict(min_p=2),
    ],
)
def test_invalid_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
