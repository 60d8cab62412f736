"""`ultrafast chat [MODEL]`: a terminal chat, like `ollama run`.

Each line typed is a user turn; the answer streams as it is generated; the whole conversation
goes with every turn (multi-turn). `/bye` (or end of input) leaves, `/clear` starts over. It
runs the model in-process (an engine of its own, the model's chat template and sampling
defaults, as the server applies them), or, with `--url`, talks to a running server over its
OpenAI chat completions API (streamed).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any, Protocol

EXIT_WORDS = ("/bye", "/exit", "/quit")
HELP = "/bye leaves, /clear forgets the conversation, Ctrl+C stops an answer"


class ChatBackend(Protocol):
    def stream(self, messages: list[dict]) -> Iterator[str]: ...

    def close(self) -> None: ...


class LocalChat:
    """The model in this process: its chat template, then the engine's streamed text."""

    def __init__(self, args: argparse.Namespace):
        from ultrafast.cli_serve import chosen_model, engine_options
        from ultrafast.llm import LLM

        model, _ = chosen_model(args.model_path or args.model)
        options = {**engine_options(args), "num_slots": args.num_slots or 1}
        self.llm = LLM(model, **options)
        self.args = args
        if not self.llm.tokenizer.chat_template:
            self.llm.close()
            from ultrafast.chat_templates import builtin_names

            raise ValueError(
                f"{model} has no chat template: give one with --chat-template NAME "
                f"({builtin_names()}) or --chat-template FILE.jinja"
            )

    def _params(self, num_prompt: int):
        from ultrafast.request import SamplingParams

        defaults = {**self.llm.tokenizer.generation_defaults, **_flag_values(self.args)}
        room = self.llm.config.max_model_len - num_prompt
        if room <= 0:
            raise ValueError("the conversation no longer fits the context: /clear starts over")
        return SamplingParams(
            max_tokens=min(room, self.args.max_tokens or room),
            temperature=defaults.get("temperature", 1.0),
            top_p=defaults.get("top_p", 1.0),
            top_k=int(defaults.get("top_k", 0)),
            min_p=defaults.get("min_p", 0.0),
            repetition_penalty=defaults.get("repetition_penalty", 1.0),
            seed=self.args.seed,
        )

    def stream(self, messages: list[dict]) -> Iterator[str]:
        tok = self.llm.tokenizer
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        yield from self.llm.stream(ids, self._params(len(ids)))

    def close(self) -> None:
        self.llm.close()


class RemoteChat:
    """A running server: POST /v1/chat/completions with stream=true, read its SSE events."""

    def __init__(self, args: argparse.Namespace):
        import httpx

        self.url = args.url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(600, connect=10))
        self.model = args.model_path or args.model or self._first_model()
        self.args = args

    def _first_model(self) -> str:
        listed = self.client.get(self.url + "/v1/models")
        if listed.status_code != 200:
            raise ValueError(f"{self.url}/v1/models answered {listed.status_code}: {listed.text}")
        return str(listed.json()["data"][0]["id"])

    def stream(self, messages: list[dict]) -> Iterator[str]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": True}
        body.update(_flag_values(self.args))
        if self.args.max_tokens:
            body["max_tokens"] = self.args.max_tokens
        if self.args.seed is not None:
            body["seed"] = self.args.seed
        url = self.url + "/v1/chat/completions"
        with self.client.stream("POST", url, json=body) as answer:
            if answer.status_code != 200:
                raise ValueError(f"the server answered {answer.status_code}: {answer.read()!r}")
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content")
                if text:
                    yield text

    def close(self) -> None:
        self.client.close()


def _flag_values(args: argparse.Namespace) -> dict:
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
    return {
        key: getattr(args, attr) for key, attr in names.items() if getattr(args, attr) is not None
    }


def _read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _answer(backend: ChatBackend, messages: list[dict]) -> str:
    parts: list[str] = []
    try:
        for piece in backend.stream(messages):
            parts.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:  # stop this answer, keep what came
        pass
    sys.stdout.write("\n")
    return "".join(parts)


def chat_loop(backend: ChatBackend, system: str | None = None, prompt: str = ">>> ") -> int:
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    while True:
        line = _read_line(prompt)
        if line is None or line.strip() in EXIT_WORDS:
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/clear":
            messages = list(start)
            continue
        if text.startswith("/") and " " not in text:
            print(f"unknown command {text}: {HELP}", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        try:
            answer = _answer(backend, messages)
        except ValueError as exc:
            messages.pop()
            print(f"ultrafast: {exc}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": answer})


def cmd_chat(args: argparse.Namespace) -> int:
    backend: ChatBackend = RemoteChat(args) if args.url else LocalChat(args)
    try:
        if sys.stdin.isatty():
            print(f"ultrafast chat: {HELP}", file=sys.stderr)
        return chat_loop(backend, args.system)
    finally:
        backend.close()


def add_chat_parser(sub: Any) -> None:
    from ultrafast.cli_serve import add_chat_template_arg, add_engine_args

    p = sub.add_parser(
        "chat", help="chat with a model in the terminal (streams, multi-turn, /bye to leave)"
    )
    p.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="HF directory or .gguf (default: as for serve); with --url: the served model id "
        "(default: the server's first)",
    )
    p.add_argument("--url", default=None, help="a running server (http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="with --url: the bearer key, if it needs one")
    p.add_argument("--system", default=None, help="a system message leading the conversation")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--max-tokens", type=int, default=1024, help="answer length cap (0 = the context left)"
    )
    add_chat_template_arg(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_chat)
