"""OpenAI conformance of the Responses, Conversations and stored chat completions APIs (issue 16,
part 4), through the official openai client and raw HTTP against the real server (SQLite store):
explicit defaults accepted, exact item paths and Responses field names in errors, usage
details, no `"user": null`, `logprobs` on conversation items, conversation metadata updates,
and `store: true` chat completions (get, list with filters and cursor, messages, delete)."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from ultrafast_harness.bench.server_process import ServerProcess

MODEL = "demo-code"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    db_url = f"sqlite:///{tmp_path_factory.mktemp('conformance')}/sessions.db"
    server = ServerProcess(
        "--priority-ttft-ms", "10000", "--session-store", db_url, max_model_len=1024
    )
    yield server
    server.stop()


@pytest.fixture
def client(srv):
    return OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def error_of(r: httpx.Response) -> tuple:
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return r.status_code, err["code"], err["param"]


def test_responses_accept_the_defaults_a_response_carries(client):
    r = client.responses.create(
        model=MODEL,
        input="def f():",
        max_output_tokens=4,
        temperature=0,  # greedy: a sampled EOS would end the answer early
        text={"format": {"type": "text"}},
        tools=[],
        tool_choice="auto",
        include=[],
        top_logprobs=0,
        background=False,
        max_tool_calls=3,
        reasoning={"effort": "low"},
        parallel_tool_calls=False,
        truncation="disabled",
        safety_identifier="u-1",
        prompt_cache_key="k",
        store=False,
    )
    assert r.status == "incomplete" and r.output_text
    assert r.text.format.type == "text" and r.tools == [] and r.tool_choice == "auto"
    assert r.max_tool_calls == 3 and r.background is False
    # what came back can be sent back as it is
    again = client.responses.create(
        model=MODEL,
        input="def g():",
        max_output_tokens=4,
        temperature=0,
        store=False,
        text=r.text.model_dump(exclude_none=True),
        tool_choice=r.tool_choice,
        tools=r.tools,
        top_logprobs=r.top_logprobs,
        background=r.background,
    )
    assert again.output_text


def test_responses_refuse_what_they_cannot_do_by_its_own_name(srv):
    def post(body):
        return httpx.post(srv.url + "/v1/responses", json={"input": "x", **body}, timeout=30)

    # function tools are served (tests/e2e/test_tools_clients.py); other tool types are not
    assert error_of(post({"tools": [{"type": "web_search"}]}))[1:] == (
        "invalid_value",
        "tools[0].type",
    )
    assert error_of(post({"background": True}))[1:] == ("unsupported_parameter", "background")
    # text.format json_object / json_schema are served since the grammar engine landed


def test_responses_errors_name_the_exact_item_and_responses_fields(srv):
    def post(body):
        return httpx.post(srv.url + "/v1/responses", json=body, timeout=30)

    items = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "user", "content": [{"type": "input_text", "text": 5}]},
    ]
    assert error_of(post({"input": items})) == (400, "invalid_type", "input[2].content[0].text")
    items[2] = {"role": "robot", "content": "c"}
    assert error_of(post({"input": items}))[1:] == ("invalid_value", "input[2].role")
    assert error_of(post({"input": "x", "max_output_tokens": 10**6}))[1:] == (
        "invalid_value",
        "max_output_tokens",
    )
    assert error_of(post({"input": "x", "max_output_tokens": 1024}))[1:] == (
        "context_length_exceeded",
        "max_output_tokens",
    )
    assert error_of(post({"input": "x " * 3000}))[1:] == ("context_length_exceeded", "input")
    assert error_of(post({"input": "x", "temperature": 3}))[1:] == ("invalid_value", "temperature")
    assert error_of(post({"input": "x", "service_tier": "gold"}))[1:] == (
        "invalid_value",
        "service_tier",
    )
    assert error_of(post({"input": []}))[1:] == ("invalid_value", "input")
    r = httpx.post(
        srv.url + "/v1/conversations",
        timeout=30,
        json={
            "items": [
                {"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "input_text", "text": "x", "colour": "red"}]},
            ]
        },
    )
    assert error_of(r) == (400, "unknown_parameter", "items[1].content[0].colour")


def test_responses_usage_details_and_no_null_user(srv, client):
    r = httpx.post(
        srv.url + "/v1/responses", timeout=30, json={"input": "def h():", "max_output_tokens": 4}
    ).json()
    assert "user" not in r
    details = r["usage"]["input_tokens_details"]
    assert details["cached_tokens"] + details["cache_write_tokens"] == r["usage"]["input_tokens"]
    assert "user" not in httpx.get(srv.url + f"/v1/responses/{r['id']}", timeout=30).json()
    with_user = client.responses.create(
        model=MODEL, input="def u():", max_output_tokens=2, user="alice", store=False
    )
    assert with_user.user == "alice"
    typed = client.responses.create(model=MODEL, input="def t():", max_output_tokens=2)
    assert 0 <= typed.usage.input_tokens_details.cached_tokens <= typed.usage.input_tokens


def test_conversation_items_carry_logprobs_and_metadata_updates(client, srv):
    conv = client.conversations.create(metadata={"topic": "a"})
    client.responses.create(
        model=MODEL, input="def k():", max_output_tokens=4, conversation=conv.id
    )
    items = client.conversations.items.list(conv.id, order="asc").data
    answer = [i for i in items if i.role == "assistant"][0]
    assert answer.content[0].type == "output_text" and answer.content[0].logprobs == []
    updated = client.conversations.update(conv.id, metadata={"topic": "b", "x": "1"})
    assert updated.metadata == {"topic": "b", "x": "1"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "b", "x": "1"}
    r = httpx.post(srv.url + "/v1/conversations/conv_missing", json={"metadata": {}}, timeout=30)
    assert error_of(r) == (404, "conversation_not_found", None)
    r = httpx.post(
        srv.url + f"/v1/conversations/{conv.id}", json={"metadata": {"k": 1}}, timeout=30
    )
    assert error_of(r)[:2] == (400, "invalid_type")


def test_stored_chat_completions_get_list_messages_delete(client, srv):
    made = [
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "be short"},
                {"role": "user", "content": f"def s{i}():"},
            ],
            max_tokens=3,
            temperature=0,
            store=True,
            metadata={"run": "conf", "i": str(i)},
        )
        for i in range(3)
    ]
    unstored = client.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    got = client.chat.completions.retrieve(made[0].id)
    assert got.id == made[0].id
    assert got.choices[0].message.content == made[0].choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(unstored.id)
    listed = [c.id for c in client.chat.completions.list(metadata={"run": "conf"})]
    assert listed == [c.id for c in made]  # oldest first by default
    assert [c.id for c in client.chat.completions.list(metadata={"i": "1"})] == [made[1].id]
    page = httpx.get(
        srv.url + "/v1/chat/completions",
        params={"limit": 1, "order": "desc", "metadata[run]": "conf"},
        timeout=30,
    ).json()
    assert [c["id"] for c in page["data"]] == [made[2].id] and page["has_more"] is True
    page = httpx.get(
        srv.url + "/v1/chat/completions",
        params={"limit": 5, "order": "desc", "metadata[run]": "conf", "after": made[2].id},
        timeout=30,
    ).json()
    assert [c["id"] for c in page["data"]] == [made[1].id, made[0].id]
    messages = client.chat.completions.messages.list(made[1].id).data
    assert [(m.role, m.content) for m in messages] == [
        ("system", "be short"),
        ("user", "def s1():"),
    ]
    assert len({m.id for m in messages}) == 2
    deleted = client.chat.completions.delete(made[0].id)
    assert deleted.deleted is True and deleted.id == made[0].id
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(made[0].id)
    r = httpx.get(srv.url + "/v1/chat/completions", params={"limit": 0}, timeout=30)
    assert error_of(r) == (400, "invalid_value", "limit")


def test_an_empty_page_is_the_same_on_both_list_routes(client, srv):
    """Conversation items and stored chat completions page alike: an empty page has
    `first_id`/`last_id` null (as OpenAI answers), and the same query checks."""
    conv = client.conversations.create()
    empty = [
        httpx.get(srv.url + f"/v1/conversations/{conv.id}/items", timeout=30).json(),
        httpx.get(
            srv.url + "/v1/chat/completions", params={"metadata[run]": "none"}, timeout=30
        ).json(),
    ]
    for page in empty:
        assert page == {
            "object": "list",
            "data": [],
            "first_id": None,
            "last_id": None,
            "has_more": False,
        }
    for path in (f"/v1/conversations/{conv.id}/items", "/v1/chat/completions"):
        r = httpx.get(srv.url + path, params={"order": "up"}, timeout=30)
        assert error_of(r) == (400, "invalid_value", "order")
        r = httpx.get(srv.url + path, params={"limit": 101}, timeout=30)
        assert error_of(r) == (400, "invalid_value", "limit")


def test_stored_chat_completions_belong_to_their_tenant_only_by_id(srv):
    r = httpx.get(srv.url + "/v1/chat/completions/chatcmpl-nope", timeout=30)
    assert error_of(r) == (404, "chat_completion_not_found", None)
    r = httpx.get(srv.url + "/v1/chat/completions/bad%20id", timeout=30)
    assert r.status_code == 404


def test_a_response_retried_with_its_idempotency_key_is_stored_once(srv):
    """The cluster's ingress retries a call on another replica with the same Idempotency-Key:
    the retry gets the same response id, and the conversation holds each turn once."""
    conv = httpx.post(srv.url + "/v1/conversations", json={}, timeout=30).json()["id"]
    body = {
        "model": MODEL,
        "input": "def g():",
        "conversation": conv,
        "max_output_tokens": 4,
        "temperature": 0,
    }
    first, again = (
        httpx.post(
            srv.url + "/v1/responses", json=body, headers={"Idempotency-Key": "k-1"}, timeout=60
        )
        for _ in range(2)
    )
    assert first.status_code == again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert first.json()["output"] == again.json()["output"]
    items = httpx.get(srv.url + f"/v1/conversations/{conv}/items", timeout=30).json()["data"]
    roles = sorted(i["role"] for i in items if i.get("type") == "message")
    assert roles == ["assistant", "user"]  # each turn once
    other = httpx.post(
        srv.url + "/v1/responses", json=body, headers={"Idempotency-Key": "k-2"}, timeout=60
    )
    assert other.json()["id"] != first.json()["id"]  # another key, another call
    bad = httpx.post(
        srv.url + "/v1/responses", json=body, headers={"Idempotency-Key": "a b"}, timeout=60
    )
    assert error_of(bad) == (400, "invalid_value", "Idempotency-Key")
