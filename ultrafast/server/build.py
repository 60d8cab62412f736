"""Build the serving state: the engine (warmed up on its thread), admission, metrics, guards,
sessions, keys. Imported by `serve` on its model-load thread only, after the port is bound and
answering (server/startup.py): importing the engine (torch, llama.cpp) takes seconds itself.
"""

from __future__ import annotations

import gc
import logging

from ultrafast.config import EngineConfig, ServerConfig, default_session_store
from ultrafast.llm import build_embedding_engine, build_engine, embedding_pooling
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
from ultrafast.server.residency.loader import attach_residency
from ultrafast.server.sessions.backends import open_store
from ultrafast.server.sessions.flow import SessionFlow
from ultrafast.server.state import ServerState
from ultrafast.server.tenants import server_api_keys

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
        config.redis_ca_file,
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
        model_files=files,
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


def follow_idle_speed(state: ServerState) -> None:
    """The idle speed measured in the background (engine/start_costs.py) reaches admission's
    auto TTFT targets; logged once each time it changes."""
    speed = state.engine.snapshot().idle_speed
    admission = state.admission
    if speed is None or speed.ttft_s == admission.idle_ttft_s:
        return
    admission.update_idle_speed(speed.prompt_tokens, speed.ttft_s)
    log_tier_targets(admission, speed.decode_s)
