"""The ingress's /v1/realtime relay without Ray (cluster/realtime_relay.py): in-process replicas
(asgi_websocket.py over a small Starlette app) stand in for the Serve handles, so affinity,
both directions, closing from either side and a replica's death are exact."""

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request as HTTPRequest
from starlette.responses import PlainTextResponse
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from ultrafast.cluster.asgi_websocket import WebSocketCalls
from ultrafast.cluster.ingress import ClusterIngress, ReplicaFailed
from ultrafast.cluster.ingress_app import build_ingress_app
from ultrafast.cluster.router import Router, rendezvous


def _replica_app(name: str, seen: list) -> Starlette:
    """session.created names the conversation; each text is echoed with the replica's name;
    "bye" makes the replica close the socket."""

    async def realtime(ws: WebSocket) -> None:
        await ws.accept()
        conversation = ws.query_params.get("conversation") or f"conv_new_{name}"
        await ws.send_text(json.dumps({"type": "session.created", "session": {"id": conversation}}))
        try:
            while True:
                text = await ws.receive_text()
                seen.append((name, text))
                if text == "bye":
                    await ws.close(code=1000)
                    return
                await ws.send_text(json.dumps({"type": "echo", "replica": name, "text": text}))
        except WebSocketDisconnect:
            seen.append((name, "disconnected"))

    return Starlette(routes=[WebSocketRoute("/v1/realtime", realtime)])


class InProcessReplicas:
    def __init__(self, names):
        self.seen: list = []
        self.calls = {n: WebSocketCalls(_replica_app(n, self.seen)) for n in names}
        self.dead: set[str] = set()

    def names(self):
        return list(self.calls)

    async def forward(self, name, request):  # not used here
        raise ReplicaFailed("no HTTP in this test")
        yield

    async def metrics_text(self, name):
        return ""

    async def ws_open(self, name, conn_id, request):
        if name in self.dead:
            raise ReplicaFailed("actor died")
        async for item in self.calls[name].open(conn_id, request):
            if name in self.dead:
                raise ReplicaFailed("actor died mid-connection")
            yield item

    async def ws_push(self, name, conn_id, message):
        if name in self.dead:
            raise ReplicaFailed("actor died")
        return await self.calls[name].push(conn_id, message)


def _client(replicas):
    router = Router(replicas.names())
    ingress = ClusterIngress(replicas, router)

    async def plain(http: HTTPRequest):
        return PlainTextResponse("ok")

    return TestClient(build_ingress_app(ingress, plain, plain, None, ())), ingress, router


def test_a_conversation_goes_to_its_replica_both_ways_and_a_new_one_is_learned():
    replicas = InProcessReplicas(["a", "b"])
    client, ingress, _ = _client(replicas)
    key = next(f"c{i}" for i in range(100) if rendezvous(f"c{i}", ["a", "b"])[0] == "b")
    with client.websocket_connect(f"/v1/realtime?conversation={key}") as ws:
        assert json.loads(ws.receive_text())["session"]["id"] == key
        for text in ("one", "two"):
            ws.send_text(text)
            assert json.loads(ws.receive_text()) == {"type": "echo", "replica": "b", "text": text}
    with client.websocket_connect("/v1/realtime") as ws:  # new: the least loaded, learned
        created = json.loads(ws.receive_text())["session"]["id"]
        home = created.removeprefix("conv_new_")
    assert ingress.homes.replica_of(created) == home


def test_the_replica_closing_closes_the_client_and_the_client_leaving_tells_the_replica():
    replicas = InProcessReplicas(["a"])
    client, _, router = _client(replicas)
    with client.websocket_connect("/v1/realtime?conversation=x") as ws:
        ws.receive_text()
        ws.send_text("bye")
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1000
    with client.websocket_connect("/v1/realtime?conversation=y") as ws:
        ws.receive_text()
        ws.send_text("hello")
        ws.receive_text()
    for _ in range(50):  # the replica's app sees the disconnect (its task ends)
        if ("a", "disconnected") in replicas.seen:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert ("a", "disconnected") in replicas.seen
    assert router.loads["a"].healthy


def test_a_replica_dying_mid_connection_sends_an_error_event_then_closes():
    replicas = InProcessReplicas(["a", "b"])
    client, ingress, router = _client(replicas)
    with client.websocket_connect("/v1/realtime?conversation=z") as ws:
        ws.receive_text()
        home = rendezvous("z", ["a", "b"])[0]
        replicas.dead.add(home)
        ws.send_text("are you there")
        event = json.loads(ws.receive_text())
        assert event["type"] == "error" and event["error"]["code"] == "replica_failed"
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1011
    assert not router.loads[home].healthy and ingress.failures[home] == 1
    # the next connection for the conversation goes to the live replica
    with client.websocket_connect("/v1/realtime?conversation=z") as ws:
        ws.receive_text()
        ws.send_text("again")
        assert json.loads(ws.receive_text())["replica"] != home


def test_an_idle_connection_on_a_replica_found_down_gets_the_error_event():
    replicas = InProcessReplicas(["a"])
    client, _, router = _client(replicas)
    with client.websocket_connect("/v1/realtime?conversation=idle") as ws:
        ws.receive_text()
        router.mark_down("a")  # the poller's verdict; nothing is sent either way
        event = json.loads(ws.receive_text())
        assert event["error"]["code"] == "replica_failed"
        with pytest.raises(WebSocketDisconnect):
            ws.receive_text()
