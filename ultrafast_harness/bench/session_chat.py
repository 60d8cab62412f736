"""The sessions bench's client side, shared by its main suite (sessions.py) and the
oversubscription suite (sessions_oversub.py): code-like user turns cut with the server's own
tokenizer, and one streamed chat call timed to its first content delta."""

from __future__ import annotations

import time

import httpx

CODE_WORDS = (
    "def load_config(path): with open(path) as f: return json.load(f) "
    "class Cache: def __init__(self, size): self.size = size self.items = {} "
    "for key, value in sorted(items.items()): print(key, value) "
).split()


def user_text(base_url: str, num_tokens: int, salt: int) -> str:
    """Code-like text of about `num_tokens` tokens (cut with the server's own tokenizer)."""
    words = [f"x{salt}"] + [CODE_WORDS[(salt + i) % len(CODE_WORDS)] for i in range(num_tokens * 2)]
    ids = httpx.post(
        base_url + "/tokenize",
        json={"prompt": " ".join(words), "add_special_tokens": False},
        timeout=60,
    ).json()["tokens"][:num_tokens]
    return httpx.post(base_url + "/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]


def _stream_chat(client: httpx.Client, body: dict) -> tuple[float, str, dict]:
    """(seconds to the first content delta, full answer, usage) of one streamed chat
    completion."""
    import json

    started = time.perf_counter()
    first_s: float | None = None
    parts: list[str] = []
    usage: dict = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text = choice["delta"].get("content")
                if text:
                    first_s = first_s or time.perf_counter() - started
                    parts.append(text)
    return first_s or time.perf_counter() - started, "".join(parts), usage
