"""`ultrafast serve`: build the engine, start uvicorn, print the ready line, drain on SIGTERM.

SIGTERM (or the first Ctrl-C): /ready turns 503 and new calls get 503 server_shutting_down,
while running streams may finish for `drain_timeout_s`; whatever is left then ends with
finish_reason "abort", and the process exits 0. A second signal aborts every call at once
(each stream still gets its "abort" finish and [DONE], within a step) and exits 1.

If the engine thread dies, it has already failed every waiting call; the server lets those
terminal events reach the clients (at most ENGINE_DEATH_GRACE_S) and exits 2, so a supervisor
restarts it instead of it answering 503 forever.

Connections get a request-head timeout and a write-stall timeout (server/http_timeouts.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time

import uvicorn

from ultrafast.config import EngineConfig, ServerConfig, default_session_store
from ultrafast.llm import build_engine
from ultrafast.model.kv_budget import available_memory_bytes
from ultrafast.model_defaults import merged_defaults
from ultrafast.server.admission import Admission, auto_in_flight
from ultrafast.server.app import build_app
from ultrafast.server.auth import RedactingFilter
from ultrafast.server.bridge import (
    EngineSettings,
    kv_cache_reader,
    shutdown_engine,
    start_engine,
)
from ultrafast.server.guard import (
    AllGuards,
    ClassifierGuard,
    GuardConfig,
    OutputGuard,
    PatternGuard,
    load_score_function,
)
from ultrafast.server.http_timeouts import protocol_class
from ultrafast.server.kv_metrics import KVCacheCollector
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.protocol import Limits
from ultrafast.server.residency.loader import attach_residency
from ultrafast.server.sessions.backends import open_store
from ultrafast.server.sessions.flow import SessionFlow
from ultrafast.server.state import ServerState
from ultrafast.server.tenants import load_api_keys

log = logging.getLogger("ultrafast")

ENGINE_DEATH_GRACE_S = 1.0  # for the failed calls' error events to be written
FORCED_ABORT_GRACE_S = 0.5  # second signal: for the "abort" finishes (one engine step)
EXIT_FORCED, EXIT_ENGINE_DEAD = 1, 2


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set in startup()
        self._tasks: set[asyncio.Task] = set()  # drain / abort / engine watch: kept referenced

    def handle_exit(self, sig, frame) -> None:
        """Runs in the signal handler, on the event loop's thread, between two callbacks."""
        if self.should_exit and self.force_exit:
            return
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
            return
        second = self.state.draining
        self.state.draining = True  # /ready and new calls answer 503 from now on
        self._loop.call_soon_threadsafe(self._spawn, self._abort_now() if second else self._drain())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # a callback on the serving loop
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.drain_timeout_s
        while self.state.calls_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.calls_in_flight():
            self.state.abort_everything()
            await asyncio.sleep(0.5)  # let the abort events reach the clients
        self.should_exit = True

    async def _abort_now(self) -> None:
        """Second signal: every call ends with "abort" now, then the process exits."""
        self.exit_code = self.exit_code or EXIT_FORCED
        self.state.abort_everything()
        await self._wait_for_runs(FORCED_ABORT_GRACE_S)
        self.force_exit = self.should_exit = True

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            if not self.state.engine.alive:
                log.error("the engine died (%s): exiting", self.state.engine.dead_reason)
                self.state.draining = True
                self.exit_code = EXIT_ENGINE_DEAD
                await self._wait_for_runs(ENGINE_DEATH_GRACE_S)
                self.force_exit = self.should_exit = True
                return
            await asyncio.sleep(0.1)

    async def _wait_for_runs(self, timeout_s: float) -> None:
        """Until every GenerationRun has written its last event (or `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while self.state.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # the final writes leave the transport

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self._spawn(self._watch_engine())
        host, port = self.config.host, self.config.port
        print(
            f"ultrafast ready: model {self.state.model_name!r} on http://{host}:{port}\n"
            f"  curl http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json'"
            + (' -H "Authorization: Bearer $KEY"' if self.state.api_keys else "")
            + ' -d \'{"messages": [{"role": "user", "content": "def fibonacci(n):"}],'
            ' "max_tokens": 64, "service_tier": "priority"}\'',
            flush=True,
        )


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def build_guard(config: ServerConfig) -> GuardConfig | None:
    patterns = list(config.guard_patterns)
    guards: list[OutputGuard] = []
    if config.guard_patterns_path:
        guards.append(PatternGuard.from_file(config.guard_patterns_path, extra=patterns))
    elif patterns:
        guards.append(PatternGuard(patterns))
    if config.guard_classifier:  # after the patterns: they are cheaper
        guards.append(
            ClassifierGuard(
                load_score_function(config.guard_classifier),
                threshold=config.guard_classifier_threshold,
            )
        )
    if not guards:
        return None
    guard = guards[0] if len(guards) == 1 else AllGuards(guards)
    return GuardConfig(guard, hold_back_tokens=config.guard_hold_back_tokens)


def log_tier_targets(admission: Admission, idle_decode_s: float | None) -> None:
    """One line: the idle speed measured at start and each tier's TTFT target, with its source."""
    if admission.idle_ttft_s is None:
        measured = "idle speed not measured"
    else:
        measured = (
            f"idle TTFT {admission.idle_ttft_s * 1000:.1f} ms for a "
            f"{admission.typical_prompt_tokens}-token prompt"
        )
        if idle_decode_s:
            measured += f", decode {idle_decode_s * 1000:.1f} ms/token"
    targets = ", ".join(
        f"{name} {t['ttft_ms']:.0f} ms ({t['ttft_source']})"
        for name, t in admission.describe_targets().items()
    )
    log.info("%s; TTFT targets: %s", measured, targets)


def build_state(engine_config: EngineConfig, config: ServerConfig) -> ServerState:
    api_keys = load_api_keys(config.api_keys_path) if config.api_keys_path else None
    guard = build_guard(config)  # bad files fail before the model loads
    core, tokenizer, files = build_engine(
        engine_config,
        priority_itl_target_s=config.priority.itl_ms / 1000,
        default_itl_target_s=config.default.itl_ms / 1000 or None,
    )
    # warm up on the engine thread, which then serves: see EngineThread.start. From here the
    # server sees the engine only through its read API (server/bridge.py).
    grammar = core.grammar  # thread-safe: the server compiles with it, the engine matches
    engine = start_engine(core, shaper_window_s=config.shaper_window_ms / 1000)
    del core
    snapshot = engine.snapshot()
    speed = snapshot.idle_speed  # timed after the warm-up: the auto TTFT targets follow it
    admission = Admission(
        config,
        step_costs=lambda: engine.snapshot().step_costs,
        num_running=lambda: engine.snapshot().num_running,
        typical_prompt_tokens=speed.prompt_tokens if speed else 0,
        idle_ttft_s=speed.ttft_s if speed else None,
        auto_in_flight_limit=auto_in_flight(
            available_memory_bytes(), snapshot.max_model_len, snapshot.max_waiting
        ),
    )
    config = admission.config  # the TTFT targets resolved
    log_tier_targets(admission, speed.decode_s if speed else None)
    if api_keys is not None:  # committed capacity, at both admission and the KV slots
        admission.priority_reserved = api_keys.priority_seats(config.priority.max_in_flight)
        engine.configure(
            EngineSettings(reserved_priority_seats=api_keys.priority_seats(snapshot.max_num_seqs))
        )
    device_kind = snapshot.device_kind
    alert_ms = config.alert_priority_itl_p99_ms
    if alert_ms is None:
        alert_ms = 2.0 if device_kind == "gpu" else 0.0
    metrics = ServerMetrics(
        tenants=api_keys.tenants if api_keys else (),
        device_kind=device_kind,
        alert_priority_itl_p99_s=alert_ms / 1000,
    )
    # queues, slots, cache and speculation counters: the engine's published snapshot
    metrics.set_spec_source(engine.snapshot)
    metrics.set_occupancy_source(engine.snapshot)
    kv_cache_stats = kv_cache_reader(engine)
    if kv_cache_stats is not None:  # the tiered KV cache's series (kvcache/)
        metrics.registry.register(KVCacheCollector(kv_cache_stats))
    engine.on_stats = metrics.on_step
    limits = Limits(
        vocab_size=tokenizer.vocab_size,
        max_tokens_cap=config.max_tokens_cap,
        # response_format and tools need the grammar engine (llguidance, this model's vocab)
        features=frozenset({"session_id"} | ({"response_format", "tools"} if grammar else set())),
        sampling_defaults=merged_defaults(tokenizer.generation_defaults, config.sampling_defaults),
    )
    store = open_store(
        config.session_store or default_session_store(),
        config.session_ttl_s,
        config.max_sessions_per_tenant,
    )
    state = ServerState(
        config=config,
        engine=engine,
        tokenizer=tokenizer,
        model_name=config.served_model_name or files.name,
        max_model_len=snapshot.max_model_len,
        limits=limits,
        admission=admission,
        metrics=metrics,
        api_keys=api_keys,
        guard=guard,
        sessions=SessionFlow(
            store, config.session_commit_grace_s, config.served_model_name or files.name
        ),
        grammar=grammar,
    )
    if config.models:  # several models resident by use: the first one is loaded now
        attach_residency(state, engine_config, config, build_engine)
    return state


def freeze_startup_heap() -> None:
    """Put every object made so far (modules, torch, the tokenizer, the app: ~190k objects
    here) out of the cyclic collector's reach. A full collection walked them all: 70-120 ms
    with every thread stopped, three times in a 30 s benchmark, each one a stalled token."""
    gc.collect()
    gc.freeze()


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())  # no bearer token reaches a log line
    if config.api_keys_path is None:
        if config.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"refusing to listen on {config.host} without --api-keys: "
                "without keys the server binds to loopback only"
            )
        print(
            "ultrafast: no --api-keys: authentication is off, listening on loopback only",
            flush=True,
        )
    elif config.host not in LOOPBACK_HOSTS:
        log.warning("listening on %s: reachable from other machines", config.host)
    state = build_state(engine_config, config)
    uv_config = uvicorn.Config(
        build_app(state),
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=3,
        h11_max_incomplete_event_size=16 * 1024,  # oversized headers are refused by h11
        http=protocol_class(
            config.header_timeout_s,
            config.write_stall_timeout_s,
            config.body_timeout_s,
            config.max_connections_per_ip,
        ),
    )
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(RedactingFilter())
    server = DrainingServer(uv_config, state)
    unwatch_gc = state.metrics.watch_gc()
    freeze_startup_heap()
    try:
        server.run()
    finally:
        unwatch_gc()
        if state.residency is not None:
            state.residency.close()
        else:
            shutdown_engine(state.engine)
    return server.exit_code


if __name__ == "__main__":
    sys.exit(serve(EngineConfig(model=sys.argv[1]), ServerConfig()))
