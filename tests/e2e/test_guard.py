"""The output safety filter on the real server: a pattern spread over several tokens of a greedy
reply is caught, the stream ends with finish_reason "content_filter" and nothing at or past the
match is sent; non-streaming replies are cut the same way; a reply the guard does not match is
byte-identical to the unguarded server's."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

from ultrafast_harness.bench.server_process import ServerProcess

HIT_PROMPT, MISS_PROMPT = "def fibonacci(n):", "import os\n"
GREEDY = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
HOLD_BACK = 4


def completion(url: str, prompt: str, **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, **GREEDY, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def pick_pattern(url: str) -> tuple[str, int]:
    """Three consecutive tokens of the unguarded greedy reply (not the first few), chosen so that
    their first occurrence starts at a token boundary: (text, offset of that occurrence)."""
    choice = completion(url, HIT_PROMPT, logprobs=0)["choices"][0]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    text = choice["text"]
    base = offsets[0]
    for k in range(HOLD_BACK + 1, len(tokens) - 3):  # something streams before the cut
        needle = "".join(tokens[k : k + 3])
        if len(needle.strip()) >= 4 and text.lower().find(needle.lower()) == offsets[k] - base:
            return needle, offsets[k] - base
    raise AssertionError(f"no usable pattern in {text!r}")


@pytest.fixture(scope="module")
def guarded(server):
    needle, start = pick_pattern(server.url)
    baseline_hit = completion(server.url, HIT_PROMPT)["choices"][0]["text"]
    baseline_miss = completion(server.url, MISS_PROMPT)["choices"][0]["text"]
    assert needle.lower() not in baseline_miss.lower()
    srv = ServerProcess(
        "--guard-pattern",
        re.escape(needle),
        "--guard-hold-back-tokens",
        str(HOLD_BACK),
        "--priority-ttft-ms",
        "10000",
    )
    yield srv, needle, start, baseline_hit, baseline_miss
    srv.stop()


def stream_events(url: str, prompt: str) -> list[dict | str]:
    events = []
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        timeout=60,
        json={"prompt": prompt, "stream": True, **GREEDY},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_stream_is_cut_before_a_pattern_split_over_tokens(guarded):
    srv, needle, start, baseline, _ = guarded
    events = stream_events(srv.url, HIT_PROMPT)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "content_filter" and finishes.count("content_filter") == 1
    assert all(f is None for f in finishes[:-1])
    sent = "".join(c["choices"][0]["text"] for c in chunks)
    assert baseline.startswith(sent)  # what was sent is the real reply, up to the cut
    assert len(sent) <= start  # nothing at or past the match
    assert needle.lower() not in sent.lower()
    assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1  # it did stream first


def test_non_streaming_reply_is_cut_too(guarded):
    srv, needle, start, baseline, _ = guarded
    body = completion(srv.url, HIT_PROMPT)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert baseline.startswith(choice["text"]) and len(choice["text"]) <= start
    assert body["usage"]["completion_tokens"] < GREEDY["max_tokens"]  # generation was aborted
    metrics = httpx.get(srv.url + "/metrics").text
    cuts = [line for line in metrics.splitlines() if line.startswith("ultrafast_guard_cuts_total")]
    assert cuts and float(cuts[0].split()[-1]) >= 1


def test_a_reply_the_guard_does_not_match_is_unchanged(guarded):
    srv, _, _, _, baseline_miss = guarded
    events = stream_events(srv.url, MISS_PROMPT)
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == baseline_miss
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert completion(srv.url, MISS_PROMPT)["choices"][0]["text"] == baseline_miss


def test_unguarded_server_streams_the_same_text_as_its_json(server):
    events = stream_events(server.url, HIT_PROMPT)
    text = "".join(c["choices"][0]["text"] for c in events[:-1])
    assert text == completion(server.url, HIT_PROMPT)["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_bad_guard_file_fails_at_start_with_a_clear_error(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{oops")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "serve",
            "--guard-patterns",
            str(path),
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_without_keys_the_server_says_it_is_loopback_only(guarded):
    srv = guarded[0]
    srv.stop()
    assert "no --api-keys: authentication is off, listening on loopback only" in srv.output()
