"""The answer to a chat call retried with an Idempotency-Key whose answer is already stored.

RELIABILITY F16: a client that timed out and retries must not cause a second generation or a
second session turn. The first attempt stored its assistant turn as `{key}-a`; the retry gets
that turn back as the response (streamed or not, marked `idempotent-replayed: true`) and the
engine does no work. A retry while the first attempt still runs gets 409 `request_in_progress`
(SessionFlow.claim_key).
"""

from __future__ import annotations

from starlette.responses import JSONResponse, Response, StreamingResponse

from ultrafast.server import openai_format as fmt
from ultrafast.server.protocol import ChatCompletionRequest
from ultrafast.server.sessions.store import Turn
from ultrafast.tokenizer import Tokenizer

REPLAY_HEADERS = {"idempotent-replayed": "true"}


def replay_response(
    model_name: str, tokenizer: Tokenizer, req: ChatCompletionRequest, turn: Turn
) -> Response:
    """What the first attempt answered: choice 0 holds the stored text. Nothing was generated
    for this call, so its usage counts no prompt tokens and the stored answer's tokens."""
    tier = req.tier().api_name
    request_id = f"chatcmpl-replay-{turn.turn_id}"[:64]
    choice = fmt.ChoiceState(
        0, text=turn.content, finish_reason="stop" if turn.status == "completed" else "length"
    )
    usage = fmt.usage(0, len(turn.token_ids or ()), 0)
    if not req.stream:
        body = fmt.chat_response(
            request_id, model_name, tier, [choice], usage, tokenizer.decode, False
        )
        return JSONResponse(body, headers=REPLAY_HEADERS)

    async def events():
        writer = fmt.ChunkWriter(request_id, model_name, tier, True, tokenizer.decode, False)
        yield writer.role(0)
        if choice.text:
            yield writer.delta(0, choice.text, [])
        yield writer.delta(0, "", [], choice.finish_reason)
        if req.include_usage():
            yield writer.usage(usage)
        yield fmt.SSE_DONE

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={**REPLAY_HEADERS, "cache-control": "no-cache"},
    )
