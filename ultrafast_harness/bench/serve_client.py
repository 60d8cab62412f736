"""One streamed chat completion against any OpenAI-style server, stamped per content event.

Built on sse_client's raw HTTP/1.1 reader (a client library's per-event cost would compete with
the server for this machine's cores), made tolerant of what the peers send: sse-starlette's
CRLF event separators, `data:` without a space, and error bodies with a content-length. A
refusal keeps its status code and message, so the report can say who refused and why.

`retries` makes it answer an overload refusal (429, 503) as the OpenAI SDK does by default
(openai-python: 2 retries; a Retry-After up to 60 s is waited, else a 0.5 s backoff doubling
up to 8 s; no jitter here, so runs repeat): a server that says "come back in 4 s" is then
measured as a client that came back, its time to first token counted from the first send,
and every retry kept in `RequestResult.retried`. Other errors are never retried: a bench must
show them.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from ultrafast_harness.bench.serve_stats import RequestResult
from ultrafast_harness.bench.sse_client import _chunks, _read_head


def _error_message(status: int, body: bytes) -> str:
    try:
        data = orjson.loads(body)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") or err.get("detail") if isinstance(err, dict) else err
    except (orjson.JSONDecodeError, AttributeError):
        message = body.decode("utf-8", "replace")
    return f"HTTP {status}: {str(message)[:200]}"


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return b"".join([piece async for piece in _chunks(reader)])
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read(65536)


def _content(event: dict) -> str:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text = delta.get("content") or choice.get("text")
        if text:
            return str(text)
    return ""


RETRIED_STATUSES = (429, 503)  # the overload answers; the SDK also retries 408, 409 and 5xx
RETRY_AFTER_MAX_S = 60.0  # openai-python waits a server's Retry-After up to this
BACKOFF_S, BACKOFF_MAX_S = 0.5, 8.0  # else its backoff: 0.5 s, doubling, at most 8 s


def retry_wait_s(headers: dict[str, str], attempt: int) -> float:
    """Seconds before retry number `attempt` + 1 (0-based): the server's Retry-After where it
    gives one the SDK honours, else the SDK's backoff."""
    try:
        after = float(headers.get("retry-after", ""))
    except ValueError:
        after = 0.0
    if 0 < after <= RETRY_AFTER_MAX_S:
        return after
    return min(BACKOFF_S * 2**attempt, BACKOFF_MAX_S)


async def stream_chat(
    host: str,
    port: int,
    body: dict,
    timeout_s: float = 900.0,
    start_s: float | None = None,
    retries: int = 0,
) -> RequestResult:
    """POST /v1/chat/completions with stream=true; never raises for a server's failure. An
    overload refusal is retried up to `retries` times (the module's doc), all within
    `timeout_s`."""
    result = RequestResult(
        start_s=time.perf_counter() if start_s is None else start_s,
        max_tokens=body.get("max_tokens", 0),
    )
    try:
        await asyncio.wait_for(_attempts(host, port, body, result, retries), timeout_s)
    except asyncio.TimeoutError:
        result.error = f"no end of stream in {timeout_s:.0f} s"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.end_s = time.perf_counter()
    if result.error is None and not result.num_tokens:
        result.num_tokens = len(result.token_times_s)
    return result


async def _attempts(host: str, port: int, body: dict, result: RequestResult, retries: int):
    for attempt in range(retries + 1):
        wait_s = await _stream(host, port, body, result, attempt)
        if wait_s is None or attempt == retries:
            return
        assert result.error is not None
        result.retried.append(result.error)
        result.error = None
        await asyncio.sleep(wait_s)


async def _stream(
    host: str, port: int, body: dict, result: RequestResult, attempt: int = 0
) -> float | None:
    """One attempt; the seconds to wait before retrying where the server refused it for
    overload (RETRIED_STATUSES), else None."""
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        payload = orjson.dumps({**body, "stream": True})
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (host.encode(), port, len(payload))
            + payload
        )
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200:
            result.error = _error_message(status, await _read_body(reader, headers))
            return retry_wait_s(headers, attempt) if status in RETRIED_STATUSES else None
        buffer = b""
        async for piece in _chunks(reader):
            now = time.perf_counter()
            buffer += piece.replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue  # comments, event names, keep-alives
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return None
                    parsed = orjson.loads(data)
                    if "error" in parsed:  # a failure after the 200: an error event
                        result.error = _error_message(200, data)
                        return None
                    if _content(parsed):
                        result.token_times_s.append(now)
                    usage = parsed.get("usage")
                    if usage and usage.get("completion_tokens"):
                        result.num_tokens = usage["completion_tokens"]
                        result.prompt_tokens = usage.get("prompt_tokens")
        return None
    finally:
        writer.close()
