"""The cluster ingress without Ray (cluster/ingress.py): scripted replicas stand in for the
Serve handles, so failover, mid-stream failure, refusals and the merged /metrics are exact."""

import asyncio

import httpx
from starlette.requests import Request as HTTPRequest
from starlette.responses import PlainTextResponse

from ultrafast.cluster.health import DeathWatch, ReplicaPoller, merge_metrics
from ultrafast.cluster.ingress import ClusterIngress, ReplicaFailed
from ultrafast.cluster.ingress_app import build_ingress_app
from ultrafast.cluster.router import Router, RouterConfig, rendezvous

SSE = ("content-type", "text/event-stream")


class ScriptedBackends:
    """Each replica answers by its script: "ok", "dead" (fails before answering), "cut" (fails
    after its first event), "hang" (never answers)."""

    def __init__(self, scripts: dict):
        self.scripts = scripts
        self.calls: list[tuple[str, dict]] = []

    def names(self):
        return list(self.scripts)

    async def forward(self, name, request):
        self.calls.append((name, request))
        script = self.scripts[name]
        if script == "dead":
            raise ReplicaFailed("actor died")
        if script == "hang":
            await asyncio.sleep(3600)
        yield {"status": 200, "headers": [SSE, ("x-request-id", "resp_abc123")]}
        yield b'data: {"id": "resp_abc123"}\n\n'
        if script == "cut":
            raise ReplicaFailed("actor died mid-stream")
        yield b"data: [DONE]\n\n"

    async def metrics_text(self, name):
        return (
            "# HELP ultrafast_requests_total calls\n# TYPE ultrafast_requests_total counter\n"
            f'ultrafast_requests_total{{tier="default"}} {2 if name == "a" else 3}\n'
        )


def _client(backends, router=None):
    router = router or Router(backends.names())
    ingress = ClusterIngress(backends, router)

    async def metrics(http: HTTPRequest):
        texts = {n: await backends.metrics_text(n) for n in backends.names()}
        return PlainTextResponse(merge_metrics(texts, router, dict.fromkeys(texts, True)))

    async def ready(http: HTTPRequest):
        return PlainTextResponse("ok")

    app = build_ingress_app(ingress, metrics, ready, None, ())
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1"), ingress, router


def _chat(session_id="s1", **extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "session_id": session_id}
    return {**body, **extra}


async def _post(client, body, path="/v1/chat/completions"):
    return await client.post(path, json=body)


def test_a_replica_dead_before_answering_is_retried_on_another_with_one_idempotency_key():
    async def go():
        backends = ScriptedBackends({"a": "ok", "b": "ok"})
        client, ingress, router = _client(backends)
        home = (await _post(client, _chat())).headers["x-ultrafast-replica"]
        other = "b" if home == "a" else "a"
        backends.scripts[home] = "dead"
        r = await _post(client, _chat())
        assert r.status_code == 200 and r.headers["x-ultrafast-replica"] == other
        assert r.headers["x-session-id"] == "s1"
        keys = [dict(req["headers"]).get(b"idempotency-key") for _, req in backends.calls[-2:]]
        assert keys[0] is not None and keys[0] == keys[1]  # the retry stores the turn once
        assert ingress.failures == {home: 1} and not router.loads[home].healthy

    asyncio.run(go())


def test_a_replica_failing_mid_stream_ends_it_with_an_error_event_and_done():
    async def go():
        client, _, _ = _client(ScriptedBackends({"a": "cut"}))
        r = await _post(client, _chat(stream=True))
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert '"code":"replica_failed"' in events[-2] and events[-1] == "data: [DONE]"

    asyncio.run(go())


def test_a_call_waiting_on_a_replica_found_down_moves_to_another():
    async def go():
        backends = ScriptedBackends({"a": "hang", "b": "ok"})
        client, _, router = _client(backends)
        # pin the session to the hanging replica, then let the poller find it down
        key = next(f"s{i}" for i in range(100) if rendezvous(f"s{i}", ["a", "b"])[0] == "a")
        call = asyncio.ensure_future(_post(client, _chat(key)))
        await asyncio.sleep(0.3)
        router.mark_down("a")
        r = await asyncio.wait_for(call, 5)
        assert r.status_code == 200 and r.headers["x-ultrafast-replica"] == "b"

    asyncio.run(go())


def test_priority_refused_at_once_when_no_replica_meets_its_target():
    async def go():
        backends = ScriptedBackends({"a": "ok"})
        router = Router(["a"], RouterConfig(ttft_target_s={"priority": 0.01}))
        router.report("a", {"per_token_s": 0.01, "pending_tokens": {"priority": 100}})
        client, _, _ = _client(backends, router)
        r = await _post(client, _chat(service_tier="priority"))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "priority_capacity"
        assert backends.calls == []
        metrics = (await client.get("/metrics")).text
        assert 'ultrafast_cluster_routing_decisions_total{tier="priority",reason="refused"} 1' in (
            metrics
        )
        assert 'ultrafast_requests_total{replica="a",tier="default"} 2' in metrics

    asyncio.run(go())


def test_responses_chains_follow_their_first_response_and_metrics_sum_replicas():
    async def go():
        client, ingress, _ = _client(ScriptedBackends({"a": "ok", "b": "ok"}))
        first = await _post(client, {"input": "hi"}, "/v1/responses")
        home = first.headers["x-ultrafast-replica"]
        assert first.headers["x-session-id"] == "resp_abc123"
        for _ in range(3):
            body = {"input": "more", "previous_response_id": "resp_abc123"}
            nxt = await _post(client, body, "/v1/responses")
            assert nxt.headers["x-ultrafast-replica"] == home
        metrics = (await client.get("/metrics")).text
        assert 'ultrafast_requests_total{replica="all",tier="default"} 5.0' in metrics

    asyncio.run(go())


def test_the_poller_routes_around_a_replica_that_does_not_answer():
    async def go():
        router = Router(["a", "b"])

        async def stats(name):
            if name == "a":
                await asyncio.sleep(10)
            return {"ready": True, "pid": 7}

        poller = ReplicaPoller(router, lambda: ["a", "b"], stats, timeout_s=0.05)
        await poller.poll_once()
        assert not router.loads["a"].healthy and router.loads["b"].healthy
        assert poller.last["a"]["ready"] is False

    asyncio.run(go())


def test_an_oversized_body_is_refused_at_the_ingress_like_the_single_server():
    async def go():
        backends = ScriptedBackends({"a": "ok"})
        client, ingress, _ = _client(backends)
        ingress.max_body_bytes = 100
        r = await client.post("/v1/chat/completions", content=b"x" * 101)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert backends.calls == []

    asyncio.run(go())


def test_a_moved_conversation_stays_on_its_new_replica_when_the_old_one_comes_back():
    async def go():
        backends = ScriptedBackends({"a": "ok", "b": "ok"})
        client, _, router = _client(backends)
        key = next(f"s{i}" for i in range(100) if rendezvous(f"s{i}", ["a", "b"])[0] == "a")
        assert (await _post(client, _chat(key))).headers["x-ultrafast-replica"] == "a"
        backends.scripts["a"] = "dead"
        assert (await _post(client, _chat(key))).headers["x-ultrafast-replica"] == "b"
        backends.scripts["a"] = "ok"
        router.report("a", {"ready": True})  # its replacement is up, with an empty cache
        r = await _post(client, _chat(key))
        assert r.headers["x-ultrafast-replica"] == "b"  # where the conversation's KV is now

    asyncio.run(go())


def test_the_death_watch_routes_around_a_replica_the_moment_its_call_breaks():
    async def go():
        router = Router(["a", "b"])
        died = asyncio.Event()

        async def watch(name):
            yield 1
            if name == "a":
                await died.wait()
                raise ReplicaFailed("ActorDiedError")
            await asyncio.sleep(3600)

        death_watch = DeathWatch(router, lambda: ["a", "b"], watch, retry_s=3600)
        death_watch.start()
        await asyncio.sleep(0.05)
        assert router.loads["a"].healthy and router.loads["b"].healthy
        died.set()
        await asyncio.sleep(0.05)
        assert not router.loads["a"].healthy and router.loads["b"].healthy
        death_watch.stop()

    asyncio.run(go())


def test_a_responses_call_gets_one_idempotency_key_across_a_retry():
    async def go():
        backends = ScriptedBackends({"a": "dead", "b": "dead"})  # tried on both, in turn
        client, _, _ = _client(backends)
        r = await _post(client, {"input": "hi"}, path="/v1/responses")
        assert r.status_code == 503
        keys = [dict(req["headers"]).get(b"idempotency-key") for _, req in backends.calls]
        assert len(keys) == 2 and keys[0] is not None and keys[0] == keys[1]

    asyncio.run(go())
