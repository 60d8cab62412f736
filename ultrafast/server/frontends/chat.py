"""OpenAI's chat completions and completions: `POST /v1/chat/completions`, `/v1/completions`.

Each route parses its body (protocol.py) with the named model's limits and builds a
`CallInput` (calls.py); a chat call with `session_id` first joins its stored history
(sessions/flow.py `ChatSession`), and one with `store: true` is kept for the stored chat
completions API (stored_chat.py). The run itself is the one pipeline every front end shares.
"""

from __future__ import annotations

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response
from starlette.routing import Route

from ultrafast.server.calls import chat_call, chat_messages, completion_call, prepare_call
from ultrafast.server.frontends.replay import replay_response
from ultrafast.server.frontends.stored_chat import store_chat_completion
from ultrafast.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from ultrafast.server.sessions.flow import ChatSession
from ultrafast.server.state import ServerState, check_model, check_ready, read_json


async def _chat(http: HTTPRequest, state: ServerState, req: ChatCompletionRequest) -> Response:
    session = None
    if req.session_id is not None:  # history from the store, joined with the new turn
        check_model(state, req.model)
        check_ready(state)
        assert state.sessions is not None  # session_id is refused unless sessions are wired
        session = await ChatSession.open(state.sessions, http, req, chat_messages(req))
        if session.replay is not None:
            runtime = state.models.get(req.model)
            return replay_response(runtime.name, runtime.tokenizer, req, session.replay)
    try:
        run = await prepare_call(
            state,
            http.scope,
            chat_call(req, state.limits_for(req.model), session.messages if session else None),
        )
    except BaseException:
        if session is not None:
            session.release()
        raise
    if session is not None:
        try:
            await session.start(run)  # from here the session commit frees the key
        except BaseException:
            session.release()
            run.finish()
            raise
    elif req.store and state.sessions is not None:
        store_chat_completion(state.sessions, http, req, run)
    if run.spec.stream:
        return await run.respond_stream()
    return await run.respond_json(http)


async def _completion(http: HTTPRequest, state: ServerState, req: CompletionRequest) -> Response:
    run = await prepare_call(state, http.scope, completion_call(req, state.limits_for(req.model)))
    if run.spec.stream:
        return await run.respond_stream()
    return await run.respond_json(http)


def chat_routes(state: ServerState) -> list[Route]:
    async def chat_completions(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        limits = state.limits_for(body.get("model"))  # the named model's vocabulary
        return await _chat(http, state, parse_chat_request(body, limits))

    async def completions(http: HTTPRequest) -> Response:
        body = await read_json(http, state)
        limits = state.limits_for(body.get("model"))
        return await _completion(http, state, parse_completion_request(body, limits))

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
