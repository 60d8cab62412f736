"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, penalties, logit bias,
logprobs, and the verification of speculative drafts (rejection sampling is sampling).

Randomness is explicit and stateless: the token at output index i of a request is drawn with a
generator seeded from (request seed, i). So a seeded request gives the same text alone or in a
batch, and a preempted request that recomputes resumes exactly where it was.
"""

from __future__ import annotations

import numpy as np
import torch

from ultrafast.core.types import ScheduledSeq, StepResult, TokenLogprobs
from ultrafast.grammar.mask import AllowedIdsCache, allowed_bools, apply_mask_numpy

_MASK_64 = (1 << 64) - 1


def _mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): decorrelated generator seeds for consecutive tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK_64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, seq: ScheduledSeq, history: list[int]) -> torch.Tensor:
    """Logit bias, HF repetition penalty (prompt + output), OpenAI presence/frequency (output)."""
    params = seq.sampling_params
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        logits[ids] += torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(history)), dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(
                vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty
            )
    if history and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        counts = torch.bincount(torch.tensor(history, dtype=torch.long), minlength=logits.numel())
        counts = counts[: logits.numel()].to(logits.dtype)
        logits -= params.frequency_penalty * counts
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside top-k, the top-p nucleus and the min-p floor."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token crossing p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def target_probs(logits: torch.Tensor, seq: ScheduledSeq, history: list[int]) -> torch.Tensor:
    """The distribution a sampled (temperature > 0) token is drawn from: penalties, temperature,
    top-k/top-p/min-p applied (logits modified in place)."""
    params = seq.sampling_params
    if params.logit_bias or params.needs_penalties:
        logits = apply_penalties(logits, seq, history)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    return torch.softmax(logits, dim=-1)


def token_generator(seed: int, index: int) -> torch.Generator:
    """The generator of output index `index`: the same draw alone, batched or resumed."""
    return torch.Generator().manual_seed(_mix_seed(seed, index))


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One categorical draw; an exponential race, so zero-probability tokens never win."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def sample_one(logits: torch.Tensor, seq: ScheduledSeq, history: list[int], index: int) -> int:
    """One token from one row of logits (float32, modified in place)."""
    params = seq.sampling_params
    if params.greedy:
        if params.logit_bias or params.needs_penalties:
            logits = apply_penalties(logits, seq, history)
        return int(torch.argmax(logits))
    probs = target_probs(logits, seq, history)
    return draw(probs, token_generator(seq.sampling_seed, index))


def logprobs_of(raw: torch.Tensor, token_id: int, top_n: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(raw, dim=-1)
    top: list[tuple[int, float]] = []
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        # under a grammar, fewer than top_n tokens may be allowed: masked ones are not listed
        top = [(i, v) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]
    return TokenLogprobs(token_id, float(logprobs[token_id]), top)


def verify(seq: ScheduledSeq, logits: torch.Tensor) -> tuple[list[int], list[TokenLogprobs]]:
    """Target tokens at the k+1 positions of a decode with k drafts, up to the first rejection.

    `logits` [k+1, vocab] (raw, float32). Returns (tokens, logprobs): the accepted drafts, then
    the correction (at the first rejected position) or the bonus token (all accepted). Position
    j is processed with the penalties of the tokens accepted before it, and its randomness
    comes from (seed, output index), as in plain decoding.
    """
    params = seq.sampling_params
    drafts = seq.token_ids[seq.num_tokens - seq.num_logits + 1 :]
    tokens: list[int] = []
    token_logprobs: list[TokenLogprobs] = []
    for j in range(seq.num_logits):
        raw = logits[j]
        history = seq.output_token_ids + drafts[:j] if params.needs_penalties else []
        index = seq.num_output_tokens + j
        if j < len(drafts) and seq.draft_probs is not None and not params.greedy:
            token = _rejection_sample(
                raw.clone(), seq, history, index, drafts[j], seq.draft_probs[j]
            )
        else:
            token = sample_one(raw.clone(), seq, history, index)
        tokens.append(token)
        if params.logprobs:
            token_logprobs.append(logprobs_of(raw, token, params.top_logprobs))
        if j < len(drafts) and token != drafts[j]:
            break
    return tokens, token_logprobs


def _rejection_sample(
    logits: torch.Tensor,
    seq: ScheduledSeq,
    history: list[int],
    index: int,
    draft_token: int,
    q: torch.Tensor,
) -> int:
    """Accept `draft_token` with probability min(1, p/q), else draw from norm(max(p - q, 0))."""
    p = target_probs(logits, seq, history)
    q = q.to(p.dtype)
    generator = token_generator(seq.sampling_seed, index)
    u = float(torch.rand((), generator=generator))
    if u * float(q[draft_token]) < float(p[draft_token]):
        return draft_token
    residual = torch.clamp(p - q, min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is exact
        residual = p
    return draw(residual, generator)


def sample_keeping_deferred(seqs: list[ScheduledSeq], logits) -> StepResult:
    """`sample_plan`, except that the row of each `defer_sample` seq is copied into
    StepResult.kept_logits instead of sampled (a numpy row or a tensor, for `sample_kept`)."""
    if not any(s.defer_sample for s in seqs if s.num_logits):
        return sample_plan(seqs, logits)
    kept: dict = {}
    rest: list[ScheduledSeq] = []
    rows: list[int] = []
    row = 0
    for seq in seqs:
        if not seq.num_logits:
            continue
        if seq.defer_sample:
            kept[seq.request_id] = (
                logits[row].copy() if isinstance(logits, np.ndarray) else logits[row].clone()
            )
        else:
            rest.append(seq)
            rows.extend(range(row, row + seq.num_logits))
        row += seq.num_logits
    result = sample_plan(rest, logits[rows]) if rest else StepResult()
    result.kept_logits = kept
    return result


def sample_kept_row(seq: ScheduledSeq, kept) -> StepResult:
    """Sample `seq` (one position, its mask applied) from a row `sample_keeping_deferred`
    kept."""
    row = kept[None, :] if isinstance(kept, np.ndarray) else kept.unsqueeze(0)
    return sample_plan([seq], row)


def sample_plan(seqs: list[ScheduledSeq], logits) -> StepResult:
    """Sample every requested position. `logits` is [sum(num_logits), vocab] in plan order:
    a torch tensor, or a float32 numpy array (the ggml executor's zero-copy view)."""
    result = StepResult()
    wanted = [s for s in seqs if s.num_logits > 0]
    if logits.shape[0] != sum(s.num_logits for s in wanted):
        raise ValueError("logits rows do not match the plan")
    masked = any(s.token_mask is not None for s in wanted)
    if all(s.sampling_params.plain_greedy for s in wanted):  # one argmax for the whole batch
        # numpy's argmax on the zero-copy view skips torch's per-call overhead, which is a
        # visible part of a CPU decode step's host time (scripts/host_step_time.py)
        if isinstance(logits, np.ndarray):
            rows = logits
        elif logits.device.type == "cpu" and logits.dtype == torch.float32:
            rows = logits.numpy()
        else:
            rows = None
        if rows is not None:
            ids = rows.argmax(-1).tolist()
            if masked:  # a mask changes an argmax only where it blocks it
                _greedy_under_masks(wanted, rows, ids)
        else:
            if masked:
                logits = apply_token_masks(wanted, logits)
            ids = logits.argmax(-1).tolist()
        row = 0
        for seq in wanted:
            result.sampled_token_ids[seq.request_id] = ids[row : row + seq.num_logits]
            row += seq.num_logits
        return result
    if masked:
        logits = apply_token_masks(wanted, logits)
    logits = torch.from_numpy(logits) if isinstance(logits, np.ndarray) else logits.float()
    row = 0
    for seq in wanted:
        if seq.num_logits > 1:  # drafts to verify
            tokens, token_logprobs = verify(seq, logits[row : row + seq.num_logits])
        else:
            raw = logits[row]
            history = list(seq.output_token_ids) if seq.sampling_params.needs_penalties else []
            tokens = [sample_one(raw.clone(), seq, history, seq.num_output_tokens)]
            token_logprobs = (
                [logprobs_of(raw, tokens[0], seq.sampling_params.top_logprobs)]
                if seq.sampling_params.logprobs
                else []
            )
        result.sampled_token_ids[seq.request_id] = tokens
        if seq.sampling_params.logprobs:
            result.logprobs[seq.request_id] = token_logprobs
        row += seq.num_logits
    return result


def _greedy_under_masks(seqs: list[ScheduledSeq], rows: np.ndarray, ids: list[int]) -> None:
    """Greedy ids of masked rows, given `ids` (the unmasked argmax of each row): the first
    maximum of a row stays the first maximum once other entries are blocked, so only a row
    whose argmax its mask blocks is masked (in place) and searched again. Exact, like
    masking every row, and a model that follows its grammar rarely needs the second pass."""
    row = 0
    for seq in seqs:
        mask = seq.token_mask
        if mask is not None:
            for j in range(seq.num_logits):
                token, word = ids[row + j], ids[row + j] >> 5
                if word >= mask.shape[1] or not int(mask[j, word]) >> (token & 31) & 1:
                    ids[row + j] = _masked_argmax(rows[row + j], mask[j])
        row += seq.num_logits


_ALLOWED_IDS = AllowedIdsCache()


def _masked_argmax(logits_row: np.ndarray, mask_row: np.ndarray) -> int:
    """The first maximum of `logits_row` among the ids `mask_row` allows. A row that allows
    few ids (most grammar states) is searched over those alone, found by the row's bytes in
    a small cache; any other row is blocked in place first (its words inverted before
    unpacking: fewer bytes than inverting the unpacked row)."""
    vocab, covered = logits_row.shape[0], 32 * mask_row.shape[0]
    ids = _ALLOWED_IDS.get(mask_row)
    if ids is not None and ids.size:
        if ids[-1] >= vocab:  # ids past the vocabulary are never allowed
            ids = ids[ids < vocab]
        if ids.size:
            return int(ids[logits_row[ids].argmax()])
    blocked = np.unpackbits(
        np.invert(mask_row).view(np.uint8), count=min(vocab, covered), bitorder="little"
    ).view(bool)
    if vocab > covered:  # ids past the mask are never allowed
        logits_row[covered:] = -np.inf
        logits_row = logits_row[:covered]
    np.putmask(logits_row, blocked, -np.inf)
    return int(logits_row.argmax())


def apply_token_masks(seqs: list[ScheduledSeq], logits):
    """Grammar masks (ScheduledSeq.token_mask) applied before anything else, so greedy,
    sampling, logprobs (reported after masking) and draft verification all see only the
    allowed tokens. In place on a float32 array or tensor (the ggml view is llama.cpp's output
    buffer, read only until the next decode); other dtypes are converted first."""
    if not isinstance(logits, np.ndarray) and logits.dtype != torch.float32:
        logits = logits.float()
    vocab = logits.shape[-1]
    row = 0
    for seq in seqs:
        mask = seq.token_mask
        if mask is not None:
            rows = logits[row : row + seq.num_logits]
            if isinstance(rows, np.ndarray):
                apply_mask_numpy(rows, mask)
            else:
                allowed = np.stack([allowed_bools(mask[j], vocab) for j in range(seq.num_logits)])
                blocked = torch.from_numpy(~allowed).to(rows.device)
                rows.masked_fill_(blocked, float("-inf"))
        row += seq.num_logits
    return logits
