"""One access-log line per HTTP request (`serve --no-access-log` turns it off).

    127.0.0.1 "POST /v1/chat/completions" 200 tier=priority prompt_tokens=12
        completion_tokens=64 ttft_ms=41.3 duration_ms=812.4 id=3f9c...

Plain ASGI, outermost, so refusals made before routing (auth, Host) are logged too. A call
that generates registers its GenerationRun in the scope (`note_run`, from calls.prepare_call);
the line is written when the app has returned, after the run's finish, so the tokens are final
and a stream is logged once, at its end. Fields a request does not have are `-`. The path is
logged without its query string, and the logger's handlers scrub bearer tokens anyway.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ultrafast.access")

SCOPE_KEY = "ultrafast.access"  # the request's AccessRecord


@dataclass
class AccessRecord:
    runs: list = field(default_factory=list)  # GenerationRun, in the order they were made
    status: int | None = None
    request_id: str | None = None


def note_run(scope: Any, run: Any) -> None:
    """Count `run` in its request's log line (no-op without the middleware or off HTTP)."""
    record = scope.get(SCOPE_KEY)
    if record is not None:
        record.runs.append(run)


def _run_fields(runs: list) -> tuple[str, str, str, str]:
    """(tier, prompt tokens, completion tokens, TTFT ms) over the request's runs."""
    if not runs:
        return "-", "-", "-", "-"
    first = runs[0]
    prompt = sum(sum(len(p) for p in r.spec.prompts) for r in runs)
    completion = sum(sum(r.num_output_tokens) for r in runs)
    ttft = "-"
    if first.first_token_s is not None:
        ttft = f"{(first.first_token_s - first.spec.arrival_s) * 1000:.1f}"
    return first.spec.tier.api_name, str(prompt), str(completion), ttft


def format_line(scope: Any, record: AccessRecord, duration_s: float) -> str:
    client = scope.get("client") or ("-", 0)
    tier, prompt, completion, ttft = _run_fields(record.runs)
    return (
        f'{client[0]} "{scope.get("method", "-")} {scope.get("path", "-")}" '
        f"{record.status if record.status is not None else '-'} tier={tier} "
        f"prompt_tokens={prompt} completion_tokens={completion} ttft_ms={ttft} "
        f"duration_ms={duration_s * 1000:.1f} id={record.request_id or '-'}"
    )


class AccessLogMiddleware:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord()
        scope[SCOPE_KEY] = record
        started = time.monotonic()

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                record.status = message["status"]
                for name, value in message.get("headers", []):
                    if name.lower() == b"x-request-id":
                        record.request_id = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            log.info("%s", format_line(scope, record, time.monotonic() - started))
