"""Server-side conversations through the real server and the official openai client: chat
`session_id`, the Responses and Conversations APIs, and the SQLite store across a restart."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai import OpenAI

from ultrafast_harness.bench.server_process import ServerProcess

MODEL = "demo-code"


@pytest.fixture(scope="module")
def db_url(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('sessions')}/sessions.db"


@pytest.fixture(scope="module")
def srv(db_url):
    server = ServerProcess(
        "--priority-ttft-ms", "10000", "--session-store", db_url, max_model_len=1024
    )
    yield server
    server.stop()


@pytest.fixture
def client(srv):
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, content, **extra):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=24,
        temperature=0,
        **extra,
    )


TURNS = ["def add(a, b):", "def sub(a, b):", "def mul(a, b):"]


def _flush_kv(client, num_slots: int = 4) -> None:
    """Fill every KV slot with unrelated prefixes, so a session's cached KV is evicted."""
    for k in range(num_slots + 1):
        client.completions.create(model=MODEL, prompt=f"zq{k} " * 40, max_tokens=1)


def test_chat_session_holds_the_history_and_reuses_its_kv(client):
    replies, usages = [], []
    for text in TURNS:
        r = _chat(client, text, extra_body={"session_id": "chat-kv-1"})
        replies.append(r.choices[0].message.content)
        usages.append(r.usage)
    # the prompt grows by the history the client did not send
    assert usages[0].prompt_tokens < usages[1].prompt_tokens < usages[2].prompt_tokens
    # the next turn's prefill starts exactly where the previous turn's KV ends: its prompt
    # + output, less the last sampled token (never fed back), are all hits, to the token
    for prev, cur in zip(usages, usages[1:]):
        num_computed = prev.prompt_tokens + prev.completion_tokens - 1
        assert cur.prompt_tokens_details.cached_tokens == num_computed > 0
    items = client.conversations.items.list("chat-kv-1", order="asc").data
    assert [i.role for i in items] == ["user", "assistant"] * 3
    assert [i.content[0].text for i in items[1::2]] == replies

    # the slow twin: the same conversation with its KV evicted before every turn, so each
    # turn is recomputed from the stored history, gives the same answers
    for i, text in enumerate(TURNS):
        _flush_kv(client)
        r = _chat(client, text, extra_body={"session_id": "chat-kv-cold"})
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert r.usage.prompt_tokens == usages[i].prompt_tokens
        assert r.choices[0].message.content == replies[i]


def test_retry_with_the_same_idempotency_key_is_one_generation_and_one_turn(srv):
    """F16: a retry after the answer was stored gets that answer back (no second turn); a
    retry while the first attempt still streams gets 409 request_in_progress."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "def idem(x):"}],
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": None,
        "session_id": "chat-idem",
    }
    key = {"Idempotency-Key": "retry-1"}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        first = c.post("/v1/chat/completions", json=body, headers=key)
        again = c.post("/v1/chat/completions", json=body, headers=key)
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True}, headers=key)
        other = c.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "retry-2"})
        items = c.get("/v1/conversations/chat-idem/items", params={"order": "asc"}).json()
        # a second call with a fresh key while a long stream with that key runs
        long_body = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream(
            "POST", "/v1/chat/completions", json=long_body, headers={"Idempotency-Key": "retry-3"}
        ) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)  # the stream started: its user turn is stored
            busy = c.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": "retry-3"})
            assert "data: [DONE]" in list(lines)
    text = first.json()["choices"][0]["message"]["content"]
    assert first.status_code == again.status_code == streamed.status_code == 200
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json()["choices"][0]["message"]["content"] == text  # sampled, yet the same
    deltas = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert (
        "".join(ch["choices"][0]["delta"].get("content") or "" for ch in deltas if ch["choices"])
        == text
    )
    assert streamed.text.rstrip().endswith("data: [DONE]")
    # one user + one assistant turn for retry-1, and one more pair for the other key
    assert [i["role"] for i in items["data"]] == ["user", "assistant"] * 2
    assert items["data"][1]["content"][0]["text"] == text
    assert other.status_code == 200
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "request_in_progress"
    assert busy.headers["retry-after"] == "1"


def test_session_errors_are_openai_envelopes(srv, client):
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, "x", extra_body={"session_id": "../../etc"})
    assert bad.value.body["code"] == "invalid_value" and bad.value.body["param"] == "session_id"
    with pytest.raises(openai.BadRequestError) as bad:
        _chat(client, "x", n=2, extra_body={"session_id": "s-n2"})
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert missing.value.body["code"] == "previous_response_not_found"
    r = httpx.post(srv.url + "/v1/responses", json={"input": "x", "tools_x": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    r = httpx.post(
        srv.url + "/v1/responses", json={"input": "x", "max_output_tokens": 0}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"


def test_responses_chain_retrieve_delete_and_branch(client):
    first = client.responses.create(
        model=MODEL, input="def first():", max_output_tokens=8, temperature=0
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    second = client.responses.create(
        model=MODEL,
        input="def second():",
        max_output_tokens=8,
        temperature=0,
        previous_response_id=first.id,
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    # a second reply to `first` forks: it sees first's history, not `second`
    fork = client.responses.create(
        model=MODEL,
        input="def second():",
        max_output_tokens=8,
        temperature=0,
        previous_response_id=first.id,
    )
    assert fork.usage.input_tokens == second.usage.input_tokens
    assert fork.output_text == second.output_text
    third = client.responses.create(
        model=MODEL,
        input="def third():",
        max_output_tokens=8,
        temperature=0,
        previous_response_id=second.id,
    )
    third_fork = client.responses.create(
        model=MODEL,
        input="def third():",
        max_output_tokens=8,
        temperature=0,
        previous_response_id=fork.id,
    )
    assert third.usage.input_tokens == third_fork.usage.input_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    assert got.previous_response_id == first.id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_responses_stream_uses_openai_event_names(client):
    events = list(
        client.responses.create(
            model=MODEL, input="def f(x):", max_output_tokens=6, temperature=0, stream=True
        )
    )
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert names[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output_text == deltas


def test_stateless_responses_store_nothing(client):
    r = client.responses.create(model=MODEL, input="def g():", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_conversations_api(client):
    conv = client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "def hello():"}],
        metadata={"topic": "x"},
    )
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "x"}
    r = client.responses.create(
        model=MODEL, input="def world():", max_output_tokens=6, conversation=conv.id, temperature=0
    )
    assert r.conversation.id == conv.id
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "more"}]}
        ],
    )
    assert [i.role for i in added.data] == ["user"]
    items = client.conversations.items.list(conv.id, order="asc").data
    assert [(i.role, i.content[0].text) for i in items] == [
        ("user", "def hello():"),
        ("user", "def world():"),
        ("assistant", r.output_text),
        ("user", "more"),
    ]
    # the same history through chat completions' session_id
    chat = _chat(client, "def again():", extra_body={"session_id": conv.id})
    assert chat.usage.prompt_tokens > r.usage.input_tokens
    assert client.conversations.retrieve(conv.id).id == conv.id
    client.conversations.delete(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", conversation=conv.id)


def test_sqlite_history_survives_a_server_restart(db_url):
    first = ServerProcess("--session-store", db_url, max_model_len=1024)
    try:
        c = OpenAI(base_url=first.url + "/v1", api_key="unused", max_retries=0)
        one = _chat(c, "def keep():", extra_body={"session_id": "restart-1"})
        resp = c.responses.create(model=MODEL, input="def chain():", max_output_tokens=6)
    finally:
        assert first.stop() == 0
    second = ServerProcess("--session-store", db_url, max_model_len=1024)
    try:
        c = OpenAI(base_url=second.url + "/v1", api_key="unused", max_retries=0)
        items = c.conversations.items.list("restart-1", order="asc").data
        assert [i.content[0].text for i in items] == ["def keep():", one.choices[0].message.content]
        two = _chat(c, "def more():", extra_body={"session_id": "restart-1"})
        assert two.usage.prompt_tokens > one.usage.prompt_tokens + one.usage.completion_tokens
        after = c.responses.create(
            model=MODEL, input="def next():", max_output_tokens=6, previous_response_id=resp.id
        )
        assert after.usage.input_tokens > resp.usage.input_tokens + resp.usage.output_tokens
    finally:
        second.stop()
