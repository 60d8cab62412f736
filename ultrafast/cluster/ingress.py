"""The cluster's OpenAI ingress: one Starlette app that routes every HTTP call of the single
server to a replica and relays its answer, streams included.

Ray-free: replicas are reached through a `Backends` object (the Ray one is in replica.py; the
tests use in-process ones). Authentication and the Host allow-list run here as in `serve` (the
same middleware, the same keys file) and again on the replica, so errors look the same.

Relaying: the replica's status line is held back until its first body chunk, so a replica that
dies before answering is retried on the next one (it sent nothing, and session turns are
committed with turn ids, so the retry cannot store a turn twice). A replica that dies after
its answer began ends the stream with an OpenAI error event and [DONE], never silence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ultrafast.cluster.router import Router, RouteRequest
from ultrafast.server.errors import APIError
from ultrafast.server.openai_format import error_event

log = logging.getLogger(__name__)

GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9a-zA-Z]+)"')
MAX_BODY_BYTES = 64 * 1024 * 1024  # the replica enforces the configured limit
DOWN_CHECK_S = 0.2  # how often a call waiting for its answer checks its replica is alive


class ReplicaFailed(Exception):
    """The replica could not take or finish the call (its process died, or it is gone)."""


class Backends(Protocol):
    def names(self) -> list[str]: ...

    def forward(self, name: str, request: dict) -> AsyncIterator[Any]:
        """Yields {"status", "headers"} first, then body chunks (bytes); raises ReplicaFailed."""
        ...

    async def metrics_text(self, name: str) -> str: ...

    def ws_open(self, name: str, conn_id: str, request: dict) -> AsyncIterator[dict]:
        """A relayed WebSocket's server side (asgi_websocket.py); raises ReplicaFailed."""
        ...

    async def ws_push(self, name: str, conn_id: str, message: dict) -> bool: ...


class Homes:
    """Response id -> the affinity key of its chain, learned from answers, so a
    previous_response_id finds the replica that holds the chain's KV."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._keys: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (key, replica)

    def learn(self, response_id: str, key: str, replica: str) -> None:
        self._keys[response_id] = (key, replica)
        self._keys.move_to_end(response_id)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def key_of(self, response_id: str) -> str:
        return self._keys.get(response_id, (response_id, ""))[0]

    def replica_of(self, response_id: str) -> str | None:
        return self._keys.get(response_id, ("", None))[1]


def route_request(path: str, headers, body: dict | None, homes: Homes) -> RouteRequest:
    """What routing needs from a call: its tier, affinity key, cache hint and prompt text."""
    key = headers.get("x-session-id") or None
    parts = path.rstrip("/").split("/")
    if len(parts) >= 4 and parts[2] in ("conversations", "responses"):  # GET/DELETE by id
        key = key or homes.key_of(parts[3])
    if not isinstance(body, dict):
        return RouteRequest(affinity_key=key, home=homes.replica_of(key) if key else None)
    tier = body.get("service_tier")
    tier = tier if tier in ("priority", "flex") else "default"  # auto: the replica decides
    if isinstance(body.get("session_id"), str):
        key = body["session_id"]
    conversation = body.get("conversation")
    if isinstance(conversation, dict):
        conversation = conversation.get("id")
    if isinstance(conversation, str):
        key = conversation
    home = None
    if isinstance(body.get("previous_response_id"), str):
        key = homes.key_of(body["previous_response_id"])
        home = homes.replica_of(body["previous_response_id"])  # where the chain's KV is
    if home is None and key:  # a conversation opened over /v1/realtime lives where it began
        home = homes.replica_of(key)
    hint = body.get("prompt_cache_key")
    return RouteRequest(
        tier=tier,
        affinity_key=key,
        home=home,
        cache_hint=hint if isinstance(hint, str) else None,
        prompt_text=_prompt_text(body),
    )


def _prompt_text(body: dict) -> str:
    """The prompt as plain text for the prefix index (not the template: close enough to rank)."""
    if isinstance(body.get("prompt"), str):
        return body["prompt"]
    parts = []
    for field in ("instructions", "messages", "input"):
        value = body.get(field)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(json.dumps(m, sort_keys=True) for m in value)
    return "\n".join(parts)


class ClusterIngress:
    def __init__(
        self,
        backends: Backends,
        router: Router,
        model_name: str = "",
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self.max_body_bytes = max_body_bytes
        self.backends = backends
        self.router = router
        self.homes = Homes()
        self.model_name = model_name
        self.failures: dict[str, int] = {}  # replica -> calls that failed on it

    async def handle(self, http: HTTPRequest) -> Response:
        body_bytes = await self._read_body(http)
        body = None
        if body_bytes and http.method == "POST":
            try:
                body = json.loads(body_bytes)
            except ValueError:
                body = None  # forwarded as is: the replica answers the proper 400
        route = route_request(http.url.path, http.headers, body, self.homes)
        decision = self.router.choose(route)
        if decision.replica is None:
            return _refusal(decision)
        headers = [(k.encode(), v.encode()) for k, v in http.headers.items()]
        if (
            isinstance(body, dict)
            and "idempotency-key" not in http.headers
            and (
                (http.url.path == "/v1/chat/completions" and body.get("session_id"))
                or http.url.path == "/v1/responses"
            )
        ):  # a retry on another replica then stores the turn once (the store dedupes by key)
            # and a Response keeps its id
            headers.append((b"idempotency-key", f"ingress-{uuid.uuid4().hex}".encode()))
        request = {
            "method": http.method,
            "path": http.url.path,
            "query_string": http.url.query.encode(),
            "headers": headers,
            "body": body_bytes,
            "client": list(http.client) if http.client else ["127.0.0.1", 0],
        }
        for name in (decision.replica, *decision.fallbacks):
            try:
                return await self._relay(name, request, route, decision.reason)
            except ReplicaFailed as exc:
                log.warning("replica %s failed before answering (%s): trying the next", name, exc)
                self._failed(name)
        raise APIError(
            503,
            "no replica could take the call",
            "server_error",
            "no_replica",
            None,
            headers={"Retry-After": "1"},
        )

    async def _read_body(self, http: HTTPRequest) -> bytes:
        """The body, refused past the limit as the single server refuses it (never buffered
        beyond it)."""
        limit = self.max_body_bytes
        too_large = APIError(
            413,
            f"request body is larger than {limit} bytes",
            "invalid_request_error",
            "payload_too_large",
            None,
        )
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def _failed(self, name: str) -> None:
        self.failures[name] = self.failures.get(name, 0) + 1
        self.router.mark_down(name)

    async def _relay(self, name: str, request: dict, route: RouteRequest, reason: str) -> Response:
        counted = self.router.dispatched(name, route)
        stream = self.backends.forward(name, request)
        try:
            start = await self._start_of(name, stream)
            first = b""
            more = True
            while not first and more:  # the status line waits for the first body bytes
                try:
                    first = await anext(stream)
                except StopAsyncIteration:
                    more = False
        except BaseException:  # ReplicaFailed (retried by the caller), or the client left
            self.router.first_token(name, route.tier, counted)
            self.router.finished(name)
            raise
        self.router.first_token(name, route.tier, counted)
        headers = dict(start["headers"])
        headers.pop("content-length", None)
        headers["x-ultrafast-replica"] = name
        headers["x-ultrafast-route"] = reason
        if route.affinity_key:
            headers["x-session-id"] = route.affinity_key
        self._learn(route, headers, first, name)
        if route.affinity_key and 200 <= start["status"] < 300 and route.home != name:
            # the conversation's KV is here now: its next turns stay (after a failover they
            # would otherwise move back to the restarted replica and restore all over again)
            self.homes.learn(route.affinity_key, route.affinity_key, name)
        event_stream = headers.get("content-type", "").startswith("text/event-stream")

        async def rest() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                if more:
                    async for chunk in stream:
                        yield chunk
            except ReplicaFailed as exc:
                self._failed(name)
                log.warning("replica %s failed mid-answer: %s", name, exc)
                if event_stream:
                    yield error_event(
                        "the replica serving this stream failed; send the request again",
                        "server_error",
                        "replica_failed",
                    )
                    yield b"data: [DONE]\n\n"
            finally:
                self.router.finished(name)

        return StreamingResponse(rest(), status_code=start["status"], headers=headers)

    async def _start_of(self, name: str, stream: AsyncIterator[Any]) -> Any:
        """The answer's first item; ReplicaFailed if the replica is found down before it
        comes (a call to a dead replica would otherwise wait for Ray's replacement)."""
        task = asyncio.ensure_future(anext(stream))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DOWN_CHECK_S)
                if done:
                    return task.result()
                load = self.router.loads.get(name)
                if load is None or not load.healthy:
                    raise ReplicaFailed(f"{name} is down and has not started the answer")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _learn(self, route: RouteRequest, headers: dict, first: bytes, replica: str) -> None:
        """A new Responses chain: its first response id keys the chain's replica."""
        rid = headers.get("x-request-id", "")
        if not rid.startswith("resp_"):
            found = _RESPONSE_ID.search(first[:4096])
            rid = found.group(1).decode() if found else ""
        if rid:
            key = route.affinity_key or rid
            self.homes.learn(rid, key, replica)
            headers.setdefault("x-session-id", key)


def _refusal(decision) -> Response:
    if decision.reason == "refused":
        error = APIError(
            429,
            "no replica can meet the priority tier's time-to-first-token target now; "
            f"retry after {decision.retry_after_s} s",
            "rate_limit_error",
            "priority_capacity",
            "service_tier",
            headers={"Retry-After": str(decision.retry_after_s)},
        )
    else:
        error = APIError(
            503,
            "no replica is ready",
            "server_error",
            "no_replica",
            None,
            headers={"Retry-After": str(decision.retry_after_s)},
        )
    return JSONResponse(
        error.to_dict(),
        status_code=error.status,
        headers={**error.headers, "x-request-id": uuid.uuid4().hex},
    )
