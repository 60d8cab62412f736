"""Build the serving state: each model's runtime (`open_model`: its engine, warmed up on its
thread, tokenizer, limits, admission), then the server-wide metrics, guards, sessions, keys.
Imported by `serve` on its model-load thread only, after the port is bound and answering
(server/startup.py): importing the engine (torch, llama.cpp) takes seconds itself.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading

from ultrafast.config import EngineConfig, ServerConfig, default_session_store
from ultrafast.engine_sizing import embedding_pooling
from ultrafast.llm import build_embedding_engine, build_engine
from ultrafast.model.kv_budget import available_memory_bytes
from ultrafast.model_defaults import merged_defaults
from ultrafast.server.admission import Admission, auto_in_flight
from ultrafast.server.bridge import (
    EmbeddingEngine,
    EngineSettings,
    kv_cache_reader,
    start_engine,
)
from ultrafast.server.embed_models import embedding_only_state, split_embedding_models
from ultrafast.server.guard import (
    AllGuards,
    ClassifierGuard,
    GuardConfig,
    OutputGuard,
    PatternGuard,
    load_score_function,
)
from ultrafast.server.kv_metrics import KVCacheCollector
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.protocol import Limits
from ultrafast.server.residency.loader import open_residency
from ultrafast.server.runtime import ModelRuntime, ModelSet, ModelWiring
from ultrafast.server.sessions.backends import open_store
from ultrafast.server.sessions.flow import SessionFlow
from ultrafast.server.state import ServerState
from ultrafast.server.tenants import ApiKeys, server_api_keys
from ultrafast.tokenizer import Tokenizer

log = logging.getLogger("ultrafast")


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


def start_embedders(models, n_threads: int | None) -> dict[str, EmbeddingEngine]:
    embedders = {name: build_embedding_engine(path, n_threads) for name, path in models}
    for name, engine in embedders.items():
        log.info(
            "embedding model %s: %s pooling, %d dimensions", name, engine.pooling, engine.dimensions
        )
    return embedders


def build_state(engine_config: EngineConfig, config: ServerConfig) -> ServerState:
    embed_models, chat_config, config = split_embedding_models(
        engine_config, config, embedding_pooling
    )
    if chat_config is None:  # embedding models only
        api_keys = server_api_keys(config.api_keys_path, config.api_key_hashes)
        embedders = start_embedders(embed_models, engine_config.n_threads)
        return embedding_only_state(config, embedders, api_keys)
    state = build_chat_state(chat_config, config)
    state.embedders = start_embedders(embed_models, engine_config.n_threads)
    return state


def build_chat_state(engine_config: EngineConfig, config: ServerConfig) -> ServerState:
    api_keys = server_api_keys(config.api_keys_path, config.api_key_hashes)
    guard = build_guard(config)  # bad files fail before the model loads
    wiring = ModelWiring(config, api_keys)
    first = open_model(config.served_model_name, engine_config, wiring)
    config = wiring.config  # the TTFT targets resolved by the first model's admission
    metrics = server_metrics(config, api_keys, first.live)
    wiring.metrics = metrics
    first.live.on_stats = metrics.on_step  # opened before the metrics existed (the device)
    if config.models:  # several models resident by use: the first one is loaded now
        models = open_residency(first, engine_config, wiring, open_model, new_runtime)
    else:
        models = ModelSet([first])
    # queues, slots, cache and speculation counters: the engine's published snapshot
    metrics.set_speculation_source(models.snapshot)
    metrics.set_occupancy_source(models.snapshot)
    store = open_store(
        config.session_store or default_session_store(),
        config.session_ttl_s,
        config.max_sessions_per_tenant,
        config.redis_ca_file,
    )
    return ServerState(
        config=config,
        models=models,
        metrics=metrics,
        api_keys=api_keys,
        guard=guard,
        sessions=SessionFlow(store, config.session_commit_grace_s, first.name),
    )


def server_metrics(config: ServerConfig, api_keys: ApiKeys | None, engine) -> ServerMetrics:
    """The metrics, with the device the first model runs on and the tiered KV cache's series."""
    device_kind = engine.snapshot().device_kind
    alert_ms = config.alert_priority_itl_p99_ms
    if alert_ms is None:
        alert_ms = 2.0 if device_kind == "gpu" else 0.0
    metrics = ServerMetrics(
        tenants=api_keys.tenants if api_keys else (),
        device_kind=device_kind,
        alert_priority_itl_p99_s=alert_ms / 1000,
    )
    kv_cache_stats = kv_cache_reader(engine)
    if kv_cache_stats is not None:  # the tiered KV cache's series (kvcache/)
        metrics.registry.register(KVCacheCollector(kv_cache_stats))
    return metrics


def open_model(
    name: str | None,
    engine_config: EngineConfig,
    wiring: ModelWiring,
    runtime: ModelRuntime | None = None,
) -> ModelRuntime:
    """Build and start one model's engine and wire it to the server: a new ModelRuntime, or
    `runtime` (a model the residency loader loads again) with its new engine. Start-up and
    the residency loader both open models here. `name` None: the model's file name."""
    config = wiring.config
    core, tokenizer, files = build_engine(
        engine_config,
        priority_itl_target_s=config.priority.itl_ms / 1000,
        default_itl_target_s=config.default.itl_ms / 1000 or None,
        defer_grammar=True,  # built when the engine is first idle (grammar/deferred.py)
    )
    # warm up on the engine thread, which then serves: see EngineThread.start. From here the
    # server sees the engine only through its read API (server/bridge.py). A model's idle
    # speed is measured at its first load; a reload keeps it (and its admission).
    grammar = core.grammar  # thread-safe: the server compiles with it, the engine matches
    first_load = runtime is None or runtime.engine is None
    # the tokenizer's first-request costs, beside the engine's warm-up (llama.cpp's passes
    # run without the GIL): not on the first answer's path
    warming = threading.Thread(target=tokenizer.warm_up, name="tokenizer-warm-up", daemon=True)
    warming.start()
    engine = start_engine(
        core, shaper_window_s=config.shaper_window_ms / 1000, measure_speed=first_load
    )
    warming.join()
    del core
    snapshot = engine.snapshot()
    if runtime is None:  # the server's first model: its admission sets the server's targets
        runtime = first_runtime(name or files.name, tokenizer, grammar, snapshot, wiring)
    runtime.engine, runtime.bridge, runtime.grammar, runtime.files = engine, None, grammar, files
    runtime.max_model_len = snapshot.max_model_len
    if first_load:
        follow_idle_speed(runtime)
    if wiring.api_keys is not None:  # committed capacity, at the KV slots too
        seats = wiring.api_keys.priority_seats(snapshot.max_num_seqs)
        engine.configure(EngineSettings(reserved_priority_seats=seats))
    if wiring.metrics is not None:
        engine.on_stats = wiring.metrics.on_step
    return runtime


def first_runtime(
    name: str, tokenizer: Tokenizer, grammar, snapshot, wiring: ModelWiring
) -> ModelRuntime:
    """The first model's runtime: its admission resolves the auto TTFT targets from the idle
    speed measured at start, and its tier capacity sizes the tenants' committed seats; the
    other models take both (`wiring`)."""
    speed = snapshot.idle_speed  # timed after the warm-up: the auto TTFT targets follow it
    runtime = new_runtime(
        name,
        tokenizer,
        snapshot.max_model_len,
        wiring,
        grammar is not None,
        typical_prompt_tokens=speed.prompt_tokens if speed else 0,
        idle_ttft_s=speed.ttft_s if speed else None,
        auto_in_flight_limit=auto_in_flight(
            available_memory_bytes(), snapshot.max_model_len, snapshot.max_waiting
        ),
    )
    admission = runtime.admission
    wiring.config = config = admission.config  # the TTFT targets resolved
    log_tier_targets(admission, speed.decode_s if speed else None)
    if wiring.api_keys is not None:  # committed capacity at admission (and the KV slots)
        admission.priority_reserved = wiring.api_keys.priority_seats(config.priority.max_in_flight)
        wiring.priority_reserved = dict(admission.priority_reserved)
    return runtime


def new_runtime(
    name: str,
    tokenizer: Tokenizer,
    max_model_len: int,
    wiring: ModelWiring,
    grammar_ready: bool,
    **speed,
) -> ModelRuntime:
    """A model's runtime before its engine is set: limits from its tokenizer, and an
    admission whose engine readers follow the runtime's engine across reloads.
    `grammar_ready`: its engine will have a grammar runtime; `speed`: the Admission's idle
    speed and in-flight fields, when known."""
    config = wiring.config
    limits = Limits(
        vocab_size=tokenizer.vocab_size,
        max_tokens_cap=config.max_tokens_cap,
        # response_format and tools need the grammar engine (llguidance, this model's vocab)
        features=frozenset(
            {"session_id"} | ({"response_format", "tools"} if grammar_ready else set())
        ),
        sampling_defaults=merged_defaults(tokenizer.generation_defaults, config.sampling_defaults),
    )
    runtime: ModelRuntime
    admission = Admission(
        config,
        step_costs=lambda: runtime.live.snapshot().step_costs,
        num_running=lambda: runtime.live.snapshot().num_running,
        **speed,
    )
    admission.priority_reserved = dict(wiring.priority_reserved)
    runtime = ModelRuntime(name, tokenizer, max_model_len, limits, admission)
    return runtime


def set_gil_switch(config: ServerConfig) -> None:
    """How soon the event loop gets the interpreter lock from the engine thread. A step's
    tokens reach their streams on the event loop, while the engine thread starts its next step
    (Python and numpy: a KV push, the scheduler); at Python's 5 ms a batch-1 first token
    waited 3.5 ms behind that step for the lock (its step ended at 40.2 ms, the token left at
    43.7; at 0.5 ms: 39.8 and 40.4, 2-core AMX Xeon)."""
    sys.setswitchinterval(config.gil_switch_ms / 1000)


def freeze_startup_heap() -> None:
    """Put every object made so far (modules, torch, the tokenizer, the app: ~190k objects
    here) out of the cyclic collector's reach. A full collection walked them all: 70-120 ms
    with every thread stopped, three times in a 30 s benchmark, each one a stalled token."""
    gc.collect()
    gc.freeze()


def follow_idle_speed(runtime: ModelRuntime) -> None:
    """The idle speed measured in the background (engine/start_costs.py) reaches admission's
    auto TTFT targets; logged once each time it changes."""
    speed = runtime.live.snapshot().idle_speed
    admission = runtime.admission
    if speed is None or speed.ttft_s == admission.idle_ttft_s:
        return
    admission.update_idle_speed(speed.prompt_tokens, speed.ttft_s)
    log_tier_targets(admission, speed.decode_s)
