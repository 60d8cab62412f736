"""The server's shared state and the checks every route makes first (body, model, readiness).

Below the routes (app.py) and the front ends (frontends/), so each of them
imports it plainly: nothing here imports a front end.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from ultrafast.config import ServerConfig
from ultrafast.server.errors import APIError
from ultrafast.server.generate import GenerationRun, RunDeps
from ultrafast.server.guard import GuardConfig
from ultrafast.server.json_body import check_content_type, parse_json_body
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.protocol import Limits
from ultrafast.server.runtime import ModelRuntime, ModelSet
from ultrafast.server.sessions.flow import SessionFlow
from ultrafast.server.tenants import ApiKeys

if TYPE_CHECKING:
    from ultrafast.server.residency.registry import ModelRegistry


@dataclass
class ServerState:
    """What is server-wide; each model's parts are its ModelRuntime in `models`."""

    config: ServerConfig  # the default model's admission resolved its auto TTFT targets
    models: ModelSet
    draining: bool = False
    started_s: float = field(default_factory=time.time)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="ultrafast-tokenize")
    )
    runs: set[GenerationRun] = field(default_factory=set)  # in flight, for the drain
    sessions: SessionFlow | None = None  # server-side conversations (sessions/flow.py)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    api_keys: ApiKeys | None = None  # None: no auth, loopback only
    guard: GuardConfig | None = None  # None: output goes out unfiltered
    auth_refused: dict = field(default_factory=dict)  # reason -> count, for metrics
    # embedding models, name -> EmbeddingEngine (server/frontends/embeddings.py); they stay
    # loaded, beside the chat model(s) or alone (then the default runtime is the first)
    embedders: dict = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        """The default model's name (a call that names none runs on it)."""
        return self.models.default.name

    @property
    def residency(self) -> ModelRegistry | None:
        """Several models resident by use (server/residency/registry.py); None: one model."""
        return self.models.registry

    def limits_for(self, model: object) -> Limits:
        """The request limits of the model a body names (its vocabulary and defaults)."""
        return self.models.limits_for(model)

    def calls_in_flight(self) -> int:
        """Admitted calls not finished, over every model (the drain waits for them)."""
        return sum(sum(a.in_flight.values()) for a in self.models.admissions())

    def in_flight_by_tier(self) -> dict[str, int]:
        """Tier name -> admitted calls not finished, over every model (/ready, /metrics)."""
        counts: dict[str, int] = {}
        for admission in self.models.admissions():
            for tier, n in admission.in_flight.items():
                counts[tier.api_name] = counts.get(tier.api_name, 0) + n
        return counts

    def run_deps(self, runtime: ModelRuntime) -> RunDeps:
        assert runtime.bridge is not None, "the bridge is made when the model is leased"
        return RunDeps(
            bridge=runtime.bridge,
            tokenizer=runtime.tokenizer,
            admission=runtime.admission,
            metrics=self.metrics,
            guard=self.guard,
            runs=self.runs,
            ping_interval_s=self.config.sse_ping_interval_s,
        )

    def abort_everything(self) -> None:
        """Drain timeout: every unfinished choice ends with finish_reason "abort"."""
        for run in list(self.runs):
            run.generation.abort_from_server()


def error_response(error: APIError, request_id: str) -> JSONResponse:
    return JSONResponse(
        error.to_dict(),
        status_code=error.status,
        headers={**error.headers, "x-request-id": request_id},
    )


async def read_json(http: HTTPRequest, state: ServerState) -> dict:
    check_content_type(http.headers.get("content-type"))
    limit = state.config.max_body_bytes
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(
            413,
            f"request body is larger than {limit} bytes",
            "invalid_request_error",
            "payload_too_large",
            None,
        )
    chunks, size = [], 0
    try:
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:  # chunked bodies are counted as they arrive, never buffered past
                raise APIError(
                    413,
                    f"request body is larger than {limit} bytes",
                    "invalid_request_error",
                    "payload_too_large",
                    None,
                )
            chunks.append(chunk)
    except ClientDisconnect:  # the client left, or the body timed out (408 already sent)
        raise APIError(
            408,
            "the request body did not arrive in full",
            "invalid_request_error",
            "request_timeout",
            None,
        ) from None
    return parse_json_body(b"".join(chunks), max_bytes=limit)


def check_model(state: ServerState, model: str | None) -> None:
    state.models.get(model)  # 404 naming the model unless it is one of ours


def check_generates(state: ServerState, model: str | None) -> None:
    """400 when a generation call names an embedding model (it has no chat mode)."""
    name = model if model is not None else state.model_name
    if name in state.embedders:
        raise APIError(
            400,
            f"the model {name!r} is an embedding model: it serves /v1/embeddings and "
            "/api/embed only",
            "invalid_request_error",
            "model_not_generative",
            "model",
        )


def check_ready(state: ServerState) -> None:
    if not state.models.alive:  # first: a dead engine also starts the shutdown (exit 2)
        raise APIError(
            503,
            "the engine is not running",
            "server_error",
            "engine_dead",
            None,
            headers={"Retry-After": "5"},
        )
    if state.draining:
        raise APIError(
            503,
            "the server is shutting down",
            "overloaded_error",
            "server_shutting_down",
            None,
            headers={"Retry-After": "5"},
        )
