"""A multi-model server: every model's runtime, and the loader the residency registry calls.

Each model has one ModelRuntime (server/runtime.py) for the server's life: made at start from
its files (tokenizer, limits, admission), given an engine by `open_model` (server/build.py)
each time it loads, and kept while it is not resident, so /tokenize and the limits answer for
it without loading it. The first model is opened at start like a single model's; the pinned
ones load at start too. `open_model` is passed in: only build.py may import the engine's
builder (tests/unit/test_server_import_boundary.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ultrafast.config import EngineConfig
from ultrafast.model_files import ModelFiles, load_tokenizer, resolve_model
from ultrafast.server.bridge import EngineThread, shutdown_engine
from ultrafast.server.residency.budget import resident_bytes
from ultrafast.server.residency.metrics import ResidencyCollector
from ultrafast.server.residency.registry import ModelEntry, ModelRegistry
from ultrafast.server.runtime import ModelRuntime, ModelSet, ModelWiring

log = logging.getLogger("ultrafast.models")

OpenModel = Callable[..., ModelRuntime]  # build.py's open_model


@dataclass
class ResidentModel:
    runtime: ModelRuntime
    engine: EngineThread  # this load's engine (the runtime's until the next load)

    def close(self) -> None:
        shutdown_engine(self.engine)


class ModelLoader:
    """Called on the registry's worker thread: model name -> ResidentModel."""

    def __init__(
        self,
        open_model: OpenModel,
        engine_configs: dict[str, EngineConfig],
        wiring: ModelWiring,
        runtimes: dict[str, ModelRuntime],
    ):
        self.open_model = open_model
        self.engine_configs = engine_configs
        self.wiring = wiring
        self.runtimes = runtimes

    def __call__(self, name: str) -> ResidentModel:
        runtime = self.open_model(name, self.engine_configs[name], self.wiring, self.runtimes[name])
        return ResidentModel(runtime, runtime.live)


def declared_len(config: EngineConfig, files: ModelFiles) -> int:
    return min(config.max_model_len, files.max_position_embeddings or config.max_model_len)


def unloaded_runtime(
    name: str,
    config: EngineConfig,
    first: ModelRuntime,
    wiring: ModelWiring,
    new_runtime: Callable[..., ModelRuntime],
) -> ModelRuntime:
    """A model's runtime before its first load: its own tokenizer, limits and admission (its
    grammar runtime comes with its engine, as the first model's did)."""
    files = resolve_model(config.model)  # a missing file fails at start, not at the first call
    tokenizer = load_tokenizer(files, config.chat_template)
    runtime = new_runtime(
        name, tokenizer, declared_len(config, files), wiring, first.grammar is not None
    )
    runtime.files = files
    return runtime


def open_residency(
    first: ModelRuntime,
    engine_config: EngineConfig,
    wiring: ModelWiring,
    open_model: OpenModel,
    new_runtime: Callable[..., ModelRuntime],
) -> ModelSet:
    """The models of `wiring.config.models`, the first one (`first`) opened already."""
    config, metrics = wiring.config, wiring.metrics
    assert metrics is not None, "the metrics exist once the first model is open"
    configs = {name: replace(engine_config, model=path) for name, path in config.models}
    runtimes = {
        name: first
        if name == first.name
        else unloaded_runtime(name, configs[name], first, wiring, new_runtime)
        for name in configs
    }
    entries = []
    for name, runtime in runtimes.items():
        assert runtime.files is not None
        max_len = declared_len(configs[name], runtime.files)
        entries.append(
            ModelEntry(
                name,
                resident_bytes(runtime.files, configs[name].num_slots, max_len),
                pinned=name in config.pinned_models,
                extra={"max_model_len": max_len},
            )
        )
    loader = ModelLoader(open_model, configs, wiring, runtimes)
    registry = ModelRegistry(
        entries,
        loader,
        budget_bytes=config.max_resident_bytes,
        keep_alive_s=config.keep_alive_s,
        load_timeout_s=config.model_load_timeout_s,
        preload=config.preload_models,
    )
    start_resident(registry, loader, first)
    metrics.registry.register(ResidencyCollector(registry))
    log.info(
        "models: %s; resident budget %s bytes",
        ", ".join(f"{e.name} ({e.num_bytes} bytes)" for e in entries),
        config.max_resident_bytes or "unlimited",
    )
    others = [r for r in runtimes.values() if r is not first]
    return ModelSet([first, *others], registry)


def start_resident(registry: ModelRegistry, loader: ModelLoader, first: ModelRuntime) -> None:
    """The first model (open already) and the pinned ones are resident from the start."""
    budget = loader.wiring.config.max_resident_bytes
    default = registry.entries[first.name]
    if budget and default.num_bytes > budget:
        shutdown_engine(first.live)
        raise ValueError(
            f"the default model {default.name!r} needs {default.num_bytes} bytes, more than "
            f"--max-resident-bytes {budget}"
        )
    registry.adopt(first.name, ResidentModel(first, first.live), None)
    for name in loader.wiring.config.pinned_models:  # pinned models load now and stay
        if registry.entries[name].resident is None:
            registry.evict_for_startup(name)
            started = time.perf_counter()
            registry.adopt(name, loader(name), time.perf_counter() - started)
