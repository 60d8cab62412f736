"""The ingress's `/v1/realtime`: the client's WebSocket relayed to one replica, both ways.

The replica is chosen as for HTTP calls: the `?conversation=` id is the affinity key (a new
conversation goes to the least loaded replica, and its id, read from `session.created`, is
learned as living there, so its later HTTP turns follow it). Either side closing closes the
other. A replica that dies (or is found down) ends the connection with a Realtime `error` event
(`replica_failed`) and close code 1011, never a silent hang; the conversation's stored turns
are in the shared session store, so the client reconnects with `?conversation=<id>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from ultrafast.cluster.ingress import DOWN_CHECK_S, ClusterIngress, ReplicaFailed
from ultrafast.cluster.router import RouteRequest

log = logging.getLogger(__name__)


def replica_failed_event(message: str) -> dict:
    return {
        "type": "error",
        "error": {
            "type": "server_error",
            "code": "replica_failed",
            "message": message,
            "param": None,
            "event_id": None,
        },
    }


async def relay_realtime(ingress: ClusterIngress, ws: WebSocket) -> None:
    conversation = ws.query_params.get("conversation")
    route = RouteRequest(
        affinity_key=conversation,
        home=ingress.homes.replica_of(conversation) if conversation else None,
    )
    decision = ingress.router.choose(route)
    if decision.replica is None:
        await ws.accept()
        await ws.send_text(json.dumps(replica_failed_event("no replica is ready")))
        await ws.close(code=1013)  # try again later
        return
    request = {
        "method": "GET",
        "path": ws.url.path,
        "query_string": ws.url.query.encode(),
        "headers": [(k.encode(), v.encode()) for k, v in ws.headers.items()],
        "client": list(ws.client) if ws.client else ["127.0.0.1", 0],
    }
    for name in (decision.replica, *decision.fallbacks):
        conn_id = uuid.uuid4().hex
        stream = ingress.backends.ws_open(name, conn_id, request)
        try:
            first = await ingress._start_of(name, stream)
        except ReplicaFailed as exc:
            log.warning("replica %s failed before accepting a realtime socket (%s)", name, exc)
            ingress._failed(name)
            continue
        except StopAsyncIteration:
            first = {"type": "close", "code": 1011, "reason": ""}
        ingress.router.dispatched(name, route)
        try:
            await _relay(ingress, ws, name, conn_id, stream, first, route)
        finally:
            ingress.router.finished(name)
        return
    await ws.accept()
    await ws.send_text(json.dumps(replica_failed_event("no replica could take the connection")))
    await ws.close(code=1011)


async def _relay(ingress, ws, name, conn_id, stream, first, route) -> None:
    if first["type"] != "accept":  # refused by the replica (auth, bad conversation)
        await ws.close(code=int(first.get("code", 1008)), reason=first.get("reason", ""))
        return
    headers = {"x-ultrafast-replica": name}
    await ws.accept(headers=[(k.encode(), v.encode()) for k, v in headers.items()])
    failure: list[str] = []

    async def down() -> None:
        """From the replica to the client, until it closes or fails."""
        try:
            async for item in _watched(ingress, name, stream):
                if item["type"] == "text":
                    _learn_conversation(ingress, route, item["data"], name)
                    await ws.send_text(item["data"])
                elif item["type"] == "bytes":
                    await ws.send_bytes(item["data"])
                elif item["type"] == "close":
                    await ws.close(code=int(item.get("code", 1000)), reason=item.get("reason", ""))
                    return
        except ReplicaFailed as exc:
            failure.append(str(exc))

    async def up() -> None:
        """From the client to the replica, until the client leaves."""
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    with contextlib.suppress(ReplicaFailed):
                        await ingress.backends.ws_push(name, conn_id, {"type": "disconnect"})
                    return
                if message.get("text") is not None:
                    item = {"type": "text", "data": message["text"]}
                else:
                    item = {"type": "bytes", "data": message.get("bytes") or b""}
                if not await ingress.backends.ws_push(name, conn_id, item):
                    raise ReplicaFailed(f"{name} lost the connection")
        except ReplicaFailed as exc:
            failure.append(str(exc))
        except WebSocketDisconnect:
            return

    tasks = [asyncio.ensure_future(down()), asyncio.ensure_future(up())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        # the replica's side winds down in the background: this handler returns at once
        cleanup = asyncio.ensure_future(_wind_down(tasks, stream))
        _WINDING_DOWN.add(cleanup)
        cleanup.add_done_callback(_WINDING_DOWN.discard)
    if failure:
        log.warning("replica %s failed during a realtime socket: %s", name, failure[0])
        ingress._failed(name)
        if ws.client_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.send_text(
                    json.dumps(
                        replica_failed_event(
                            "the replica serving this connection failed; reconnect with "
                            "?conversation=<id>: the conversation's stored turns are kept"
                        )
                    )
                )
                await ws.close(code=1011)
    elif ws.client_state == WebSocketState.CONNECTED:
        with contextlib.suppress(Exception):
            await ws.close(code=1000)


_WINDING_DOWN: set[asyncio.Future] = set()  # held until done (the loop keeps weak references)


async def _wind_down(tasks: list, stream) -> None:
    await asyncio.wait(tasks)
    with contextlib.suppress(Exception):
        await stream.aclose()  # tells the replica the client is gone (if it is)


async def _watched(ingress: ClusterIngress, name: str, stream):
    """The replica's items; ReplicaFailed as soon as the poller finds it down, even while the
    connection is idle (a dead actor's stream may otherwise wait for its replacement)."""
    while True:
        task = asyncio.ensure_future(anext(stream))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DOWN_CHECK_S)
                if done:
                    break
                load = ingress.router.loads.get(name)
                if load is None or not load.healthy:
                    raise ReplicaFailed(f"{name} is down")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        try:
            yield task.result()
        except StopAsyncIteration:
            return


def _learn_conversation(ingress: ClusterIngress, route: RouteRequest, text: str, name: str):
    """A new conversation's id, from `session.created`: its later turns come here."""
    if route.affinity_key or '"session.created"' not in text[:200]:
        return
    with contextlib.suppress(ValueError, KeyError, TypeError):
        conversation = json.loads(text)["session"]["id"]
        if isinstance(conversation, str):
            ingress.homes.learn(conversation, conversation, name)
            route.affinity_key = conversation
