"""`serve` flags from the user's side: `--api-key` (the page still loads, the API needs the key),
one access-log line per request and `--no-access-log`, and `--log-level`."""

import json
import re
import time

import httpx
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 6}


def wait_for(srv: ServerProcess, pattern: str, timeout_s: float = 10) -> re.Match | None:
    """The first match of `pattern` in the server's output (the access line is written once
    the response is sent, so poll briefly)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = re.search(pattern, srv.output(), re.MULTILINE)
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


@pytest.fixture(scope="module")
def keyed():
    srv = ServerProcess("--priority-ttft-ms", "10000", "--api-key", "sk-one", "--api-key", "sk-2")
    yield srv
    srv.stop()


def test_api_key_flag_guards_the_api_but_not_the_page(keyed):
    assert httpx.get(keyed.url + "/").status_code == 200  # the playground asks for the key
    r = httpx.post(keyed.url + CHAT, json=BODY)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    r = httpx.post(keyed.url + CHAT, json=BODY, headers={"Authorization": "Bearer sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for key in ("sk-one", "sk-2"):
        r = httpx.post(
            keyed.url + CHAT,
            json={**BODY, "service_tier": "priority"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-service-tier"] == "priority"  # every tier is open to these keys


def test_one_access_line_per_request(keyed):
    headers = {"Authorization": "Bearer sk-one"}
    streamed = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(keyed.url + CHAT, json=streamed, headers=headers)
    assert r.status_code == 200
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    usage = next(c["usage"] for c in chunks if c.get("usage"))  # the stream's own count
    request_id = r.headers["x-request-id"]
    line = wait_for(
        keyed,
        r'INFO ultrafast\.access: 127\.0\.0\.1 "POST /v1/chat/completions" 200 tier=(\w+) '
        r"prompt_tokens=(\d+) completion_tokens=(\d+) ttft_ms=([\d.]+) duration_ms=([\d.]+) "
        f"id={request_id}$",
    )
    assert line, keyed.output()[-2000:]
    tier, prompt, completion, ttft, duration = line.groups()
    assert tier == r.headers["x-service-tier"]
    assert int(prompt) == usage["prompt_tokens"]
    assert int(completion) == usage["completion_tokens"] and 1 <= int(completion) <= 6
    assert 0 < float(ttft) <= float(duration)
    # a refusal before routing is logged too, with no tier or tokens
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert wait_for(
        keyed,
        r'"GET /v1/models" 401 tier=- prompt_tokens=- completion_tokens=- ttft_ms=- ',
    )
    output = keyed.output()
    assert "sk-one" not in output and "sk-2" not in output  # keys never reach the log
    assert len(re.findall(f"id={request_id}$", output, re.MULTILINE)) == 1  # one per request


def test_no_access_log_and_log_level():
    srv = ServerProcess("--priority-ttft-ms", "10000", "--no-access-log", "--log-level", "warning")
    try:
        assert httpx.post(srv.url + CHAT, json=BODY).status_code == 200
        assert httpx.get(srv.url + "/v1/nothing").status_code == 404
        time.sleep(0.5)
    finally:
        srv.stop()
    output = srv.output()
    assert '"POST /v1/chat/completions"' not in output and "/v1/nothing" not in output
    assert " INFO " not in output  # the start-up info lines are gone at --log-level warning
