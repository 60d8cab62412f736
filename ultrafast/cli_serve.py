"""`ultrafast generate` and `ultrafast serve`: the commands that run the engine.

Every default comes from the config dataclasses (EngineConfig, ServerConfig), so a flag and the
field it sets cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from ultrafast.config import EXECUTORS, SPEC_METHODS, EngineConfig, ServerConfig
from ultrafast.weight_format import AUTO, OUT_TYPES

COMPILE_MODES = ("auto", "inductor", "graphs", "off")


def serve_default_threads() -> int:
    """Every core but one: the benchmarks' fixed split for a server they start (serve itself
    measures its thread counts per pass width at start instead)."""
    from ultrafast.executors.ggml_exec import physical_cores

    # one core stays with the event loop, tokenizer and clients: kernels on every core compete
    # with them and slow streaming over HTTP on a small machine
    return max(1, physical_cores() - 1)


def add_compile_arg(p: argparse.ArgumentParser, help_text: str | None = None) -> None:
    p.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=EngineConfig.compile,
        choices=COMPILE_MODES,
        help=help_text
        or "torch executor decode steps: torch.compile (inductor) and, "
        "on CUDA, CUDA graphs; graphs = CUDA graphs of eager kernels; auto = on with "
        "CUDA (bare --compile = inductor)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: $ULTRAFAST_MODEL, else "
        "SmolLM2-135M-Instruct as fetched by `make setup`, else the bundled demo model)",
    )
    p.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=EngineConfig.executor,
        help="auto = ggml (llama.cpp kernels) on CPU, torch on CUDA; fake = no model, "
        "deterministic word tokens (load and fault tests only)",
    )
    p.add_argument(
        "--fake-step-ms",
        type=float,
        default=1000 * EngineConfig.fake_step_s,
        help=argparse.SUPPRESS,
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=EngineConfig.max_model_len,
        help="positions per KV slot",
    )
    p.add_argument(
        "--num-slots",
        type=int,
        default=EngineConfig.num_slots,
        help="KV slots (concurrent sequences and cached prefixes); 0 = sized from free memory",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="kernel threads: ggml's, or torch's on CPU (default: all cores; serve with ggml: "
        "timed at start for each pass width, all cores or all but one)",
    )
    p.add_argument(
        "--batch-threads",
        type=int,
        default=None,
        help="ggml threads for passes of more than one token: prefill chunks, draft "
        "verification, several streams' decodes (default: --threads)",
    )
    p.add_argument(
        "--spec",
        choices=SPEC_METHODS,
        default=EngineConfig.spec,
        help="speculative decoding: n-gram prompt lookup, a draft model, or auto "
        "(n-gram, else the draft model); a request's `prediction` is always used",
    )
    p.add_argument(
        "--spec-tiers",
        default=",".join(EngineConfig.spec_tiers),
        help="comma-separated tiers that draft (priority, default, flex)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="draft model (HF dir or .gguf, same tokenizer; default: the bundled "
        "demo draft when it fits the model)",
    )
    p.add_argument(
        "--max-draft-tokens",
        type=int,
        default=EngineConfig.max_draft_tokens,
        help="upper bound of the adaptive number of draft tokens per step",
    )
    p.add_argument(
        "--short-first-window-ms",
        type=float,
        default=EngineConfig.short_first_window_s * 1000,
        help="default/flex requests expected to finish sooner go ahead of longer ones that "
        "arrived up to this long before them (0: first come, first served)",
    )
    p.add_argument(
        "--spec-costs",
        choices=["measured", "fixed"],
        default="measured",
        help="step costs that size the number of draft tokens: measured on this machine "
        "(default), or fixed defaults, so the drafts do not depend on the machine's load "
        "(reproducible runs, tests)",
    )
    p.add_argument(
        "--gguf-type",
        choices=[AUTO, *OUT_TYPES],
        default=EngineConfig.gguf_type,
        help="weight type an HF directory converts to for the ggml executor: auto = bf16 "
        "where the CPU has AVX-512 BF16, else f16; q8_0 = half of f16's bytes",
    )
    p.add_argument(
        "--flash-attn",
        choices=["on", "off"],
        default="on" if EngineConfig.flash_attn else "off",
        help="ggml executor: llama.cpp's fused CPU attention (default on: faster decode, "
        "batches and prefill on SmolLM2 here); off: the plain attention ops",
    )
    add_compile_arg(p)


def chosen_model(explicit: str | None) -> tuple[str, str | None]:
    """(model path, served name or None) for a command given `explicit` or no model. Without
    one, SmolLM2 serves as `smollm2-135m-instruct`; when it was never fetched, one line on
    stderr says so and the demo model serves instead."""
    from pathlib import Path

    from ultrafast.config import SMOLLM2_SERVED_NAME, default_model_choice, smollm2_gguf

    if explicit:
        smollm2 = smollm2_gguf()
        same = smollm2.is_file() and Path(explicit).expanduser().resolve() == smollm2.resolve()
        return explicit, SMOLLM2_SERVED_NAME if same else None
    choice = default_model_choice()
    if choice.fallback_notice:
        print(f"ultrafast: {choice.fallback_notice}", file=sys.stderr)
    return choice.path, choice.served_name


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's keyword arguments (all but the model) from the engine flags."""
    tiers = tuple(t.strip() for t in args.spec_tiers.split(",") if t.strip())
    return dict(
        executor=args.executor,
        max_model_len=args.max_model_len,
        num_slots=args.num_slots,
        max_num_seqs=args.num_slots,
        n_threads=args.threads,
        n_threads_batch=args.batch_threads,
        fake_step_s=args.fake_step_ms / 1000,
        spec=args.spec,
        spec_tiers=tiers,
        draft_model=args.draft_model,
        max_draft_tokens=args.max_draft_tokens,
        spec_measured_costs=args.spec_costs == "measured",
        short_first_window_s=args.short_first_window_ms / 1000,
        flash_attn=args.flash_attn == "on",
        compile=args.compile,
        gguf_type=args.gguf_type,
    )


def add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print TTFT and speed to stderr")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from ultrafast.llm import LLM
    from ultrafast.request import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    model, _ = chosen_model(args.model)
    llm = LLM(model, **engine_options(args))
    started = time.perf_counter()
    first_s = None
    pieces = []
    sys.stdout.write(args.prompt)
    for delta in llm.stream(args.prompt, params):
        if first_s is None:
            first_s = time.perf_counter() - started
        pieces.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    total_s = time.perf_counter() - started
    sys.stdout.write("\n")
    num_tokens = len(llm.tokenizer.encode("".join(pieces), add_special_tokens=False))
    if args.stats:
        spec = llm.engine.spec_stats
        drafted = sum(spec.num_draft_tokens.values()) if spec else 0
        accepted = sum(spec.num_accepted_tokens.values()) if spec else 0
        print(
            f"[{llm.files.name} on {type(llm.engine.executor).__name__}: "
            f"ttft {1000 * (first_s or total_s):.1f} ms, ~{num_tokens} tokens in "
            f"{total_s:.2f} s; spec {args.spec}: {accepted}/{drafted} drafts accepted]",
            file=sys.stderr,
        )
    llm.close()
    return 0


def _add_tier_args(srv: argparse.ArgumentParser) -> None:
    priority, default = ServerConfig.priority, ServerConfig.default
    srv.add_argument(
        "--priority-ttft-ms",
        type=float,
        default=priority.ttft_ms,
        help=f"priority tier time-to-first-token target (0 = auto: "
        f"{priority.ttft_speed_factor:g}x the idle TTFT of a typical prompt measured at start, "
        f"at least {priority.ttft_floor_ms:g} ms); a priority call that the work queued ahead "
        "would make miss it is refused (429)",
    )
    srv.add_argument(
        "--priority-itl-ms",
        type=float,
        default=priority.itl_ms,
        help="priority inter-token target; steps carrying priority work are sized "
        "to it (0 = auto: 1.2x the measured idle inter-token time)",
    )
    srv.add_argument(
        "--priority-queue",
        type=int,
        default=priority.max_in_flight,
        help="priority calls in flight",
    )
    srv.add_argument(
        "--default-ttft-ms",
        type=float,
        default=default.ttft_ms,
        help="default tier time-to-first-token target (0 = auto, from the measured speed)",
    )
    srv.add_argument(
        "--default-itl-ms",
        type=float,
        default=default.itl_ms,
        help="size steps carrying default-tier decodes to this token gap (0 = off, the default)",
    )
    srv.add_argument(
        "--default-queue",
        type=int,
        default=default.max_in_flight,
        help="default calls in flight (0 = sized from memory; the predicted wait refuses first)",
    )
    srv.add_argument(
        "--shaper-window-ms",
        type=float,
        default=ServerConfig.shaper_window_ms,
        help="coalesce default-tier arrivals this long (0 = off)",
    )
    srv.add_argument("--drain-timeout-s", type=float, default=ServerConfig.drain_timeout_s)
    srv.add_argument(
        "--alert-priority-itl-p99-ms",
        type=float,
        default=ServerConfig.alert_priority_itl_p99_ms,
        help="exported threshold of the priority per-token p99 alert "
        "(default 2 on GPU, off on CPU; 0 = off)",
    )


def _add_session_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--session-store",
        default=ServerConfig.session_store,
        help="conversation history: sqlite:///path (default: sessions.db under "
        "the user data dir) or redis://host:port/db",
    )
    srv.add_argument(
        "--session-ttl-s",
        type=float,
        default=ServerConfig.session_ttl_s,
        help="a session expires this long after its last turn",
    )
    srv.add_argument(
        "--max-sessions-per-tenant", type=int, default=ServerConfig.max_sessions_per_tenant
    )


def _add_access_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--api-keys",
        default=ServerConfig.api_keys_path,
        metavar="FILE",
        help="tenants and sha256-hashed keys (YAML/JSON, see deploy/); without it "
        "there is no auth and the server listens on loopback only",
    )
    srv.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="Host header names to accept (repeatable; default on loopback: "
        "127.0.0.1, localhost, ::1; otherwise any)",
    )
    srv.add_argument(
        "--header-timeout-s",
        type=float,
        default=ServerConfig.header_timeout_s,
        help="close a connection whose request head is not complete in this long "
        "(slowloris; 408 when part of it came; 0 = off)",
    )
    srv.add_argument(
        "--body-timeout-s",
        type=float,
        default=ServerConfig.body_timeout_s,
        help="answer 408 request_timeout when a request body is not complete this "
        "long after its head (a slow body; 0 = off)",
    )
    srv.add_argument(
        "--max-connections-per-ip",
        type=int,
        default=ServerConfig.max_connections_per_ip,
        help="refuse (429 too_many_connections) a connection beyond this many open "
        "ones from one client address (0 = no cap; behind a proxy all clients "
        "share its address)",
    )
    srv.add_argument(
        "--write-stall-timeout-s",
        type=float,
        default=ServerConfig.write_stall_timeout_s,
        help="abort a stream whose client reads nothing for this long, freeing "
        "its KV slot (0 = off)",
    )
    srv.add_argument(
        "--max-tool-calls",
        type=int,
        default=ServerConfig.max_tool_calls,
        help="the most parallel tool calls one turn may make: the grammar ends the turn "
        "after this many (a repetitive model otherwise repeats a call to max_tokens)",
    )


def _add_guard_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--guard-pattern",
        action="append",
        default=[],
        metavar="REGEX",
        help="output safety filter: cut a stream matching REGEX (repeatable)",
    )
    srv.add_argument(
        "--guard-patterns",
        default=ServerConfig.guard_patterns_path,
        metavar="FILE",
        help='output safety filter patterns, JSON {"patterns": [...]}',
    )
    srv.add_argument(
        "--guard-classifier",
        default=ServerConfig.guard_classifier,
        metavar="MODULE:FUNCTION",
        help="output safety filter: a function text -> score in [0, 1], run off "
        "the event loop; scores >= --guard-classifier-threshold cut the stream",
    )
    srv.add_argument(
        "--guard-classifier-threshold", type=float, default=ServerConfig.guard_classifier_threshold
    )
    srv.add_argument(
        "--guard-hold-back-tokens",
        type=int,
        default=ServerConfig.guard_hold_back_tokens,
        help="tokens withheld after each cleared chunk (>= longest pattern)",
    )


def _add_kv_cache_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--kv-host-cache-gb",
        type=float,
        default=EngineConfig.kv_host_cache_gb,
        help="host memory for conversations' KV evicted from the slots (L2, a hard limit; "
        "0 = none): a conversation's next turn restores it instead of recomputing",
    )
    srv.add_argument(
        "--kv-disk-dir",
        default=None,
        help="directory for conversations' KV (L3): written after each turn, so a restart "
        "(even kill -9) keeps conversations warm",
    )
    srv.add_argument(
        "--kv-disk-gb",
        type=float,
        default=EngineConfig.kv_disk_gb,
        help="hard limit of --kv-disk-dir (least recently used out)",
    )
    srv.add_argument(
        "--kv-store",
        default=None,
        metavar="redis://HOST:PORT",
        help="Redis for conversations' KV (L3), shared by every server of the same model",
    )


def kv_cache_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        kv_host_cache_gb=args.kv_host_cache_gb,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gb=args.kv_disk_gb,
        kv_store=args.kv_store,
    )


def _add_model_residency_args(srv: argparse.ArgumentParser) -> None:
    srv.add_argument(
        "--models",
        action="append",
        default=[],
        metavar="NAME=PATH[,NAME=PATH...]",
        help="serve several models, each under its own name (repeatable); the first is the "
        "default and loads at start, the others load on their first call",
    )
    srv.add_argument(
        "--max-resident-bytes",
        default="0",
        metavar="BYTES",
        help="with --models: weights + KV of the loaded models stay under this (e.g. 2G); the "
        "least recently used idle model is unloaded to make room (0 = no limit)",
    )
    srv.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME",
        help="with --models: load this model at start and never unload it (repeatable)",
    )
    srv.add_argument(
        "--keep-alive",
        default="5m",
        help="with --models: unload a model idle this long (Ollama durations: 30s, 5m, 1h; "
        "-1 = never; 0 = when its calls end); a request's `keep_alive` field overrides it",
    )
    srv.add_argument(
        "--model-load-timeout-s",
        type=float,
        default=ServerConfig.model_load_timeout_s,
        help="with --models: a call waits this long for its model to load (then 503)",
    )
    srv.add_argument(
        "--no-preload",
        action="store_true",
        help="with --models: do not load a model ahead of its predicted next call",
    )


def parse_models_arg(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`--models a=/p/a.gguf,b=/p/b` (repeatable) -> ((name, path), ...); a bare path is
    named after its file stem. ValueError on a duplicate or empty name."""
    from pathlib import Path

    models: list[tuple[str, str]] = []
    for value in values:
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, path = item.partition("=")
            if not sep:
                name, path = Path(item).stem, item
            if not name or not path:
                raise ValueError(f"--models: {item!r} is not NAME=PATH")
            if name in dict(models):
                raise ValueError(f"--models: the name {name!r} is given twice")
            models.append((name, path))
    return tuple(models)


def residency_options(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's model-residency fields from the flags (ValueError on bad values)."""
    from ultrafast.server.residency.budget import parse_bytes, parse_keep_alive

    models = parse_models_arg(args.models)
    unknown = [name for name in args.pin if name not in dict(models)]
    if unknown:
        raise ValueError(f"--pin {unknown[0]!r}: not one of the --models names")
    return dict(
        models=models,
        max_resident_bytes=parse_bytes(args.max_resident_bytes),
        pinned_models=tuple(args.pin),
        keep_alive_s=parse_keep_alive(args.keep_alive),
        model_load_timeout_s=args.model_load_timeout_s,
        preload_models=not args.no_preload,
    )


def add_serve_parser(sub: Any) -> None:
    srv = sub.add_parser("serve", help="start the OpenAI-compatible server")
    srv.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="HF model directory or .gguf (default: SmolLM2-135M-Instruct, served as "
        "smollm2-135m-instruct, when `make setup` fetched it; else the bundled demo model)",
    )
    srv.add_argument("--host", default=ServerConfig.host, help="bind address (loopback by default)")
    srv.add_argument("--port", type=int, default=ServerConfig.port)
    srv.add_argument(
        "--served-model-name", default=ServerConfig.served_model_name, help="model id clients send"
    )
    _add_tier_args(srv)
    _add_session_args(srv)
    _add_access_args(srv)
    _add_guard_args(srv)
    _add_model_residency_args(srv)
    add_engine_args(srv)
    _add_kv_cache_args(srv)
    srv.set_defaults(func=cmd_serve)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig the serve flags describe."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        # replace: each tier keeps its own floor and speed factor for an auto TTFT target
        priority=replace(
            ServerConfig.priority,
            ttft_ms=args.priority_ttft_ms,
            itl_ms=args.priority_itl_ms,
            max_in_flight=args.priority_queue,
        ),
        default=replace(
            ServerConfig.default,
            ttft_ms=args.default_ttft_ms,
            itl_ms=args.default_itl_ms,
            max_in_flight=args.default_queue,
        ),
        shaper_window_ms=args.shaper_window_ms,
        drain_timeout_s=args.drain_timeout_s,
        session_store=args.session_store,
        session_ttl_s=args.session_ttl_s,
        max_sessions_per_tenant=args.max_sessions_per_tenant,
        api_keys_path=args.api_keys,
        allowed_hosts=tuple(args.allowed_host),
        guard_patterns=tuple(args.guard_pattern),
        guard_patterns_path=args.guard_patterns,
        guard_hold_back_tokens=args.guard_hold_back_tokens,
        guard_classifier=args.guard_classifier,
        guard_classifier_threshold=args.guard_classifier_threshold,
        alert_priority_itl_p99_ms=args.alert_priority_itl_p99_ms,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        write_stall_timeout_s=args.write_stall_timeout_s,
        max_connections_per_ip=args.max_connections_per_ip,
        max_tool_calls=max(1, args.max_tool_calls),
        **residency_options(args),
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from ultrafast.server.serve import serve

    # without --threads/--batch-threads the engine times passes of several widths at start
    # and picks each width's thread count (executors/ggml_threads.py)
    config = server_config(args)
    if config.models:  # several models: the first is the default, loaded at start
        if args.model_path or args.model:
            raise ValueError("give the models with --models, or one model, not both")
        args.served_model_name, model = config.models[0]
        config = replace(config, served_model_name=args.served_model_name)
    else:
        model, served_name = chosen_model(args.model_path or args.model)
        if args.served_model_name is None:
            config = replace(config, served_model_name=served_name)
    engine = EngineConfig(model=model, **engine_options(args), **kv_cache_options(args))
    return serve(engine, config)
