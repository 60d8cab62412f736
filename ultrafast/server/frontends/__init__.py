"""Front ends, one per API, each over the one call pipeline (server/calls.py).

One module per protocol (with its helpers beside it):
- OpenAI's: `chat.py` (chat completions, completions), `responses.py` (+ `responses_models.py`,
  `responses_stream.py`), `conversations.py`, `realtime.py` (WebSocket), `stored_chat.py`
  (`store: true` completions), `replay.py` (a chat call retried with its Idempotency-Key),
  `embeddings.py`;
- `anthropic.py` (+ `anthropic_stream.py`) speaks Anthropic's Messages API, `ollama.py`
  (+ `ollama_models.py`) Ollama's.
Each only translates its wire format into a `CallInput` and the run's output back into its
own shapes; tiers, admission, the prefix cache, grammar, tools, the output guard, metrics,
keys and tenants are the pipeline's, and stored history is server/sessions/. Only app.py
imports a front end (tests/unit/test_server_floors.py).

`error_body` picks the error shape by path, for the refusals the auth middleware gives before
any route runs (a 401 to an Anthropic client is still in Anthropic's shape).
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ultrafast.server.errors import APIError
from ultrafast.server.frontends import anthropic_errors, ollama_errors


def error_response_for(path: str, error: APIError, request_id: str) -> JSONResponse:
    """The refusal in the shape of the protocol `path` belongs to (OpenAI's by default)."""
    if anthropic_errors.owns(path):
        return anthropic_errors.response(error, request_id)
    if ollama_errors.owns(path):
        return ollama_errors.response(error, request_id)
    return JSONResponse(
        error.to_dict(),
        status_code=error.status,
        headers={**error.headers, "x-request-id": request_id},
    )


def frontend_routes(state) -> list:
    from ultrafast.server.frontends.anthropic import anthropic_routes
    from ultrafast.server.frontends.ollama import ollama_routes

    return [*anthropic_routes(state), *ollama_routes(state)]
