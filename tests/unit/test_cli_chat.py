"""`ultrafast chat`'s loop (multi-turn history, /clear, /bye, end of input) and its client for a
running server (the streamed chat completions it reads), against a stub backend and a stub
HTTP server (cli_chat.py)."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ultrafast.cli import parse_args
from ultrafast.cli_chat import RemoteChat, chat_loop


class Recorder:
    def __init__(self):
        self.calls: list[list[dict]] = []

    def stream(self, messages):
        self.calls.append([dict(m) for m in messages])
        yield "answer "
        yield str(len(self.calls))

    def close(self):
        pass


def feed(monkeypatch, lines):
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)


def test_turns_carry_the_history_and_bye_leaves(monkeypatch, capsys):
    feed(monkeypatch, ["Hi", "", "/nope", "Again", "/clear", "Fresh", "/bye", "never sent"])
    backend = Recorder()
    assert chat_loop(backend, system="Be brief.") == 0
    system = {"role": "system", "content": "Be brief."}
    assert backend.calls == [
        [system, {"role": "user", "content": "Hi"}],
        [
            system,
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "answer 1"},
            {"role": "user", "content": "Again"},
        ],
        [system, {"role": "user", "content": "Fresh"}],  # /clear forgot the rest
    ]
    out = capsys.readouterr()
    assert out.out.splitlines() == ["answer 1", "answer 2", "answer 3"]
    assert "unknown command /nope" in out.err


def test_end_of_input_leaves(monkeypatch):
    feed(monkeypatch, ["one"])
    backend = Recorder()
    assert chat_loop(backend) == 0 and len(backend.calls) == 1


class StubServer(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, b'{"object": "list", "data": [{"id": "stub-model"}]}', "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StubServer.bodies.append({**body, "auth": self.headers.get("Authorization")})
        events = [
            {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
            {"choices": [{"index": 0, "delta": {"content": "Par"}}]},
            {"choices": [{"index": 0, "delta": {"content": "is."}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        ]
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, data.encode(), "text/event-stream")

    def _send(self, status, payload, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StubServer.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def chat_args(*argv: str) -> argparse.Namespace:
    return parse_args(["chat", *argv])


def test_remote_chat_streams_from_a_server(stub_url, monkeypatch, capsys):
    feed(monkeypatch, ["Capital of France?", "And Italy?"])
    backend = RemoteChat(chat_args("--url", stub_url, "--api-key", "k1", "--temperature", "0.3"))
    assert backend.model == "stub-model"  # the server's first model when none is named
    assert chat_loop(backend) == 0
    backend.close()
    assert capsys.readouterr().out.splitlines() == ["Paris.", "Paris."]
    first, second = StubServer.bodies
    assert first["model"] == "stub-model" and first["stream"] is True
    assert first["temperature"] == 0.3 and first["auth"] == "Bearer k1"
    assert second["messages"] == [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Italy?"},
    ]


def test_remote_chat_names_the_model_it_is_given(stub_url):
    backend = RemoteChat(chat_args("my-model", "--url", stub_url))
    assert backend.model == "my-model"
    backend.close()
