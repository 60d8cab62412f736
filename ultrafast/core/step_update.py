"""What one step's result does to one request: the scheduler's update, token by token.

`Scheduler.update` walks the plan and keeps the queues and slots; the functions here decide,
for one request, which drafts were accepted, where its output stops (eos, a stop id,
max_tokens, the context), how drafts are counted, and what its RequestOutput says.
"""

from __future__ import annotations

from ultrafast.core.types import (
    DraftVerification,
    RequestOutput,
    ScheduledSeq,
    StepResult,
)
from ultrafast.request import Request, RequestStatus


def accepted_drafts(seq: ScheduledSeq, sampled: list[int]) -> int:
    """The drafts the target agreed with, in order (its own next token follows them)."""
    num_drafts = seq.num_logits - 1
    num_accepted = 0
    if num_drafts:
        drafts = seq.token_ids[seq.num_tokens - num_drafts :]
        limit = min(num_drafts, len(sampled) - 1)
        while num_accepted < limit and sampled[num_accepted] == drafts[num_accepted]:
            num_accepted += 1
    return num_accepted


def append_outputs(
    request: Request, max_model_len: int, new_ids: list[int], new_logprobs: list
) -> tuple[list[int], list, RequestStatus | None]:
    """Append tokens one at a time; a stop (eos, stop id, max_tokens, context) cuts the rest."""
    status = None
    for i, token in enumerate(new_ids):
        request.output_token_ids.append(token)
        status = stop_status(request, max_model_len)
        if status is not None:
            new_ids, new_logprobs = new_ids[: i + 1], new_logprobs[: i + 1]
            break
    request.output_logprobs.extend(new_logprobs)
    return new_ids, new_logprobs, status


def stop_status(request: Request, max_model_len: int) -> RequestStatus | None:
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if last in params.stop_token_ids or (not params.ignore_eos and last in request.eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def count_drafts(
    request: Request, source: str, num_drafts: int, num_accepted: int
) -> DraftVerification:
    request.num_draft_tokens += num_drafts
    request.num_accepted_draft_tokens += num_accepted
    if source == "prediction":
        request.num_accepted_prediction_tokens += num_accepted
        request.num_rejected_prediction_tokens += num_drafts - num_accepted
    return DraftVerification(request.request_id, source, num_drafts, num_accepted)


def step_output(request: Request, new_ids: list[int], new_logprobs: list) -> RequestOutput:
    finished = request.status.finished
    prompt_logprobs = None
    if scores_prompt(request) and request.status != RequestStatus.FINISHED_ERROR:
        entries = request.prompt_logprobs or [None]  # a one-token prompt scores nothing
        if len(entries) == request.num_prompt_tokens:
            prompt_logprobs, request.prompt_logprobs_sent = entries, True
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_ids,  # callers pass fresh lists
        new_logprobs=new_logprobs,
        finished=finished,
        finish_reason=request.status.value if finished else None,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=request.num_output_tokens,
        queue_time_s=max(
            0.0,
            (request.first_scheduled_time_s or request.arrival_time_s) - request.arrival_time_s,
        ),
        num_accepted_prediction_tokens=request.num_accepted_prediction_tokens,
        num_rejected_prediction_tokens=request.num_rejected_prediction_tokens,
        prompt_logprobs=prompt_logprobs,
    )


def scores_prompt(request: Request) -> bool:
    """Does the request still need its prompt scored (prompt logprobs not yet handed out)?"""
    return request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent


def take_prompt_logprobs(request: Request, seq: ScheduledSeq, result: StepResult) -> str | None:
    """File a step's prompt-scoring rows under the positions they score; an error if missing.

    A recompute (preemption) starts again from position 0 and overwrites what it scores."""
    rows = result.prompt_logprobs.get(seq.request_id)
    if rows is None or len(rows) != seq.num_prompt_logits:
        return "the executor did not return the prompt logprobs"
    entries = request.prompt_logprobs
    del entries[seq.start_position + 1 :]
    if not entries:
        entries.append(None)  # the first prompt token has nothing before it to score it
    if len(entries) != seq.start_position + 1:
        return "prompt logprobs skipped a position"
    entries.extend(rows)
    return None
