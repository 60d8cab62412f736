"""What the server keeps per served model (`ModelRuntime`) and the set of them (`ModelSet`).

A `ModelRuntime` is one model's engine, tokenizer, limits, admission, bridge, grammar runtime
and files; `server/build.py:open_model` is the one function that builds it, at start-up and
when the residency loader (server/residency/loader.py) loads a model again. `ServerState`
keeps only what is server-wide and a `ModelSet`, always present: one model is the
one-element case, several models add the residency registry that loads and unloads them by
use. A call leases the runtime of the model it names (`ModelSet.lease`) and runs on it, so
nothing downstream knows how many models there are.

A runtime outlives its model's loads: the residency loader replaces its engine (and drops
its bridge) each time the model loads again, and keeps the tokenizer, limits and admission,
whose refusal counters must not go back to zero. Between loads `engine` is the stopped one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ultrafast.config import ServerConfig
from ultrafast.model_files import ModelFiles
from ultrafast.server.admission import Admission
from ultrafast.server.bridge import EngineBridge, EngineThread
from ultrafast.server.errors import APIError
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.protocol import Limits
from ultrafast.server.tenants import ApiKeys
from ultrafast.tokenizer import Tokenizer

if TYPE_CHECKING:  # the grammar package loads llguidance: only its type is needed here
    from ultrafast.grammar.matcher import GrammarRuntime
    from ultrafast.server.residency.registry import ModelRegistry


@dataclass(eq=False)
class ModelRuntime:
    name: str
    tokenizer: Tokenizer
    max_model_len: int
    limits: Limits
    admission: Admission
    # read through its read API only (server/bridge.py); None: never loaded yet
    engine: EngineThread | None = None
    grammar: GrammarRuntime | None = None  # compiles off the engine thread; None: no grammar
    files: ModelFiles | None = None  # the model's files (Ollama's /api/show, /api/tags)
    bridge: EngineBridge | None = None  # made on the event loop, at the first call

    @property
    def live(self) -> EngineThread:
        """The engine of a loaded model (a lease or ModelSet.loaded gives only those)."""
        assert self.engine is not None, f"the model {self.name} is not loaded"
        return self.engine

    def bridge_on_loop(self, max_events: int) -> EngineBridge:
        """The bridge to this model's engine, made on the running loop the first time."""
        if self.bridge is None:
            self.bridge = EngineBridge(self.live, asyncio.get_running_loop(), max_events)
        return self.bridge


@dataclass
class ModelWiring:
    """The server-wide parts every model's engine and admission are wired to (open_model)."""

    config: ServerConfig  # after the first model opened: with its resolved TTFT targets
    api_keys: ApiKeys | None = None
    metrics: ServerMetrics | None = None  # None while the first model opens (it names the device)
    # tenant -> committed priority seats at admission, from the first model's tier capacity
    priority_reserved: dict = field(default_factory=dict)


def _no_release() -> None:
    pass


class ModelSet:
    """The served models, the default (first) one first. With `registry` (several models,
    resident by use) a lease loads the model if need be and holds it until released."""

    def __init__(self, runtimes: list[ModelRuntime], registry: ModelRegistry | None = None):
        assert runtimes, "a server serves at least one model"
        self.runtimes = {r.name: r for r in runtimes}
        self.default = runtimes[0]
        self.registry = registry
        self._last_snapshot: Any = None

    def get(self, name: str | None) -> ModelRuntime:
        """The named model's runtime (loaded or not); None: the default; else a 404."""
        if self.registry is not None:
            return self.runtimes[self.registry.entry(name).name]
        if name is not None and name != self.default.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server has {self.default.name!r}",
                "not_found_error",
                "model_not_found",
                "model",
            )
        return self.default

    def limits_for(self, name: object) -> Limits:
        """The request limits of the model a body names (unknown: the default's; the call
        itself answers the 404)."""
        if not isinstance(name, str | None):
            return self.default.limits
        runtime = self.runtimes.get(name if name is not None else self.default.name)
        return (runtime or self.default).limits

    async def lease(
        self, name: str | None, keep_alive_s: float | None | bool, max_events: int
    ) -> tuple[ModelRuntime, Callable[[], None]]:
        """The named model's runtime, loaded, with its bridge; and the release to call once
        when the call ends (several models: the model may unload after it)."""
        if self.registry is None:
            runtime, release = self.get(name), _no_release
        else:
            runtime, release = await self.registry.acquire(name, keep_alive_s)
        runtime.bridge_on_loop(max_events)
        return runtime, release

    def loaded(self) -> list[ModelRuntime]:
        """The runtimes whose engine runs now (an evicted model's was stopped on purpose)."""
        if self.registry is None:
            return [self.default]
        return [self.runtimes[e.name] for e in self.registry.loaded()]

    @property
    def alive(self) -> bool:
        """Every loaded engine runs: one that dies stops the server (exit 2, serve.py)."""
        return all(r.live.alive for r in self.loaded())

    @property
    def dead_reason(self) -> str | None:
        return next((r.live.dead_reason for r in self.loaded() if not r.live.alive), None)

    def snapshot(self) -> Any:
        """The engine snapshot of the most recently used loaded model (the last one seen
        when none is loaded): /ready and the scrape-time metrics read it."""
        if self.registry is None:
            return self.default.live.snapshot()
        loaded = self.registry.loaded()
        if loaded or self._last_snapshot is None:  # the default was loaded at start
            latest = max(loaded, key=lambda e: e.last_used_s).name if loaded else None
            self._last_snapshot = self.runtimes[latest or self.default.name].live.snapshot()
        return self._last_snapshot

    def admissions(self) -> list[Admission]:
        return [r.admission for r in self.runtimes.values()]

    def refused(self) -> dict:
        """reason -> admission refusals over every model (the metrics read it)."""
        counts: dict = {}
        for admission in self.admissions():
            for reason, n in admission.refused.items():
                counts[reason] = counts.get(reason, 0) + n
        return counts
