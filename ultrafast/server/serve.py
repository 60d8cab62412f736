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
import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, cast

import uvicorn

from ultrafast import early_open
from ultrafast.config import EngineConfig, ServerConfig
from ultrafast.server.auth import RedactingFilter
from ultrafast.server.http_timeouts import protocol_class
from ultrafast.server.startup import LoadingApp, bind_listen_socket

if TYPE_CHECKING:
    from ultrafast.server.state import ServerState

log = logging.getLogger("ultrafast")

ENGINE_DEATH_GRACE_S = 1.0  # for the failed calls' error events to be written
FORCED_ABORT_GRACE_S = 0.5  # second signal: for the "abort" finishes (one engine step)
EXIT_FORCED, EXIT_ENGINE_DEAD = 1, 2


class DrainingServer(uvicorn.Server):
    """`state` is None while the model loads (server/startup.py); `attach` brings it."""

    def __init__(self, config: uvicorn.Config, state: ServerState | None):
        super().__init__(config)
        self.state = cast("ServerState", state)  # None only until attach()
        self.loop_ready = threading.Event()
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # set in startup()
        self._tasks: set[asyncio.Task] = set()  # drain / abort / engine watch: kept referenced

    def handle_exit(self, sig, frame) -> None:
        """Runs in the signal handler, on the event loop's thread, between two callbacks."""
        if self.should_exit and self.force_exit:
            return
        if self._loop is None or self.state is None:  # not serving yet: nothing to drain
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
        from ultrafast.server.build import follow_idle_speed

        while not self.should_exit:
            models = self.state.models
            for runtime in models.loaded():
                follow_idle_speed(runtime)
            if not models.alive:
                log.error("the engine died (%s): exiting", models.dead_reason)
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
        self.loop_ready.set()

    async def attach(self, state: ServerState, app: LoadingApp, real_app) -> None:
        """On the serving loop, once the model is in: serve `real_app` from now on."""
        await app.activate(real_app)
        self.state = state
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


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactingFilter())  # no bearer token reaches a log line
    if not config.auth_on:
        if config.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"refusing to listen on {config.host} without --api-keys FILE or --api-key KEY: "
                "without keys the server binds to loopback only"
            )
        print(
            "ultrafast: no --api-keys: authentication is off, listening on loopback only "
            "(--api-key KEY or --api-keys FILE turn it on)",
            flush=True,
        )
    elif config.host not in LOOPBACK_HOSTS:
        log.warning("listening on %s: reachable from other machines", config.host)
    sock = bind_listen_socket(config.host, config.port)  # a taken port: reported now
    early_open.start(engine_config)  # llama.cpp opens the model beside the imports below
    print(
        f"ultrafast: listening on http://{config.host}:{config.port}, loading the model", flush=True
    )
    app = LoadingApp()
    server = DrainingServer(uvicorn_config(app, config), None)
    loaded: dict = {}
    loader = threading.Thread(
        target=_load, args=(engine_config, config, server, app, loaded), name="model-load"
    )
    loader.daemon = True  # a signal while loading exits without waiting for it
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        loader.join(0 if server.state is None else None)
        state = loaded.get("state")
        if "unwatch_gc" in loaded:
            loaded["unwatch_gc"]()
        _shut_down(state)
    if "error" in loaded:
        raise loaded["error"]
    return server.exit_code


def _shut_down(state: ServerState | None) -> None:
    if state is None:
        return
    for embedder in state.embedders.values():
        embedder.shutdown()
    if state.residency is not None:
        state.residency.close()
    elif state.models.default.engine not in state.embedders.values():
        from ultrafast.server.bridge import shutdown_engine

        shutdown_engine(state.models.default.live)


def uvicorn_config(app, config: ServerConfig) -> uvicorn.Config:
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level="error" if config.log_level == "error" else "warning",
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
    return uv_config


def _load(
    engine_config: EngineConfig,
    config: ServerConfig,
    server: DrainingServer,
    app: LoadingApp,
    loaded: dict,
) -> None:
    """The model-load thread: build the state, then hand it to the serving loop; a failure
    stops the server and is raised by `serve` on the main thread."""
    try:
        from ultrafast.server.app import build_app
        from ultrafast.server.build import build_state, freeze_startup_heap, set_gil_switch
        from ultrafast.server.unread_body import CloseOnUnreadBody

        try:
            state = loaded["state"] = build_state(engine_config, config)
        finally:
            early_open.discard()  # a model the head start opened and nothing adopted
        real_app = CloseOnUnreadBody(build_app(state))  # an early 413 closes, no draining
        loaded["unwatch_gc"] = state.metrics.watch_gc()
        freeze_startup_heap()
        set_gil_switch(config)
        server.loop_ready.wait()
        if server.should_exit or server._loop is None:
            return
        asyncio.run_coroutine_threadsafe(server.attach(state, app, real_app), server._loop).result()
    except BaseException as exc:
        loaded["error"] = exc
        server.should_exit = True


if __name__ == "__main__":
    sys.exit(serve(EngineConfig(model=sys.argv[1]), ServerConfig()))
