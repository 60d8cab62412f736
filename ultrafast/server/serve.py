"""`ultrafast serve`: build the engine, start uvicorn, print the ready line, drain on SIGTERM.

SIGTERM (or the first Ctrl-C): /ready turns 503 and new calls get 503 server_shutting_down,
while running streams may finish for `drain_timeout_s`; whatever is left then ends with
finish_reason "abort", and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import uvicorn

from ultrafast.config import EngineConfig, ServerConfig, default_session_store
from ultrafast.llm import build_engine
from ultrafast.runtime.engine import EngineThread
from ultrafast.server.admission import Admission
from ultrafast.server.app import ServerState, build_app
from ultrafast.server.protocol import Limits
from ultrafast.server.session_flow import SessionFlow
from ultrafast.server.sessions import open_store

log = logging.getLogger("ultrafast")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.state.draining:  # second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True  # /ready and new calls answer 503 from now on
        loop = self._loop
        loop.call_soon_threadsafe(lambda: setattr(self, "_drain_task",
                                                  loop.create_task(self._drain())))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.state.config.drain_timeout_s
        admission = self.state.admission
        while sum(admission.in_flight.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if sum(admission.in_flight.values()):
            self.state.abort_everything()
            await asyncio.sleep(0.5)  # let the abort events reach the clients
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        host, port = self.config.host, self.config.port
        print(f"ultrafast ready: model {self.state.model_name!r} on http://{host}:{port}\n"
              f"  curl http://{host}:{port}/v1/chat/completions -H 'Content-Type: application/json'"
              f" -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"def fibonacci(n):\"}}],"
              f" \"max_tokens\": 64, \"service_tier\": \"priority\"}}'", flush=True)


def build_state(engine_config: EngineConfig, config: ServerConfig) -> ServerState:
    core, tokenizer, files = build_engine(engine_config,
                                          priority_itl_target_s=config.priority.itl_ms / 1000)
    core.warmup()
    admission = Admission(config, costs=core.costs)  # after warmup(), which resets the fit
    engine = EngineThread(core, shaper_window_s=config.shaper_window_ms / 1000).start()
    limits = Limits(vocab_size=tokenizer.vocab_size, max_tokens_cap=config.max_tokens_cap,
                    features=frozenset({"session_id"}))
    store = open_store(config.session_store or default_session_store(), config.session_ttl_s,
                       config.max_sessions_per_tenant)
    return ServerState(config=config, engine=engine, tokenizer=tokenizer,
                       model_name=config.served_model_name or files.name,
                       max_model_len=core.scheduler.config.max_model_len, limits=limits,
                       admission=admission,
                       sessions=SessionFlow(store, config.session_commit_grace_s,
                                            config.served_model_name or files.name))


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: reachable from other machines", config.host)
    state = build_state(engine_config, config)
    uv_config = uvicorn.Config(
        build_app(state), host=config.host, port=config.port, log_level="warning",
        access_log=False, timeout_keep_alive=5, timeout_graceful_shutdown=3,
        h11_max_incomplete_event_size=16 * 1024)  # oversized headers are refused by h11
    server = DrainingServer(uv_config, state)
    try:
        server.run()
    finally:
        state.engine.stop()
        state.engine.core.executor.close()
    return 0 if not server.force_exit else 1


if __name__ == "__main__":
    sys.exit(serve(EngineConfig(model=sys.argv[1]), ServerConfig()))
