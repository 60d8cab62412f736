"""OpenAI response shapes: chat completions, text completions, their stream chunks, usage,
logprobs, and the cursor-paged list every stored-object API answers with.

Pure functions from plain values to dicts; the front ends do the I/O. Field names follow the
OpenAI API reference so official clients parse them unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson

from ultrafast.server.bridge import TokenLogprobs
from ultrafast.server.errors import invalid_value

SYSTEM_FINGERPRINT = "ultrafast-0.1"


@dataclass
class ChoiceState:
    """What one choice (of n) has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    # completions `echo` + `logprobs`: the echoed prompt's ids and their logprobs (the first
    # entry None), and the echoed text's length, where the generated tokens' offsets start
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    echo_chars: int = 0
    tool_calls: list[dict] = field(default_factory=list)  # chat: complete calls, in order

    def prompt_part(self) -> tuple[list[int], list] | None:
        if self.prompt_token_ids is None or self.prompt_logprobs is None:
            return None
        return self.prompt_token_ids, self.prompt_logprobs


def sse(payload: dict | str) -> bytes:
    body = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + body + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage(
    num_prompt: int, num_completion: int, num_cached: int, prediction: tuple[int, int] | None = None
) -> dict:
    details: dict = {"reasoning_tokens": 0}
    if prediction is not None:
        details["accepted_prediction_tokens"], details["rejected_prediction_tokens"] = prediction
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
        "completion_tokens_details": details,
    }


def _token_entry(decode, token_id: int, logprob: float) -> dict:
    text = decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(decode, logprobs: list[TokenLogprobs]) -> dict:
    content = []
    for lp in logprobs:
        entry = _token_entry(decode, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_token_entry(decode, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    decode,
    logprobs: list[TokenLogprobs],
    text_offset: int = 0,
    prompt: tuple[list[int], list] | None = None,
) -> dict:
    """Legacy completions logprobs. `text_offset`: where the first generated token starts in
    the choice's text. `prompt` (echo): the prompt's ids and logprobs, listed first, their
    offsets counted from 0; the first prompt token has no logprob (null entries).

    `top_logprobs` maps each alternative's text to its logprob; with `logprobs: 0` it holds
    the chosen token alone (OpenAI: the chosen token's logprob is always returned)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict | None] = []
    offsets: list[int] = []

    def add(token_id: int, lp: TokenLogprobs | None, offset: int) -> int:
        text = decode([token_id])
        tokens.append(text)
        offsets.append(offset)
        if lp is None:
            token_logprobs.append(None)
            top.append(None)
        else:
            token_logprobs.append(lp.logprob)
            top.append({decode([t]): v for t, v in lp.top} if lp.top else {text: lp.logprob})
        return offset + len(text)

    if prompt is not None:
        offset = 0
        for token_id, lp in zip(*prompt):
            offset = add(token_id, lp, offset)
    for lp in logprobs:
        text_offset = add(lp.token_id, lp, text_offset)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _envelope(request_id: str, obj: str, model: str, tier: str, created: int) -> dict:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "service_tier": tier,
    }


def _chat_choice(c: ChoiceState, decode, want_logprobs: bool) -> dict:
    logprobs = chat_logprobs(decode, c.logprobs) if want_logprobs else None
    return {"message": _message(c), "logprobs": logprobs}


def _message(c: ChoiceState) -> dict:
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text, "refusal": None}
    # OpenAI sends null content beside calls when the model wrote no text
    return {
        "role": "assistant",
        "content": c.text or None,
        "refusal": None,
        "tool_calls": c.tool_calls,
    }


def _completion_choice(c: ChoiceState, decode, want_logprobs: bool) -> dict:
    logprobs = (
        completion_logprobs(decode, c.logprobs, c.echo_chars, c.prompt_part())
        if want_logprobs
        else None
    )
    return {"text": c.text, "logprobs": logprobs}


def _response(
    obj: str,
    choice_fields: Callable[[ChoiceState, Any, bool], dict],
    request_id: str,
    model: str,
    tier: str,
    choices: list[ChoiceState],
    usage_dict: dict,
    decode,
    want_logprobs: bool,
) -> dict:
    """A whole (non-streamed) response: the envelope, each choice as `index`, the protocol's
    own fields (`choice_fields`), `finish_reason`, then the usage."""
    body = _envelope(request_id, obj, model, tier, int(time.time()))
    body["choices"] = [
        {
            "index": c.index,
            **choice_fields(c, decode, want_logprobs),
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    body["usage"] = usage_dict
    return body


# (request_id, model, tier, choices, usage_dict, decode, want_logprobs) -> the response body
chat_response = partial(_response, "chat.completion", _chat_choice)
completion_response = partial(_response, "text_completion", _completion_choice)


class ChunkWriter:
    """Builds the SSE events of one streamed response (chat or text completion)."""

    def __init__(
        self, request_id: str, model: str, tier: str, chat: bool, decode, want_logprobs: bool
    ):
        self.chat = chat
        self.decode = decode
        self.want_logprobs = want_logprobs
        self.base = _envelope(
            request_id,
            "chat.completion.chunk" if chat else "text_completion",
            model,
            tier,
            int(time.time()),
        )
        self._text_offsets: dict[int, int] = {}  # choice -> chars of text sent so far

    def _event(self, choices: list[dict], usage_dict: dict | None = None) -> bytes:
        body = dict(self.base)
        body["choices"] = choices
        if usage_dict is not None:
            body["usage"] = usage_dict
        return sse(body)

    def role(self, index: int) -> bytes:
        return self._event(
            [
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def delta(
        self, index: int, text: str, logprobs: list[TokenLogprobs], finish_reason: str | None = None
    ) -> bytes:
        if self.chat:
            choice = {
                "index": index,
                "delta": {"content": text} if text or not finish_reason else {},
                "logprobs": chat_logprobs(self.decode, logprobs)
                if self.want_logprobs and logprobs
                else None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {
                "index": index,
                "text": text,
                "logprobs": self._completion_logprobs(index, logprobs)
                if self.want_logprobs and logprobs
                else None,
                "finish_reason": finish_reason,
            }
        return self._event([choice])

    def tool_calls(self, index: int, calls: list[dict]) -> bytes:
        """A chat chunk whose delta carries `tool_calls` (server/tools/stream.py)."""
        return self._event(
            [
                {
                    "index": index,
                    "delta": {"tool_calls": calls},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def _completion_logprobs(self, index: int, logprobs: list[TokenLogprobs]) -> dict:
        """Offsets continue from the choice's earlier chunks (and its echo)."""
        offset = self._text_offsets.get(index, 0)
        out = completion_logprobs(self.decode, logprobs, offset)
        self._text_offsets[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    def echo(self, index: int, text: str, prompt: tuple[list[int], list] | None) -> bytes:
        """A completion's echoed prompt, with the prompt's logprobs when they were asked for;
        the generated tokens' offsets count on from its end."""
        self._text_offsets[index] = len(text)
        logprobs = (
            completion_logprobs(self.decode, [], 0, prompt)
            if self.want_logprobs and prompt is not None
            else None
        )
        return self._event(
            [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}]
        )

    def usage(self, usage_dict: dict) -> bytes:
        return self._event([], usage_dict)


def error_event(message: str, err_type: str = "server_error", code: str | None = None) -> bytes:
    return sse({"error": {"message": message, "type": err_type, "param": None, "code": code}})


def list_object(page: list[dict], has_more: bool) -> dict:
    """OpenAI's list envelope. An empty page has `first_id`/`last_id` null, as OpenAI's API
    answers (its clients type them `Optional` and stop paging at a null `last_id`)."""
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": has_more,
    }


def list_page(query: Mapping[str, str], items: list[dict], default_order: str) -> dict:
    """The page of `items` (oldest first, each with an `id`) the query's `order`
    (asc/desc), `after` (an id: the items following it; an unknown id gives an empty page)
    and `limit` (1-100, default 20) ask for."""
    order = query.get("order", default_order)
    if order not in ("asc", "desc"):
        raise invalid_value("order", "order must be asc or desc")
    limit_text = query.get("limit", "20")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
        raise invalid_value("limit", "limit must be an integer in [1, 100]")
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[: int(limit_text)]
    return list_object(page, len(items) > len(page))
