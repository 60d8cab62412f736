"""Builds one model's engine and its per-model server state, and wires a multi-model server.

Each resident model keeps its own EngineThread (the engine is unchanged); its *view* is a copy
of the server's state with that model's engine, tokenizer, limits, admission and bridge, and
the server-wide parts shared (runs, metrics, sessions, tokenizer pool). The call pipeline
(server/calls.py) runs a call on its model's view, so nothing downstream knows there are
several models. The engine builder comes from serve.py (the only server module that may
import the engine's builder, tests/unit/test_server_import_boundary.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ultrafast.config import EngineConfig, ServerConfig
from ultrafast.model_defaults import merged_defaults
from ultrafast.model_files import load_tokenizer, resolve_model
from ultrafast.server.admission import Admission
from ultrafast.server.bridge import EngineSettings, EngineThread, shutdown_engine
from ultrafast.server.bridge import start_engine as start_engine_thread
from ultrafast.server.protocol import Limits
from ultrafast.server.residency.budget import resident_bytes
from ultrafast.server.residency.metrics import ResidencyCollector
from ultrafast.server.residency.registry import ModelEntry, ModelRegistry
from ultrafast.server.state import ServerState

log = logging.getLogger("ultrafast.models")


@dataclass
class ResidentModel:
    view: ServerState
    engine: EngineThread

    def close(self) -> None:
        shutdown_engine(self.engine)


class ModelLoader:
    """Called on the registry's worker thread: model name -> ResidentModel."""

    def __init__(
        self,
        build_engine: Callable[..., tuple],
        engine_configs: dict[str, EngineConfig],
        config: ServerConfig,
    ):
        self.build_engine = build_engine
        self.engine_configs = engine_configs
        self.config = config
        self.base: ServerState | None = None  # the server's state, set before any load
        self.admissions: dict[str, Admission] = {}  # one per model, kept across reloads
        self.engines: dict[str, EngineThread] = {}  # each model's latest engine
        self.limits: dict[str, Limits] = {}

    def __call__(self, name: str) -> ResidentModel:
        core, tokenizer, _files = self.build_engine(
            self.engine_configs[name],
            priority_itl_target_s=self.config.priority.itl_ms / 1000,
            default_itl_target_s=self.config.default.itl_ms / 1000 or None,
        )
        engine = start_engine_thread(
            core,
            shaper_window_s=self.config.shaper_window_ms / 1000,
            # a reload keeps the admission (and idle speed) of the model's first load
            measure_speed=name not in self.admissions,
        )
        del core
        return self.wrap(name, engine, tokenizer)

    def wrap(self, name: str, engine: EngineThread, tokenizer: Any) -> ResidentModel:
        base = self.base
        assert base is not None, "the server state exists before a model loads"
        self.engines[name] = engine
        snapshot = engine.snapshot()
        admission = self.admissions.get(name)
        if admission is None:
            speed = snapshot.idle_speed
            admission = Admission(
                self.config,
                step_costs=lambda: self.engines[name].snapshot().step_costs,
                num_running=lambda: self.engines[name].snapshot().num_running,
                typical_prompt_tokens=speed.prompt_tokens if speed else 0,
                idle_ttft_s=speed.ttft_s if speed else None,
            )
            admission.priority_reserved = dict(base.admission.priority_reserved)
            self.admissions[name] = admission
        if base.api_keys is not None:
            engine.configure(
                EngineSettings(
                    reserved_priority_seats=base.api_keys.priority_seats(snapshot.max_num_seqs)
                )
            )
        engine.on_stats = base.metrics.on_step
        view = replace(
            base,
            engine=engine,
            tokenizer=tokenizer,
            model_name=name,
            max_model_len=snapshot.max_model_len,
            limits=self.limits.get(name, base.limits),
            admission=admission,
            bridge=None,  # made on the event loop, at the first call (registry.view_for)
            residency=None,
        )
        return ResidentModel(view, engine)


class ResidentEngines:
    """The server-wide engine read API over whichever models are loaded (readiness, the
    engine watch, /ready and the scrape-time metrics read it). Alive while every loaded
    engine is: an engine that dies while loaded still stops the server (exit 2, serve.py);
    an evicted one was stopped on purpose and is not looked at."""

    def __init__(self, registry: ModelRegistry, first: EngineThread):
        self.registry = registry
        self._last_snapshot = first.snapshot()

    def _engines(self) -> list[EngineThread]:
        return [e.resident.engine for e in self.registry.loaded()]

    @property
    def alive(self) -> bool:
        return all(engine.alive for engine in self._engines())

    @property
    def dead_reason(self) -> str | None:
        return next((e.dead_reason for e in self._engines() if not e.alive), None)

    def snapshot(self):
        """The most recently used loaded model's snapshot (the last one seen when none is)."""
        loaded = self.registry.loaded()
        if loaded:
            latest = max(loaded, key=lambda e: e.last_used_s)
            self._last_snapshot = latest.resident.engine.snapshot()
        return self._last_snapshot

    def cached_prefix_tokens(self, prompt: list[int], tenant: str) -> int:
        return 0  # calls ask their own model's engine (the view's)


def other_models_refusals(loader: ModelLoader, default: Admission) -> dict:
    """reason -> count of every model's admission but the default one (app.py reads that)."""
    counts: dict = {}
    for admission in loader.admissions.values():
        if admission is not default:
            for reason, n in admission.refused.items():
                counts[reason] = counts.get(reason, 0) + n
    return counts


def attach_residency(
    state: ServerState,
    engine_config: EngineConfig,
    config: ServerConfig,
    build_engine: Callable[..., tuple],
) -> ServerState:
    """Turn a server built for the first model of `config.models` into a multi-model one."""
    configs = {name: replace(engine_config, model=path) for name, path in config.models}
    loader = ModelLoader(build_engine, configs, config)
    loader.base = state
    entries = []
    for name, path in config.models:
        files = resolve_model(path)  # a missing file fails at start, not at the first call
        cfg = configs[name]
        max_len = min(cfg.max_model_len, files.max_position_embeddings or cfg.max_model_len)
        tokenizer = (
            state.tokenizer
            if name == state.model_name
            else load_tokenizer(files, cfg.chat_template)
        )
        loader.limits[name] = replace(
            state.limits,
            vocab_size=tokenizer.vocab_size,
            sampling_defaults=merged_defaults(
                tokenizer.generation_defaults, config.sampling_defaults
            ),
        )
        entries.append(
            ModelEntry(
                name,
                resident_bytes(files, cfg.num_slots, max_len),
                pinned=name in config.pinned_models,
                extra={"max_model_len": max_len},
            )
        )
    registry = ModelRegistry(
        entries,
        loader,
        budget_bytes=config.max_resident_bytes,
        keep_alive_s=config.keep_alive_s,
        load_timeout_s=config.model_load_timeout_s,
        preload=config.preload_models,
    )
    first = state.engine
    loader.admissions[state.model_name] = state.admission
    state.admission.step_costs = lambda: loader.engines[state.model_name].snapshot().step_costs
    state.admission.num_running = lambda: loader.engines[state.model_name].snapshot().num_running
    default = registry.entries[state.model_name]
    if config.max_resident_bytes and default.num_bytes > config.max_resident_bytes:
        shutdown_engine(first)
        raise ValueError(
            f"the default model {default.name!r} needs {default.num_bytes} bytes, more than "
            f"--max-resident-bytes {config.max_resident_bytes}"
        )
    registry.adopt(state.model_name, loader.wrap(state.model_name, first, state.tokenizer), None)
    for name in config.pinned_models:  # pinned models load now and stay
        if registry.entries[name].resident is None:
            registry.evict_for_startup(name)
            started = time.perf_counter()
            registry.adopt(name, loader(name), time.perf_counter() - started)
    engines = ResidentEngines(registry, first)
    state.engine = engines  # type: ignore[assignment]  # the same read API, over all models
    state.metrics.set_spec_source(engines.snapshot)
    state.metrics.set_occupancy_source(engines.snapshot)
    state.metrics.registry.register(ResidencyCollector(registry))
    state.metrics.add_refusal_source(lambda: other_models_refusals(loader, state.admission))
    state.residency = registry
    log.info(
        "models: %s; resident budget %s bytes",
        ", ".join(f"{e.name} ({e.num_bytes} bytes)" for e in entries),
        config.max_resident_bytes or "unlimited",
    )
    return state
