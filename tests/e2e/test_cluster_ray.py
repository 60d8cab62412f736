"""`ultrafast cluster` at CI size: a local Ray instance, 2 replicas of the demo model (1 kernel
thread each), one redis-server on loopback. Conversations stay on their replica with a warm
cache; a tenant's rate limit holds across both replicas; killing a replica leaves every
conversation able to go on, with its whole history, on the other one, its KV restored from
the Redis KV tier; /v1/realtime is relayed both ways and ends with an error event when its
replica dies."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import httpx
import pytest
import redis
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

pytest.importorskip("ray", reason="ray is not installed: `pip install 'ultrafast[ray]'`")

from tests.e2e.test_sessions_redis_realtime import _events_until  # noqa: E402
from ultrafast_harness.cluster.process import ClusterProcess  # noqa: E402

MAIN_KEY, LIMITED_KEY = "uf-test-cluster-main", "uf-test-cluster-limited"
LIMITED_BURST = 4
CONVERSATIONS, TURNS = 6, 3
L3_HITS = 'ultrafast_kv_tier_hit_tokens_total{replica="all",tier="L3_redis"}'
RESTORED = 'ultrafast_kv_restored_bytes_total{replica="all"}'


def _keys_file(path) -> str:
    def tenant(name, key, **limits):
        digest = hashlib.sha256(key.encode()).hexdigest()
        return {
            "name": name,
            "tiers": ["priority", "default", "flex"],
            "keys": [{"sha256": digest}],
            "scopes": ["inference", "metrics"],
            **limits,
        }

    spec = {
        "tenants": [
            tenant("main", MAIN_KEY),
            # no refill to speak of during the test: the bucket's depth is the whole allowance
            tenant("limited", LIMITED_KEY, requests_per_s=0.002, burst_s=LIMITED_BURST * 500),
        ]
    }
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    keys = _keys_file(tmp_path_factory.mktemp("keys") / "keys.json")
    started = time.monotonic()
    proc = ClusterProcess(
        "--num-slots",
        "4",
        "--max-model-len",
        "2048",
        "--session-store",
        redis_server.url,
        "--kv-store",
        redis_server.url,
        "--api-keys",
        keys,
        "--priority-ttft-ms",
        "10000",
    )
    print(f"cluster ready in {time.monotonic() - started:.1f} s")
    yield proc
    proc.stop()


def _chat(cluster, session_id, content, key=MAIN_KEY):
    return httpx.post(
        cluster.url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
        json={
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "session_id": session_id,
        },
    )


def _replicas(cluster) -> dict:
    return cluster.replicas({"Authorization": f"Bearer {MAIN_KEY}"})


def _metric(text: str, series: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(series))


def _realtime(cluster, query=""):
    url = cluster.url.replace("http://", "ws://") + "/v1/realtime" + query
    return connect(url, additional_headers={"Authorization": f"Bearer {MAIN_KEY}"})


def _realtime_turn(ws, text: str) -> list[dict]:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    assert _events_until(ws, "conversation.item.created")[-1]["type"] != "error"
    ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 6}}))
    return _events_until(ws, "response.done")


def test_realtime_is_relayed_to_one_replica_and_its_conversation_stays_there(cluster):
    with _realtime(cluster) as ws:
        replica = ws.response.headers["x-ultrafast-replica"]
        created = json.loads(ws.recv(timeout=30))
        assert created["type"] == "session.created"
        conversation = created["session"]["id"]
        events = _realtime_turn(ws, "def fibonacci(n):")
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        done = events[-1]["response"]
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == deltas
        ws.send("not json")  # the replica's own validation comes back through the relay
        assert json.loads(ws.recv(timeout=30))["error"]["code"] == "invalid_json"
    # the conversation's HTTP turn goes where its KV is, and sees the realtime turn
    r = _chat(cluster, conversation, "def more(x):")
    assert r.status_code == 200, r.text
    assert r.headers["x-ultrafast-replica"] == replica
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with _realtime(cluster, f"?conversation={conversation}") as ws:  # reconnect: same replica
        assert ws.response.headers["x-ultrafast-replica"] == replica
        assert json.loads(ws.recv(timeout=30))["session"]["id"] == conversation


def test_sessions_stay_warm_limits_hold_across_replicas_and_a_kill_loses_no_history(
    cluster, redis_server
):
    auth = {"Authorization": f"Bearer {MAIN_KEY}"}
    homes, prompt_tokens, sent = {}, {}, {}
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            sid = f"conv-{c}"
            text = f"def turn_{turn}_of_{c}(x):"
            r = _chat(cluster, sid, text)
            assert r.status_code == 200, r.text
            sent.setdefault(sid, []).append(text)
            assert r.headers["x-session-id"] == sid
            replica = r.headers["x-ultrafast-replica"]
            assert homes.setdefault(sid, replica) == replica  # affinity: one replica per session
            usage = r.json()["usage"]
            if turn >= 1:
                assert usage["prompt_tokens_details"]["cached_tokens"] > 0, (sid, turn, usage)
            prompt_tokens[sid] = usage["prompt_tokens"]
    assert len(set(homes.values())) == 2  # the six sessions spread over both replicas
    # HTTP calls reach same-machine replicas on their loopback ports (past Ray's handles)
    assert {r["relay"] for r in _replicas(cluster).values()} == {"direct"}

    # one tenant through both replicas gets its bucket's depth once, not once per replica
    by_replica = {}
    for sid in sorted(homes):  # sessions whose homes are both replicas
        for _ in range(2):
            r = _chat(cluster, f"limited-{sid}", "x = 1", key=LIMITED_KEY)
            assert r.status_code in (200, 429), r.text
            by_replica.setdefault(r.headers["x-ultrafast-replica"], []).append(r.status_code)
    codes = [c for cs in by_replica.values() for c in cs]
    assert codes.count(200) == LIMITED_BURST and codes.count(429) == len(codes) - LIMITED_BURST
    assert len(by_replica) == 2

    metrics = httpx.get(cluster.url + "/metrics", headers=auth, timeout=30).text
    assert 'ultrafast_cluster_routing_decisions_total{tier="default",reason="affinity"}' in metrics
    assert 'replica="engine-0"' in metrics and 'replica="all"' in metrics

    kv = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 30
    while not kv.keys("uf:kv:*") and time.monotonic() < deadline:  # written after each turn
        time.sleep(0.2)
    assert kv.keys("uf:kv:*"), "no conversation KV reached the Redis tier"
    victim = homes["conv-0"]
    survivor = next(r for r in set(homes.values()) if r != victim)
    # the survivor's count so far (the victim's goes with it; the replacement starts at 0)
    l3_hits_before = _metric(metrics, L3_HITS.replace('"all"', f'"{survivor}"'))
    killed_pid = _replicas(cluster)[victim]["pid"]
    os.kill(killed_pid, signal.SIGKILL)
    for c in range(CONVERSATIONS):
        sid = f"conv-{c}"
        text = f"def after_kill_{c}(x):"
        r = _chat(cluster, sid, text)
        assert r.status_code == 200, r.text
        sent[sid].append(text)
        if r.headers["x-ultrafast-replica"] == victim:  # Ray's replacement, a new process
            assert _replicas(cluster)[victim]["pid"] != killed_pid
        # the whole history came along: the prompt holds every earlier turn
        assert r.json()["usage"]["prompt_tokens"] > prompt_tokens[sid]
        items = httpx.get(
            f"{cluster.url}/v1/conversations/{sid}/items?order=asc", headers=auth, timeout=30
        ).json()["data"]
        users = [i["content"][0]["text"] for i in items if i["role"] == "user"]
        assert users == sent[sid]  # each turn stored exactly once, in order
    # the moved conversations restored their KV from Redis instead of recomputing it
    metrics = httpx.get(cluster.url + "/metrics", headers=auth, timeout=30).text
    assert _metric(metrics, L3_HITS) > l3_hits_before and _metric(metrics, RESTORED) > 0


def test_a_realtime_connection_whose_replica_dies_gets_an_error_event_then_closes(cluster):
    with _realtime(cluster) as ws:
        replica = ws.response.headers["x-ultrafast-replica"]
        assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
        os.kill(_replicas(cluster)[replica]["pid"], signal.SIGKILL)
        event = json.loads(ws.recv(timeout=60))  # idle: the relay notices without a message
        assert event["type"] == "error" and event["error"]["code"] == "replica_failed"
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
