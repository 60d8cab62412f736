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

from ultrafast.cli_help import LOG_LEVELS, SERVE_GROUPS, HelpFormatter, group
from ultrafast.config import EXECUTORS, SPEC_METHODS, EngineConfig, ServerConfig
from ultrafast.server.tenants import api_key_hashes
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
    model, engine = group(p, "model"), group(p, "engine")
    kv, spec = group(p, "KV cache"), group(p, "speculative decoding")
    model.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: $ULTRAFAST_MODEL, else "
        "SmolLM2-135M-Instruct as fetched by `make setup`, else the bundled demo model)",
    )
    engine.add_argument(
        "--executor",
        choices=EXECUTORS,
        default=EngineConfig.executor,
        help="auto = ggml (llama.cpp kernels) on CPU, torch on CUDA; fake = no model, "
        "deterministic word tokens (load and fault tests only)",
    )
    engine.add_argument(
        "--fake-step-ms",
        type=float,
        default=1000 * EngineConfig.fake_step_s,
        help=argparse.SUPPRESS,
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"positions per KV slot, prompt and answer together (default: "
        f"{EngineConfig.max_model_len}, or the model's context when smaller; more than the "
        "model's context is an error)",
    )
    kv.add_argument(
        "--num-slots",
        type=int,
        default=EngineConfig.num_slots,
        help="KV slots (concurrent sequences and cached prefixes); 0 = sized from free memory",
    )
    engine.add_argument(
        "--threads",
        type=int,
        default=None,
        help="kernel threads: ggml's, or torch's on CPU (default: all cores; serve with ggml: "
        "timed at start for each pass width, all cores or all but one)",
    )
    engine.add_argument(
        "--batch-threads",
        type=int,
        default=None,
        help="ggml threads for passes of more than one token: prefill chunks, draft "
        "verification, several streams' decodes (default: --threads)",
    )
    engine.add_argument(
        "--short-first-window-ms",
        type=float,
        default=EngineConfig.short_first_window_s * 1000,
        help="default/flex requests expected to finish sooner go ahead of longer ones that "
        "arrived up to this long before them (0: first come, first served)",
    )
    model.add_argument(
        "--gguf-type",
        choices=[AUTO, *OUT_TYPES],
        default=EngineConfig.gguf_type,
        help="weight type an HF directory converts to for the ggml executor: auto = bf16 "
        "where the CPU has AVX-512 BF16, else f16; q8_0 = half of f16's bytes",
    )
    engine.add_argument(
        "--flash-attn",
        choices=["on", "off"],
        default="on" if EngineConfig.flash_attn else "off",
        help="ggml executor: llama.cpp's fused CPU attention (default on: faster decode, "
        "batches and prefill on SmolLM2 here); off: the plain attention ops",
    )
    engine.add_argument(
        "--wide-pass",
        choices=["auto", "on", "off"],
        default=EngineConfig.wide_pass,
        help="ggml executor: long prefill chunks through a bf16 PyTorch (oneDNN) pass on the "
        "CPU's matrix units; auto = where it measures faster at start, on, off",
    )
    add_compile_arg(engine)
    _add_spec_args(spec)


def _add_spec_args(spec: Any) -> None:
    spec.add_argument(
        "--spec",
        choices=SPEC_METHODS,
        default=EngineConfig.spec,
        help="speculative decoding: n-gram prompt lookup, a draft model, or auto "
        "(n-gram, else the draft model); a request's `prediction` is always used",
    )
    spec.add_argument(
        "--spec-tiers",
        default=",".join(EngineConfig.spec_tiers),
        help="comma-separated tiers that draft (priority, default, flex)",
    )
    spec.add_argument(
        "--draft-model",
        default=None,
        help="draft model (HF dir or .gguf, same tokenizer; default: the bundled "
        "demo draft when it fits the model)",
    )
    spec.add_argument(
        "--max-draft-tokens",
        type=int,
        default=EngineConfig.max_draft_tokens,
        help="upper bound of the adaptive number of draft tokens per step",
    )
    spec.add_argument(
        "--spec-costs",
        choices=["measured", "fixed"],
        default="measured",
        help="step costs that size the number of draft tokens: measured on this machine "
        "(default), or fixed defaults, so the drafts do not depend on the machine's load "
        "(reproducible runs, tests)",
    )


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


def check_max_model_len(model: str, max_model_len: int | None) -> None:
    """An explicit --max-model-len the model cannot hold is an error that says what fits (the
    default is capped at the model's context instead). Reads only the model's metadata."""
    if max_model_len is None:
        return
    if max_model_len < 1:
        raise ValueError(f"--max-model-len {max_model_len}: give a number of positions >= 1")
    from ultrafast.model_files import resolve_model

    files = resolve_model(model)
    declared = files.max_position_embeddings
    if declared and max_model_len > declared:
        raise ValueError(
            f"--max-model-len {max_model_len:,} does not fit {files.name}: its context is "
            f"{declared:,} positions; give --max-model-len {declared} or less (without the "
            f"flag: {min(declared, EngineConfig.max_model_len)})"
        )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig's keyword arguments (all but the model) from the engine flags."""
    tiers = tuple(t.strip() for t in args.spec_tiers.split(",") if t.strip())
    return dict(
        executor=args.executor,
        max_model_len=args.max_model_len or EngineConfig.max_model_len,  # None: the default
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
        wide_pass=args.wide_pass,
        compile=args.compile,
        gguf_type=args.gguf_type,
        chat_template=getattr(args, "chat_template", None),  # serve, chat, cluster
    )


def add_generate_parser(sub: Any) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt, streamed to stdout",
        formatter_class=HelpFormatter,
    )
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
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
    check_max_model_len(model, args.max_model_len)
    print(
        "ultrafast: generate continues the prompt as raw text (no chat template); "
        "`ultrafast chat` chats with the model",
        file=sys.stderr,
    )
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
    tiers, server = group(srv, "service tiers"), group(srv, "server")
    priority, default = ServerConfig.priority, ServerConfig.default
    tiers.add_argument(
        "--priority-ttft-ms",
        type=float,
        default=priority.ttft_ms,
        help=f"priority tier time-to-first-token target (0 = auto: "
        f"{priority.ttft_speed_factor:g}x the idle TTFT of a typical prompt measured at start, "
        f"at least {priority.ttft_floor_ms:g} ms); a priority call that the work queued ahead "
        "would make miss it is refused (429)",
    )
    tiers.add_argument(
        "--priority-itl-ms",
        type=float,
        default=priority.itl_ms,
        help="priority inter-token target; steps carrying priority work are sized "
        "to it (0 = auto: 1.2x the measured idle inter-token time)",
    )
    tiers.add_argument(
        "--priority-queue",
        type=int,
        default=priority.max_in_flight,
        help="priority calls in flight",
    )
    tiers.add_argument(
        "--default-ttft-ms",
        type=float,
        default=default.ttft_ms,
        help="default tier time-to-first-token target (0 = auto, from the measured speed)",
    )
    tiers.add_argument(
        "--default-itl-ms",
        type=float,
        default=default.itl_ms,
        help="size steps carrying default-tier decodes to this token gap (0 = off)",
    )
    tiers.add_argument(
        "--default-queue",
        type=int,
        default=default.max_in_flight,
        help="default calls in flight (0 = sized from memory; the predicted wait refuses first)",
    )
    tiers.add_argument(
        "--shaper-window-ms",
        type=float,
        default=ServerConfig.shaper_window_ms,
        help="coalesce default-tier arrivals this long (0 = off)",
    )
    server.add_argument(
        "--drain-timeout-s",
        type=float,
        default=ServerConfig.drain_timeout_s,
        help="on SIGTERM or Ctrl-C, running streams get this long to finish (a second "
        "signal ends them at once)",
    )
    tiers.add_argument(
        "--alert-priority-itl-p99-ms",
        type=float,
        default=ServerConfig.alert_priority_itl_p99_ms,
        help="exported threshold of the priority per-token p99 alert "
        "(default 2 on GPU, off on CPU; 0 = off)",
    )


def _add_sampling_args(srv: Any) -> None:
    """Server-wide defaults for what a request leaves out (as llama-server's flags): a request's
    own field wins, then these, then the model's defaults, then the API's (model_defaults.py)."""
    what = "for requests that leave it out (default: the model's own, else the API's "
    srv.add_argument("--temperature", type=float, default=None, help=what + "1.0)")
    srv.add_argument("--top-p", type=float, default=None, help=what + "1.0)")
    srv.add_argument("--top-k", type=int, default=None, help=what + "0 = off)")
    srv.add_argument("--min-p", type=float, default=None, help=what + "0.0)")
    srv.add_argument(
        "--repeat-penalty", type=float, default=None, help=what + "1.0; repetition_penalty)"
    )
    srv.add_argument(
        "--max-tokens",
        type=int,
        default=ServerConfig.default_max_tokens,
        help="output cap of a request that sets no max_tokens / max_completion_tokens / "
        "max_output_tokens (0 = up to the context left)",
    )


def sampling_flag_defaults(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """ServerConfig.sampling_defaults from the flags given (ValueError on a bad range)."""
    ranges = {
        "temperature": (args.temperature, 0.0, 2.0),
        "top_p": (args.top_p, 1e-9, 1.0),
        "top_k": (args.top_k, 0, 1 << 30),
        "min_p": (args.min_p, 0.0, 1.0),
        "repetition_penalty": (args.repeat_penalty, 1e-9, 10.0),
    }
    flag = {"repetition_penalty": "repeat-penalty"}
    out = []
    for name, (value, low, high) in ranges.items():
        if value is None:
            continue
        if not low <= value <= high:
            raise ValueError(f"--{flag.get(name, name.replace('_', '-'))} {value} is out of range")
        out.append((name, value))
    if args.max_tokens < 0:
        raise ValueError("--max-tokens must be >= 0 (0 = up to the context left)")
    return tuple(out)


def add_chat_template_arg(p: Any) -> None:
    from ultrafast.chat_templates import builtin_names

    p.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help=f"chat template over the model's own: a built-in ({builtin_names()}) or a "
        "Jinja file; needed for a model without one (a base model's GGUF) (default: the "
        "model's own template)",
    )


def _add_session_args(srv: argparse.ArgumentParser) -> None:
    sessions = group(srv, "sessions")
    sessions.add_argument(
        "--session-store",
        default=ServerConfig.session_store,
        help="conversation history: sqlite:///path (default: sessions.db under "
        "the user data dir) or redis://host:port/db",
    )
    sessions.add_argument(
        "--redis-ca-file",
        default=None,
        metavar="FILE",
        help="CA certificate(s) that verify rediss:// (TLS) servers: the session store, "
        "--kv-store and a cluster's shared limits (default: the system's CAs); "
        "credentials go in the URL: redis://user:password@host:port/db",
    )
    sessions.add_argument(
        "--session-ttl-s",
        type=float,
        default=ServerConfig.session_ttl_s,
        help="a session expires this long after its last turn",
    )
    sessions.add_argument(
        "--max-sessions-per-tenant",
        type=int,
        default=ServerConfig.max_sessions_per_tenant,
        help="stored conversations one tenant may keep (its oldest expire first)",
    )


def _add_access_args(srv: argparse.ArgumentParser) -> None:
    access, limits = group(srv, "authentication"), group(srv, "limits")
    access.add_argument(
        "--api-keys",
        default=ServerConfig.api_keys_path,
        metavar="FILE",
        help="tenants and sha256-hashed keys (YAML/JSON, see deploy/; default: none). "
        "Without it or --api-key there is no auth and the server listens on loopback only",
    )
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accept this bearer key, with every tier (repeatable; beside --api-keys or "
        "alone; default: none). Other local users can read it in the process list: "
        "prefer --api-keys on a shared machine",
    )
    access.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="Host header names to accept (repeatable; default: on loopback "
        "127.0.0.1, localhost, ::1; otherwise any)",
    )
    limits.add_argument(
        "--header-timeout-s",
        type=float,
        default=ServerConfig.header_timeout_s,
        help="close a connection whose request head is not complete in this long "
        "(slowloris; 408 when part of it came; 0 = off)",
    )
    limits.add_argument(
        "--body-timeout-s",
        type=float,
        default=ServerConfig.body_timeout_s,
        help="answer 408 request_timeout when a request body is not complete this "
        "long after its head (a slow body; 0 = off)",
    )
    limits.add_argument(
        "--max-connections-per-ip",
        type=int,
        default=ServerConfig.max_connections_per_ip,
        help="refuse (429 too_many_connections) a connection beyond this many open "
        "ones from one client address (0 = no cap; behind a proxy all clients "
        "share its address)",
    )
    limits.add_argument(
        "--write-stall-timeout-s",
        type=float,
        default=ServerConfig.write_stall_timeout_s,
        help="abort a stream whose client reads nothing for this long, freeing "
        "its KV slot (0 = off)",
    )
    limits.add_argument(
        "--max-tool-calls",
        type=int,
        default=ServerConfig.max_tool_calls,
        help="the most parallel tool calls one turn may make: the grammar ends the turn "
        "after this many (a repetitive model otherwise repeats a call to max_tokens)",
    )


def _add_guard_args(srv: argparse.ArgumentParser) -> None:
    guard = group(srv, "output guard")
    guard.add_argument(
        "--guard-pattern",
        action="append",
        default=[],
        metavar="REGEX",
        help="output safety filter: cut a stream matching REGEX (repeatable; default: none)",
    )
    guard.add_argument(
        "--guard-patterns",
        default=ServerConfig.guard_patterns_path,
        metavar="FILE",
        help='output safety filter patterns, JSON {"patterns": [...]} (default: none)',
    )
    guard.add_argument(
        "--guard-classifier",
        default=ServerConfig.guard_classifier,
        metavar="MODULE:FUNCTION",
        help="output safety filter: a function text -> score in [0, 1], run off "
        "the event loop; scores >= --guard-classifier-threshold cut the stream "
        "(default: none)",
    )
    guard.add_argument(
        "--guard-classifier-threshold",
        type=float,
        default=ServerConfig.guard_classifier_threshold,
        help="a --guard-classifier score at or above this cuts the stream",
    )
    guard.add_argument(
        "--guard-hold-back-tokens",
        type=int,
        default=ServerConfig.guard_hold_back_tokens,
        help="tokens withheld after each cleared chunk (>= longest pattern)",
    )


def _add_kv_cache_args(srv: argparse.ArgumentParser) -> None:
    kv = group(srv, "KV cache")
    kv.add_argument(
        "--kv-host-cache-gb",
        type=float,
        default=EngineConfig.kv_host_cache_gb,
        help="host memory for conversations' KV evicted from the slots (L2, a hard limit; "
        "0 = none): a conversation's next turn restores it instead of recomputing",
    )
    kv.add_argument(
        "--kv-disk-dir",
        default=None,
        help="directory for conversations' KV (L3): written after each turn, so a restart "
        "(even kill -9) keeps conversations warm (default: none)",
    )
    kv.add_argument(
        "--kv-disk-gb",
        type=float,
        default=EngineConfig.kv_disk_gb,
        help="hard limit of --kv-disk-dir (least recently used out)",
    )
    kv.add_argument(
        "--kv-store",
        default=None,
        metavar="redis://HOST:PORT",
        help="Redis for conversations' KV (L3), shared by every server of the same model "
        "(default: none)",
    )
    kv.add_argument(
        "--kv-secret-file",
        default=None,
        metavar="FILE",
        help="the secret that signs KV blobs (HMAC-SHA256; created 0600 on first start; "
        "default: kv-secret in the data dir): replicas sharing KV must share this file",
    )


def kv_cache_options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        kv_host_cache_gb=args.kv_host_cache_gb,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gb=args.kv_disk_gb,
        kv_store=args.kv_store,
        kv_secret_file=args.kv_secret_file,
        kv_redis_ca_file=args.redis_ca_file,
    )


def _add_model_residency_args(srv: argparse.ArgumentParser) -> None:
    models = group(srv, "several models")
    models.add_argument(
        "--models",
        action="append",
        default=[],
        metavar="NAME=PATH[,NAME=PATH...]",
        help="serve several models, each under its own name (repeatable); the first is the "
        "default and loads at start, the others load on their first call (default: one "
        "model, the positional one or --model)",
    )
    models.add_argument(
        "--max-resident-bytes",
        default="0",
        metavar="BYTES",
        help="with --models: weights + KV of the loaded models stay under this (e.g. 2G); the "
        "least recently used idle model is unloaded to make room (0 = no limit)",
    )
    models.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME",
        help="with --models: load this model at start and never unload it (repeatable; "
        "default: none)",
    )
    models.add_argument(
        "--keep-alive",
        default="5m",
        help="with --models: unload a model idle this long (Ollama durations: 30s, 5m, 1h; "
        "-1 = never; 0 = when its calls end); a request's `keep_alive` field overrides it",
    )
    models.add_argument(
        "--model-load-timeout-s",
        type=float,
        default=ServerConfig.model_load_timeout_s,
        help="with --models: a call waits this long for its model to load (then 503)",
    )
    models.add_argument(
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
    srv = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Serve a model over the OpenAI API (chat completions, completions, "
        "Responses, Conversations, Realtime), with a browser playground at /.",
        formatter_class=HelpFormatter,
    )
    srv.add_argument(
        "model_path",
        nargs="?",
        default=None,
        help="HF model directory or .gguf (default: SmolLM2-135M-Instruct, served as "
        "smollm2-135m-instruct, when `make setup` fetched it; else the bundled demo model)",
    )
    for title in SERVE_GROUPS:  # the order --help shows them in
        group(srv, title)
    _add_server_args(group(srv, "server"))
    add_chat_template_arg(group(srv, "model"))
    _add_sampling_args(group(srv, "sampling"))
    _add_tier_args(srv)
    _add_session_args(srv)
    _add_access_args(srv)
    _add_guard_args(srv)
    _add_model_residency_args(srv)
    add_engine_args(srv)
    _add_kv_cache_args(srv)
    srv.set_defaults(func=cmd_serve)


def _add_server_args(server: Any) -> None:
    server.add_argument(
        "--host",
        default=ServerConfig.host,
        help="bind address; anything but loopback needs --api-keys or --api-key",
    )
    server.add_argument("--port", type=int, default=ServerConfig.port, help="TCP port")
    server.add_argument(
        "--served-model-name",
        default=ServerConfig.served_model_name,
        help="model id clients send (default: the model's directory or file name; "
        "smollm2-135m-instruct for the default model)",
    )
    server.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=ServerConfig.log_level,
        help="server log verbosity (the access log is at info)",
    )
    server.add_argument(
        "--no-access-log",
        action="store_true",
        help="no access-log line per request (method, path, status, tier, prompt and "
        "completion tokens, TTFT, duration)",
    )


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
        redis_ca_file=args.redis_ca_file,
        session_ttl_s=args.session_ttl_s,
        max_sessions_per_tenant=args.max_sessions_per_tenant,
        api_keys_path=args.api_keys,
        api_key_hashes=api_key_hashes(args.api_key),
        log_level=args.log_level,
        access_log=not args.no_access_log,
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
        default_max_tokens=args.max_tokens,
        sampling_defaults=sampling_flag_defaults(args),
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
    check_max_model_len(model, args.max_model_len)
    if args.chat_template:  # a bad name or file fails here, before the model loads
        from ultrafast.chat_templates import resolve_chat_template

        resolve_chat_template(args.chat_template)
    engine = EngineConfig(model=model, **engine_options(args), **kv_cache_options(args))
    return serve(engine, config)
