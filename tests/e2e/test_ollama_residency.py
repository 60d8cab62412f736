"""Ollama's API over several resident models (`serve --models`): `name:tag` resolution for
each, `keep_alive` through the residency cache (0 unloads the model when its call ends, a
duration shows in `/api/ps` as `expires_at`), and `/api/tags` / `/api/ps` / `/api/show`
listing the served and the loaded models."""

from __future__ import annotations

import datetime as dt
import time

import httpx
import pytest

from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess


@pytest.fixture(scope="module")
def srv():
    server = ServerProcess(
        "--models",
        f"code={DEMO_MODEL_DIR},draft={DEMO_DRAFT_DIR}",
        "--no-preload",
        "--threads",
        "1",
        "--priority-ttft-ms",
        "10000",
        model=None,
        num_slots=2,
    )
    yield server
    server.stop()


def chat(srv, model: str, keep_alive) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "def f():"}],
        "stream": False,
        "keep_alive": keep_alive,
        "options": {"temperature": 0, "num_predict": 2},
    }
    r = httpx.post(srv.url + "/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def loaded(srv) -> dict[str, dict]:
    return {m["model"]: m for m in httpx.get(srv.url + "/api/ps").json()["models"]}


def test_tags_list_every_served_model(srv):
    names = [m["model"] for m in httpx.get(srv.url + "/api/tags").json()["models"]]
    assert names == ["code:latest", "draft:latest"]


def test_keep_alive_goes_through_the_residency_cache(srv):
    chat(srv, "draft:latest", "1h")
    entry = loaded(srv)["draft:latest"]
    expires = dt.datetime.fromisoformat(entry["expires_at"].replace("Z", "+00:00"))
    left_s = (expires - dt.datetime.now(dt.timezone.utc)).total_seconds()
    assert 3000 < left_s <= 3600 and entry["size"] > 0
    shown = httpx.post(srv.url + "/api/show", json={"model": "draft"}).json()
    assert "<|im_start|>" in shown["template"]  # loaded: its own tokenizer's template
    done = chat(srv, "draft", 0)  # 0: unload as soon as the call ends
    assert done["load_duration"] > 0
    deadline = time.monotonic() + 30
    while "draft:latest" in loaded(srv) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "draft:latest" not in loaded(srv)


def test_empty_chat_loads_the_model(srv):
    r = httpx.post(srv.url + "/api/chat", json={"model": "draft:latest", "messages": []})
    assert r.json()["done_reason"] == "load"
    assert "draft:latest" in loaded(srv)
