"""Prompt scoring for the fake executor (`fake_exec.py`), whose model puts all probability on
its next token: a prompt token scores 0.0 where it is that token and MISS_LOGPROB elsewhere;
its one alternative is that token, at 0.0. `predict(context)` is the fake model."""

from __future__ import annotations

from collections.abc import Callable

from ultrafast.core.types import ScheduledSeq, TokenLogprobs

MISS_LOGPROB = -100.0  # a prompt token the fake model would not have produced

Predict = Callable[[list[int]], int]


def score_prompt(kv: list[int], seq: ScheduledSeq, predict: Predict) -> list[TokenLogprobs]:
    """The StepResult.prompt_logprobs entries of `seq`, whose tokens `kv` (the slot) now ends
    with."""
    out = []
    for j in range(seq.num_prompt_logits):
        position = seq.start_position + j + 1  # the prompt token row j scores
        predicted = predict(kv[:position])
        token = seq.prompt_token_ids[position]
        top = [(predicted, 0.0)] if seq.sampling_params.prompt_logprobs else []
        out.append(TokenLogprobs(token, 0.0 if token == predicted else MISS_LOGPROB, top))
    return out


def reference_prompt_logprobs(prompt: list[int], predict: Predict) -> list[float | None]:
    """The logprob the fake model gives each prompt token (the first: None)."""
    return [None] + [
        0.0 if prompt[i] == predict(prompt[:i]) else MISS_LOGPROB for i in range(1, len(prompt))
    ]
