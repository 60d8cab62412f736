"""The grammar's part of an engine step (ultrafast/grammar does the matching).

Before scheduling: drafts are cut to their grammar-valid prefix (an invalid draft is a
certain rejection), and a constrained request without drafts gets the tokens its grammar
forces as drafts (source "grammar": verified like any deterministic draft, so exact), as many
as the measured step costs say pay for themselves (all are accepted, but each widens the pass).
After scheduling: each constrained seq gets one mask row per sampled position.
After the update: matchers advance over the accepted tokens only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from ultrafast.core.types import Draft, RequestOutput, StepPlan
from ultrafast.request import Request, RequestStatus

log = logging.getLogger(__name__)


def constrain_drafts(
    drafts: dict[str, Draft],
    running: Iterable[Request],
    forced_worth: Callable[[int], int] | None = None,
) -> dict[str, Draft]:
    """`forced_worth(n)`: how many of n forced tokens to propose (each widens the pass, which
    on a small CPU model can cost more than the step it saves); None = all of them."""
    out = dict(drafts)
    for request in running:
        matcher = request.grammar_matcher
        if matcher is None:
            continue
        rid = request.request_id
        draft = out.get(rid)
        if draft is not None and draft.token_ids:
            n = matcher.valid_prefix(draft.token_ids)
            if n < len(draft.token_ids):
                probs = draft.probs[:n] if draft.probs is not None and n else None
                draft = Draft(draft.token_ids[:n], probs, draft.source) if n else None
        if draft is None or not draft.token_ids:
            forced = matcher.forced_tokens(forced_worth)
            draft = Draft(forced, None, "grammar") if forced else None
        if draft is None:
            out.pop(rid, None)
        else:
            out[rid] = draft
    return out


def fill_masks(plan: StepPlan, requests: dict[str, Request]) -> dict[str, Request]:
    """Set `token_mask` on every constrained seq that samples; returns those requests."""
    constrained: dict[str, Request] = {}
    for seq in plan.seqs:
        request = requests.get(seq.request_id)
        if request is None or request.grammar_matcher is None:
            continue
        constrained[seq.request_id] = request
        if seq.num_logits:
            drafts = seq.token_ids[seq.num_tokens - seq.num_logits + 1 :]
            seq.token_mask = request.grammar_matcher.masks(drafts)
    return constrained


def advance(outputs: list[RequestOutput], constrained: dict[str, Request]) -> None:
    """Matchers over the accepted tokens; an answer that ends (`stop`) where its grammar is
    not complete (the grammar could not go on: an error state, a lexer limit) ends `length`
    instead, logged: a `stop` promises output the grammar accepts."""
    for output in outputs:
        request = constrained.get(output.request_id)
        if request is None or not output.new_token_ids:
            continue
        matcher = request.grammar_matcher
        matcher.consume(output.new_token_ids)
        if output.finish_reason == RequestStatus.FINISHED_STOPPED.value and not matcher.accepted:
            log.warning(
                "request %s: its grammar (%s) did not reach an accepting state after %d "
                "tokens (%s); finishing with 'length', not 'stop'",
                output.request_id,
                getattr(request.sampling_params.grammar, "source", "?"),
                request.num_output_tokens,
                matcher.error or "no further token allowed",
            )
            output.finish_reason = RequestStatus.FINISHED_LENGTH.value
            request.status = RequestStatus.FINISHED_LENGTH
