"""verify() on synthetic distributions: rejection sampling keeps the target distribution.

Statistical checks use a fixed seed set and enough draws that the total-variation distance of a
correct sampler stays far below the bound (its standard error is ~0.005 here), while a sampler
that, say, returned the draft whenever offered would miss it by > 0.2.
"""

import numpy as np
import torch

from ultrafast.core.types import ScheduledSeq
from ultrafast.request import SamplingParams
from ultrafast.sampling.sampler import sample_one, sample_plan, verify

P = np.array([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
Q = np.array([0.3, 0.1, 0.3, 0.05, 0.05, 0.2])  # a bad draft: far from P
NUM_DRAWS = 12_000


def _seq(seed, drafts, params, probs=None, output=()):
    return ScheduledSeq(
        "r",
        0,
        [1] + list(drafts),
        10,
        len(drafts) + 1,
        params,
        seed,
        len(output),
        prompt_token_ids=[1, 2],
        output_token_ids=list(output),
        draft_probs=probs,
    )


def _tv(counts, expected):
    freq = counts / counts.sum()
    return 0.5 * float(np.abs(freq - expected).sum())


SAMPLED = SamplingParams(temperature=1.0)


def _run(num_drafts, use_q, params=SAMPLED):
    rng = np.random.default_rng(0)
    logits = torch.log(torch.tensor(P, dtype=torch.float32)).repeat(num_drafts + 1, 1)
    q = torch.tensor(Q, dtype=torch.float32).repeat(num_drafts, 1)
    first = np.zeros(len(P))
    second_after_accept = np.zeros(len(P))
    num_accepted = 0
    for seed in range(NUM_DRAWS):
        drafts = rng.choice(len(Q), size=num_drafts, p=Q).tolist()
        tokens, _ = verify(_seq(seed, drafts, params, q if use_q else None), logits)
        first[tokens[0]] += 1
        if tokens[0] == drafts[0]:
            num_accepted += 1
            if len(tokens) > 1:
                second_after_accept[tokens[1]] += 1
        assert 1 <= len(tokens) <= num_drafts + 1
        assert tokens[:-1] == drafts[: len(tokens) - 1]  # only accepted drafts come back
    return first, second_after_accept, num_accepted / NUM_DRAWS


def test_rejection_sampling_with_draft_probs_keeps_the_target_distribution():
    first, second, rate = _run(2, use_q=True)
    assert _tv(first, P) < 0.02
    assert _tv(second, P) < 0.03
    assert abs(rate - np.minimum(P, Q).sum()) < 0.03  # the textbook acceptance rate


def test_deterministic_drafts_keep_the_target_distribution():
    first, second, rate = _run(2, use_q=False)
    assert _tv(first, P) < 0.02
    assert _tv(second, P) < 0.03
    assert abs(rate - float((P * Q).sum())) < 0.03  # accepted with probability p(draft)


def test_a_biased_verifier_would_fail_the_bound():
    # the check has power: always accepting the draft gives Q, which is far from P
    assert _tv(Q * NUM_DRAWS, P) > 0.2


def test_processed_distribution_is_the_target_with_top_k_and_temperature():
    params = SamplingParams(temperature=0.7, top_k=3)
    first, _, _ = _run(1, use_q=True, params=params)
    logits = np.log(P) / 0.7
    keep = np.argsort(-P)[:3]
    target = np.zeros(len(P))
    target[keep] = np.exp(logits[keep]) / np.exp(logits[keep]).sum()
    assert _tv(first, target) < 0.02
    assert first[np.setdiff1d(np.arange(len(P)), keep)].sum() == 0


def test_deterministic_drafts_give_the_same_seeded_tokens_as_plain_sampling():
    """With an n-gram / prediction draft, a seeded request's text is exactly the plain text."""
    torch.manual_seed(1)
    logits = torch.randn(4, 50) * 2
    params = SamplingParams(temperature=0.9, top_p=0.9, presence_penalty=0.5, seed=7)
    output = [3, 4]
    plain, history = [], list(output)
    for j in range(4):
        token = sample_one(
            logits[j].clone(), _seq(7, [], params, output=output), history, len(output) + j
        )
        plain.append(token)
        history.append(token)
    for num_right in range(4):  # drafts right for a prefix, then wrong
        drafts = plain[:num_right] + [(plain[num_right] + 1) % 50 if num_right < 3 else 0]
        drafts = drafts[:3]
        tokens, _ = verify(_seq(7, drafts, params, output=output), logits)
        assert tokens == plain[: len(tokens)]
        assert len(tokens) == min(num_right, 3) + 1


def test_greedy_verify_with_penalties_and_logprobs_matches_sequential_decoding():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=True, top_logprobs=2)
    seq0 = _seq(0, [], params, output=[5])
    sequential, history = [], [5]
    for j in range(3):
        sequential.append(sample_one(logits[j].clone(), seq0, history, 1 + j))
        history.append(sequential[-1])
    seq = _seq(0, sequential[:2], params, output=[5])
    result = sample_plan([seq], logits)
    assert result.sampled_token_ids["r"] == sequential
    lps = result.logprobs["r"]
    assert [lp.token_id for lp in lps] == sequential and all(len(lp.top) == 2 for lp in lps)
    raw = torch.log_softmax(logits[1], -1)
    assert abs(lps[1].logprob - float(raw[sequential[1]])) < 1e-5  # raw-model logprob
