"""The server's configuration: ServerConfig and each service tier's TierTargets (re-exported
by config.py). Every `serve` flag is declared on the field it sets (config_flags.py), so a
flag, its help, its group and the default it shows are written once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ultrafast.config_flags import Flag, duration_text, flag, flags, parse_models_arg, switch_off

# Defaults that modules outside this file also state: they import these names instead.
SESSION_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days (server/sessions/store.py)
MAX_SESSIONS_PER_TENANT = 10_000  # live sessions one tenant may hold (server/sessions/store.py)
MAX_TOOL_CALLS = 8  # parallel tool calls a turn may make; its grammar ends after (tools/grammar.py)
LOG_LEVELS = ("debug", "info", "warning", "error")


def _tier_flags(tier: str, ttft_help: str, itl_help: str, queue_help: str) -> dict:
    def one(what: str, attr: str, help_text: str, kind: type) -> Flag:
        return Flag(f"--{tier}-{what}", "service tiers", help_text, type=kind, attr=attr)

    return flags(
        one("ttft-ms", "ttft_ms", ttft_help, float),
        one("itl-ms", "itl_ms", itl_help, float),
        one("queue", "max_in_flight", queue_help, int),
    )


@dataclass(frozen=True)
class TierTargets:
    """Latency objectives of one service tier; admission refuses what cannot meet them.

    A TTFT target of 0 is set at start from the model's measured speed (engine/idle_speed.py):
    `ttft_speed_factor` times the idle time to first token of a typical prompt, never below
    `ttft_floor_ms`, so a slower model gets a looser target. A target given explicitly wins.
    """

    ttft_ms: float  # time to first token; 0 = auto (see `resolved`)
    itl_ms: float  # inter-token latency
    max_in_flight: int  # admitted (running + queued) requests of this tier; 0 = auto
    ttft_floor_ms: float = 250.0  # auto TTFT: at least this
    ttft_speed_factor: float = 3.0  # auto TTFT: this many idle TTFTs of a typical prompt

    def __post_init__(self) -> None:
        if self.max_in_flight < 0:
            raise ValueError("max_in_flight must be >= 0 (0 = sized from memory)")
        for name in ("ttft_ms", "itl_ms", "ttft_floor_ms", "ttft_speed_factor"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"tier target {name} must be >= 0, got {getattr(self, name)}")

    @property
    def ttft_auto(self) -> bool:
        return self.ttft_ms == 0

    def resolved(self, idle_ttft_s: float | None) -> TierTargets:
        """The auto TTFT target made concrete from the measured idle TTFT of a typical prompt
        (None: not measured, the floor stands in); an explicit target is kept as it is."""
        if not self.ttft_auto:
            return self
        measured_ms = 0.0 if idle_ttft_s is None else self.ttft_speed_factor * idle_ttft_s * 1000
        return replace(self, ttft_ms=max(self.ttft_floor_ms, measured_ms))


_PRIORITY = TierTargets(
    ttft_ms=0.0, itl_ms=0.0, max_in_flight=8, ttft_floor_ms=250.0, ttft_speed_factor=3.0
)
_SAMPLING = "for requests that leave it out (default: the model's own, else the API's "


def _sampling(name: str, attr: str, kind: type, bounds: tuple[float, float], api: str) -> Flag:
    return Flag(name, "sampling", _SAMPLING + api + ")", type=kind, attr=attr, bounds=bounds)


_DEFAULT = TierTargets(
    ttft_ms=0.0, itl_ms=0.0, max_in_flight=0, ttft_floor_ms=30000.0, ttft_speed_factor=100.0
)


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(  # loopback by default; 0.0.0.0 needs an explicit --host
        default="127.0.0.1",
        metadata=flag(
            "--host",
            "server",
            "bind address; anything but loopback needs --api-keys or --api-key",
            part="listen",
        ),
    )
    port: int = field(
        default=8000, metadata=flag("--port", "server", "TCP port", type=int, part="listen")
    )
    served_model_name: str | None = field(
        default=None,
        metadata=flag(
            "--served-model-name",
            "server",
            "model id clients send (default: the model's directory or file name; "
            "smollm2-135m-instruct for the default model)",
            part="listen",
        ),
    )
    # ttft_ms 0 = auto: from the model's speed measured at start (TierTargets.resolved);
    # itl_ms 0 = auto: 1.2x the measured idle inter-token time
    # default itl_ms 0 = its steps are not sized to a token gap (--default-itl-ms N does):
    # capped, a burst's prefill took more steps and its one-token calls waited 20-35% longer
    # while the 16-stream ITL p99 did not drop (BENCHMARKS.md, "Serving under load")
    # max_in_flight 0 = auto: sized from memory (server/admission.py auto_in_flight); the
    # default and flex tiers are then limited by their predicted wait, not by a count
    priority: TierTargets = field(
        default=_PRIORITY,
        metadata=_tier_flags(
            "priority",
            f"priority tier time-to-first-token target (0 = auto: "
            f"{_PRIORITY.ttft_speed_factor:g}x the idle TTFT of a typical prompt measured at "
            f"start, at least {_PRIORITY.ttft_floor_ms:g} ms); a priority call that the work "
            "queued ahead would make miss it is refused (429)",
            "priority inter-token target; steps carrying priority work are sized "
            "to it (0 = auto: 1.2x the measured idle inter-token time)",
            "priority calls in flight",
        ),
    )
    default: TierTargets = field(
        default=_DEFAULT,
        metadata=_tier_flags(
            "default",
            "default tier time-to-first-token target (0 = auto, from the measured speed)",
            "size steps carrying default-tier decodes to this token gap (0 = off)",
            "default calls in flight (0 = sized from memory; the predicted wait refuses first)",
        ),
    )
    flex: TierTargets = TierTargets(
        ttft_ms=0.0,
        itl_ms=2000.0,
        max_in_flight=0,
        ttft_floor_ms=120000.0,
        ttft_speed_factor=400.0,
    )
    shaper_window_ms: float = field(
        default=2.0,
        metadata=flag(
            "--shaper-window-ms",
            "service tiers",
            "coalesce default-tier arrivals this long (0 = off)",
            type=float,
        ),
    )
    gil_switch_ms: float = field(
        default=0.5,
        metadata=flag(
            "--gil-switch-ms",
            "service tiers",
            "longest a thread running Python keeps the interpreter lock from the event loop"
            " (Python's own default: 5)",
            type=float,
        ),
    )
    drain_timeout_s: float = field(
        default=10.0,
        metadata=flag(
            "--drain-timeout-s",
            "server",
            "on SIGTERM or Ctrl-C, running streams get this long to finish (a second "
            "signal ends them at once)",
            type=float,
        ),
    )
    sse_ping_interval_s: float = 15.0  # keeps proxies from cutting idle streams
    header_timeout_s: float = field(
        default=10.0,
        metadata=flag(
            "--header-timeout-s",
            "limits",
            "close a connection whose request head is not complete in this long "
            "(slowloris; 408 when part of it came; 0 = off)",
            type=float,
        ),
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--body-timeout-s",
            "limits",
            "answer 408 request_timeout when a request body is not complete this "
            "long after its head (a slow body; 0 = off)",
            type=float,
        ),
    )
    # open connections from one client address (0 = no cap): far above a 64-call burst from one
    # client, far below what exhausts the server's file descriptors
    max_connections_per_ip: int = field(
        default=256,
        metadata=flag(
            "--max-connections-per-ip",
            "limits",
            "refuse (429 too_many_connections) a connection beyond this many open "
            "ones from one client address (0 = no cap; behind a proxy all clients "
            "share its address)",
            type=int,
        ),
    )
    write_stall_timeout_s: float = field(
        default=30.0,
        metadata=flag(
            "--write-stall-timeout-s",
            "limits",
            "abort a stream whose client reads nothing for this long, freeing "
            "its KV slot (0 = off)",
            type=float,
        ),
    )
    max_stream_buffer_events: int = 256  # per stream, before undelivered outputs are merged
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_cap: int = 4096  # per-request ceiling on max_tokens
    # output cap of a call that sets no max_tokens (0 = the context left, up to
    # max_tokens_cap): a small model at API defaults may never emit its end token
    default_max_tokens: int = field(
        default=1024,
        metadata=flag(
            "--max-tokens",
            "sampling",
            "output cap of a request that sets no max_tokens / max_completion_tokens / "
            "max_output_tokens (0 = up to the context left)",
            type=int,
            bounds=(0, float("inf")),
        ),
    )
    # what a request leaves out, over the model's own defaults (model_defaults.py): a
    # request's own field wins, then these, then the model's, then the API's
    sampling_defaults: tuple[tuple[str, float], ...] = field(
        default=(),
        metadata=flags(
            _sampling("--temperature", "temperature", float, (0.0, 2.0), "1.0"),
            _sampling("--top-p", "top_p", float, (1e-9, 1.0), "1.0"),
            _sampling("--top-k", "top_k", int, (0, 1 << 30), "0 = off"),
            _sampling("--min-p", "min_p", float, (0.0, 1.0), "0.0"),
            _sampling(
                "--repeat-penalty",
                "repetition_penalty",
                float,
                (1e-9, 10.0),
                "1.0; repetition_penalty",
            ),
        ),
    )
    max_tool_calls: int = field(
        default=MAX_TOOL_CALLS,
        metadata=flag(
            "--max-tool-calls",
            "limits",
            "the most parallel tool calls one turn may make: the grammar ends the turn "
            "after this many (a repetitive model otherwise repeats a call to max_tokens)",
            type=int,
            to_field=lambda n: max(1, n),
        ),
    )
    session_store: str = field(  # "" = default_session_store()
        default="",
        metadata=flag(
            "--session-store",
            "sessions",
            "conversation history: sqlite:///path (default: sessions.db under "
            "the user data dir) or redis://host:port/db",
        ),
    )
    redis_ca_file: str | None = field(  # also the engine's kv_redis_ca_file
        default=None,
        metadata=flag(
            "--redis-ca-file",
            "sessions",
            "CA certificate(s) that verify rediss:// (TLS) servers: the session store, "
            "--kv-store and a cluster's shared limits (default: the system's CAs); "
            "credentials go in the URL: redis://user:password@host:port/db",
            metavar="FILE",
        ),
    )
    session_ttl_s: float = field(
        default=SESSION_TTL_S,
        metadata=flag(
            "--session-ttl-s",
            "sessions",
            "a session expires this long after its last turn",
            type=float,
        ),
    )
    max_sessions_per_tenant: int = field(
        default=MAX_SESSIONS_PER_TENANT,
        metadata=flag(
            "--max-sessions-per-tenant",
            "sessions",
            "stored conversations one tenant may keep (its oldest expire first)",
            type=int,
        ),
    )
    session_commit_grace_s: float = 30.0  # an answer's commit is retried this long (store outage)
    allowed_hosts: tuple[str, ...] = field(  # () = loopback names on loopback
        default=(),
        metadata=flag(
            "--allowed-host",
            "authentication",
            "Host header names to accept (repeatable; default: on loopback "
            "127.0.0.1, localhost, ::1; otherwise any)",
            action="append",
            metavar="NAME",
            to_field=tuple,
        ),
    )
    api_keys_path: str | None = field(  # None = no auth, loopback only
        default=None,
        metadata=flag(
            "--api-keys",
            "authentication",
            "tenants and sha256-hashed keys (YAML/JSON, see deploy/; default: none). "
            "Without it or --api-key there is no auth and the server listens on loopback only",
            metavar="FILE",
        ),
    )
    api_key_hashes: tuple[str, ...] = field(  # sha256 of each --api-key (tenant `api-key`)
        default=(),
        metadata=flag(
            "--api-key",
            "authentication",
            "accept this bearer key, with every tier (repeatable; beside --api-keys or "
            "alone; default: none). Other local users can read it in the process list: "
            "prefer --api-keys on a shared machine",
            action="append",
            metavar="KEY",
            to_field="ultrafast.server.tenants:api_key_hashes",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=flag(
            "--log-level",
            "server",
            "server log verbosity (the access log is at info)",
            choices=LOG_LEVELS,
            part="log",
        ),
    )
    access_log: bool = field(  # one line per request (server/access_log.py)
        default=True,
        metadata=flag(
            "--no-access-log",
            "server",
            "no access-log line per request (method, path, status, tier, prompt and "
            "completion tokens, TTFT, duration)",
            part="log",
            **switch_off(),
        ),
    )
    guard_patterns: tuple[str, ...] = field(  # () = no filter
        default=(),
        metadata=flag(
            "--guard-pattern",
            "output guard",
            "output safety filter: cut a stream matching REGEX (repeatable; default: none)",
            action="append",
            metavar="REGEX",
            to_field=tuple,
        ),
    )
    guard_patterns_path: str | None = field(  # server/guard.py
        default=None,
        metadata=flag(
            "--guard-patterns",
            "output guard",
            'output safety filter patterns, JSON {"patterns": [...]} (default: none)',
            metavar="FILE",
        ),
    )
    guard_hold_back_tokens: int = field(
        default=4,
        metadata=flag(
            "--guard-hold-back-tokens",
            "output guard",
            "tokens withheld after each cleared chunk (>= longest pattern)",
            type=int,
        ),
    )
    guard_classifier: str | None = field(
        default=None,
        metadata=flag(
            "--guard-classifier",
            "output guard",
            "output safety filter: a function text -> score in [0, 1], run off "
            "the event loop; scores >= --guard-classifier-threshold cut the stream "
            "(default: none)",
            metavar="MODULE:FUNCTION",
        ),
    )
    guard_classifier_threshold: float = field(
        default=0.5,
        metadata=flag(
            "--guard-classifier-threshold",
            "output guard",
            "a --guard-classifier score at or above this cuts the stream",
            type=float,
        ),
    )
    # per-token p99 alert threshold for the priority tier; None = 2 ms on GPU, off on CPU
    alert_priority_itl_p99_ms: float | None = field(
        default=None,
        metadata=flag(
            "--alert-priority-itl-p99-ms",
            "service tiers",
            "exported threshold of the priority per-token p99 alert "
            "(default 2 on GPU, off on CPU; 0 = off)",
            type=float,
        ),
    )
    # several models resident by use (server/residency/); () = the one engine model
    models: tuple[tuple[str, str], ...] = field(  # (served name, path); the first is the default
        default=(),
        metadata=flag(
            "--models",
            "several models",
            "serve several models, each under its own name (repeatable); the first is the "
            "default and loads at start, the others load on their first call (default: one "
            "model, the positional one or --model)",
            action="append",
            metavar="NAME=PATH[,NAME=PATH...]",
            to_field=parse_models_arg,
            part="models",
        ),
    )
    max_resident_bytes: int = field(  # weights + KV of loaded models; 0 = no limit
        default=0,
        metadata=flag(
            "--max-resident-bytes",
            "several models",
            "with --models: weights + KV of the loaded models stay under this (e.g. 2G); the "
            "least recently used idle model is unloaded to make room (0 = no limit)",
            metavar="BYTES",
            shown=str,
            to_field="ultrafast.server.residency.budget:parse_bytes",
            part="models",
        ),
    )
    pinned_models: tuple[str, ...] = field(  # loaded at start, never evicted
        default=(),
        metadata=flag(
            "--pin",
            "several models",
            "with --models: load this model at start and never unload it (repeatable; "
            "default: none)",
            action="append",
            metavar="NAME",
            to_field=tuple,
            part="models",
        ),
    )
    keep_alive_s: float | None = field(  # an idle model unloads after this; None = never
        default=300.0,
        metadata=flag(
            "--keep-alive",
            "several models",
            "with --models: unload a model idle this long (Ollama durations: 30s, 5m, 1h; "
            "-1 = never; 0 = when its calls end); a request's `keep_alive` field overrides it",
            shown=duration_text,
            to_field="ultrafast.server.residency.budget:parse_keep_alive",
            part="models",
        ),
    )
    model_load_timeout_s: float = field(
        default=120.0,
        metadata=flag(
            "--model-load-timeout-s",
            "several models",
            "with --models: a call waits this long for its model to load (then 503)",
            type=float,
            part="models",
        ),
    )
    preload_models: bool = field(
        default=True,
        metadata=flag(
            "--no-preload",
            "several models",
            "with --models: do not load a model ahead of its predicted next call",
            part="models",
            **switch_off(),
        ),
    )

    def __post_init__(self) -> None:
        if not self.gil_switch_ms > 0:  # NaN too
            raise ValueError(f"--gil-switch-ms must be > 0, got {self.gil_switch_ms}")

    @property
    def auth_on(self) -> bool:
        return self.api_keys_path is not None or bool(self.api_key_hashes)
