"""`ultrafast serve --models` with two models and a budget that fits one (issue 20, part 4):
a call for the other model waits for the one in flight instead of cutting it, the swap is
seen in /v1/models and /metrics, and a model whose files disappeared while it was not
resident is a 503 naming it, with the server still serving."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ultrafast.model_files import resolve_model
from ultrafast.server.residency.budget import resident_bytes
from ultrafast_harness.bench.server_process import ServerProcess

NUM_SLOTS, MAX_LEN = 2, 512


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    draft = tmp_path_factory.mktemp("models") / "draft"
    shutil.copytree(DEMO_DRAFT_DIR, draft)  # a copy this test may delete
    sizes = [resident_bytes(resolve_model(p), NUM_SLOTS, MAX_LEN) for p in (DEMO_MODEL_DIR, draft)]
    srv = ServerProcess(
        "--models",
        f"code={DEMO_MODEL_DIR},draft={draft}",
        "--max-resident-bytes",
        str(max(sizes) + 1),  # one of them, never both
        "--threads",
        "1",
        "--priority-ttft-ms",
        "10000",
        model=None,
        num_slots=NUM_SLOTS,
        max_model_len=MAX_LEN,
    )
    yield srv, draft
    srv.stop()


def complete(url: str, model: str, max_tokens: int = 24, **extra) -> httpx.Response:
    body = {
        "model": model,
        "prompt": "def fibonacci(n):",
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=120)


def statuses(url: str) -> dict[str, str]:
    data = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["status"] for m in data}


def test_swap_waits_for_the_call_in_flight_and_keeps_its_output(two_models):  # F33
    srv, _ = two_models
    assert statuses(srv.url) == {"code": "loaded", "draft": "unloaded"}
    reference = complete(srv.url, "code", max_tokens=48).json()["choices"][0]["text"]
    streamed: list[dict] = []
    first_chunk = threading.Event()

    def stream_code() -> None:
        body = {
            "model": "code",
            "prompt": "def fibonacci(n):",
            "max_tokens": 48,
            "stream": True,
            "temperature": 0,
        }
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(httpx.Response(200, content=line[6:]).json())
                    first_chunk.set()

    thread = threading.Thread(target=stream_code)
    thread.start()
    assert first_chunk.wait(60)  # code's call is in flight now
    draft = complete(srv.url, "draft")  # needs code's room: waits for its stream to end
    thread.join(120)
    assert draft.status_code == 200, draft.text
    assert draft.json()["model"] == "draft"
    text = "".join(c["choices"][0]["text"] for c in streamed if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in streamed if c["choices"]]
    assert text == reference and finishes[-1] == "length"  # whole and unchanged
    assert statuses(srv.url) == {"code": "unloaded", "draft": "loaded"}
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'ultrafast_model_evictions_total{reason="budget"} 1.0' in metrics
    assert 'ultrafast_model_loads_total{reason="demand"} 1.0' in metrics
    assert "ultrafast_model_load_seconds_count 1.0" in metrics


def test_bad_requests_name_the_model(two_models):
    srv, _ = two_models
    r = complete(srv.url, "nope")
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    r = complete(srv.url, "code", keep_alive="a while")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    r = httpx.get(srv.url + "/v1/models/draft", timeout=10)
    assert r.status_code == 200 and r.json()["status"] in ("loaded", "unloaded")


def test_keep_alive_zero_unloads_when_the_call_ends(two_models):
    srv, _ = two_models
    assert complete(srv.url, "code", max_tokens=4, keep_alive=0).status_code == 200
    deadline = time.monotonic() + 30
    while statuses(srv.url)["code"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert statuses(srv.url) == {"code": "unloaded", "draft": "unloaded"}
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'ultrafast_model_evictions_total{reason="keep_alive"} 1.0' in metrics


def test_files_gone_while_not_resident_is_a_503(two_models):  # F34
    srv, draft = two_models
    assert complete(srv.url, "code", max_tokens=4).status_code == 200  # draft unloads
    assert statuses(srv.url)["draft"] == "unloaded"
    shutil.rmtree(draft)
    r = complete(srv.url, "draft", max_tokens=4)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "model_unavailable" and "'draft'" in error["message"]
    assert complete(srv.url, "code", max_tokens=4).status_code == 200  # still serving
    assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200


def test_sigterm_drains_a_stream_of_the_second_model(tmp_path):  # F5 with several models
    srv = ServerProcess(
        "--models",
        f"draft={DEMO_DRAFT_DIR},code={DEMO_MODEL_DIR}",  # the stream is not the default's
        "--drain-timeout-s",
        "120",
        "--threads",
        "1",
        "--priority-ttft-ms",
        "10000",
        model=None,
        num_slots=NUM_SLOTS,
        max_model_len=2048,
    )
    try:
        body = {  # longer than uvicorn's 3 s graceful close: only the drain keeps it
            "model": "code",
            "prompt": "def fibonacci(n):",
            "max_tokens": 2000,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        finishes, usage = [], {}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if srv.proc.poll() is None and not finishes and chunk["choices"]:
                    srv.proc.terminate()  # SIGTERM with the stream in flight
                    finishes.append(None)
                finishes += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
                usage = chunk.get("usage") or usage
        assert finishes[-1] == "length" and usage["completion_tokens"] == 2000
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()
