"""Prompt logprobs for the executors: the extra logits rows a plan asks for to score prompt
tokens (ScheduledSeq.num_prompt_logits), split off from the rows the sampler works on.

Per sequence, in plan order, the logits hold its `num_prompt_logits` scoring rows, then its
`num_logits` sampled rows. Row j of a sequence scores the prompt token at start_position + j + 1
under the model's raw distribution (no temperature, penalties or bias), as OpenAI's legacy
completions reported `echo` + `logprobs`.
"""

from __future__ import annotations

import numpy as np
import torch

from ultrafast.core.types import ScheduledSeq, TokenLogprobs


def scoring_problem(seq: ScheduledSeq) -> str | None:
    """Why this sequence's scoring rows cannot be served (it alone fails), or None."""
    k = seq.num_prompt_logits
    if k < 0 or k + seq.num_logits > seq.num_tokens:
        return f"bad step: {seq.num_tokens} tokens, {k} scoring rows, {seq.num_logits} sampled"
    if k and seq.start_position + k >= len(seq.prompt_token_ids):
        return "scoring rows reach past the prompt"
    return None


def wants_prompt_rows(seqs: list[ScheduledSeq]) -> bool:
    return any(s.num_prompt_logits for s in seqs)


def split_prompt_rows(seqs: list[ScheduledSeq], logits):
    """(the sampled rows only, for sample_plan; request id -> one TokenLogprobs per scored
    prompt token). `logits` is a torch tensor or a float32 numpy array, as the executor has it."""
    if logits.shape[0] != sum(s.num_prompt_logits + s.num_logits for s in seqs):
        raise ValueError("logits rows do not match the plan's scoring and sampled rows")
    scores: dict[str, list[TokenLogprobs]] = {}
    sampled_rows: list[int] = []
    row = 0
    for seq in seqs:
        k = seq.num_prompt_logits
        if k:
            first = seq.start_position + 1
            targets = seq.prompt_token_ids[first : first + k]
            top_n = seq.sampling_params.prompt_logprobs or 0
            scores[seq.request_id] = score_rows(logits[row : row + k], targets, top_n)
        row += k
        sampled_rows.extend(range(row, row + seq.num_logits))
        row += seq.num_logits
    if isinstance(logits, np.ndarray):
        return logits[np.asarray(sampled_rows, dtype=np.intp)], scores
    return logits[torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)], scores


def score_rows(rows, targets: list[int], top_n: int) -> list[TokenLogprobs]:
    """TokenLogprobs of targets[j] under row j, with the row's top_n alternatives."""
    rows = torch.from_numpy(np.ascontiguousarray(rows)) if isinstance(rows, np.ndarray) else rows
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    if top_n:
        values, ids = torch.topk(logprobs, top_n, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in targets]
    return [TokenLogprobs(t, lp, top) for t, lp, top in zip(targets, chosen, tops)]
