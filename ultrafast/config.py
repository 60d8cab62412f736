"""Configuration: frozen dataclasses, one per concern. The only module that reads os.environ."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo-code"
DEMO_DRAFT_DIR = REPO_ROOT / "models" / "demo-draft"


EXECUTORS = ("auto", "ggml", "torch", "fake")
SPEC_METHODS = ("off", "ngram", "draft", "auto")
SPEC_TIERS = ("priority", "default", "flex")

# Defaults that modules outside this file also state: they import these names instead.
MAX_DRAFT_TOKENS = 8  # bound of the adaptive draft length (engine/speculation.py's SpecConfig too)
SESSION_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days (server/sessions/store.py)
MAX_SESSIONS_PER_TENANT = 10_000  # live sessions one tenant may hold (server/sessions/store.py)
MAX_TOOL_CALLS = 8  # parallel tool calls a turn may make; its grammar ends after (tools/grammar.py)


def cache_dir() -> Path:
    """Where converted GGUF files and other derived artifacts go (ULTRAFAST_CACHE_DIR)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ultrafast"
    return Path(os.environ.get("ULTRAFAST_CACHE_DIR", default))


def data_dir() -> Path:
    """Where durable server state lives (the embedded session store): ULTRAFAST_DATA_DIR."""
    default = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "ultrafast"
    return Path(os.environ.get("ULTRAFAST_DATA_DIR", default))


def default_session_store() -> str:
    return f"sqlite:///{data_dir() / 'sessions.db'}"


# The real chat model `ultrafast serve` runs by default: the setup fetches it (model_fetch.py)
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SERVED_NAME = "smollm2-135m-instruct"


def smollm2_gguf() -> Path:
    """Where the setup puts SmolLM2 (ULTRAFAST_SMOLLM2_GGUF overrides, as in the tests)."""
    env = os.environ.get("ULTRAFAST_SMOLLM2_GGUF")
    return Path(env) if env else cache_dir() / "models" / SMOLLM2_GGUF_NAME


@dataclass(frozen=True)
class DefaultModel:
    """The model used when none is given, its served name, and why it is not SmolLM2."""

    path: str
    served_name: str | None  # None: the file or directory name
    fallback_notice: str | None = None  # set when SmolLM2 is missing and demo-code serves


def default_model_choice() -> DefaultModel:
    """$ULTRAFAST_MODEL, else SmolLM2 when the setup fetched it, else the bundled demo model."""
    env = os.environ.get("ULTRAFAST_MODEL")
    if env:
        return DefaultModel(env, None)
    gguf = smollm2_gguf()
    if gguf.is_file():
        return DefaultModel(str(gguf), SMOLLM2_SERVED_NAME)
    notice = (
        f"SmolLM2-135M-Instruct is not at {gguf} (`make setup` fetches it): "
        f"serving the bundled demo model demo-code instead"
    )
    return DefaultModel(str(DEMO_MODEL_DIR), None, notice)


def default_model() -> str:
    return default_model_choice().path


def benchmark_model() -> str:
    """The benchmarks' model without --model: $ULTRAFAST_MODEL, else the demo model their
    recorded figures are on (the default chat model would change what they compare)."""
    return os.environ.get("ULTRAFAST_MODEL", str(DEMO_MODEL_DIR))


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF model directory, or a .gguf file (its metadata holds the tokenizer)
    executor: str = "auto"  # auto (ggml on CPU, torch on CUDA), ggml, torch, fake (tests only)
    # KV slots: concurrent sequences plus cached prefixes. 0 = sized from free memory and the
    # model's KV bytes per slot (model/kv_budget.py auto_num_slots)
    num_slots: int = 0
    max_model_len: int = 2048  # positions per slot (capped by the model's own limit)
    max_num_seqs: int = 0  # running at once; 0 = every slot
    max_num_batched_tokens: int = 512  # token budget per step
    max_prefill_chunk_tokens: int = 256  # chunked prefill size
    # queued requests over all tiers: a waiting request holds only its token ids, so this is a
    # memory bound, not a latency one (admission refuses on predicted wait first)
    max_waiting: int = 4096
    # shortest first within the default and flex tiers: a request goes ahead of longer ones
    # that arrived at most this much earlier (SchedulerConfig.short_first_window_s); 0 = FIFO
    short_first_window_s: float = 2.0
    n_threads: int | None = None  # kernel threads, ggml or torch on CPU (default: every core)
    n_threads_batch: int | None = None  # ggml threads for multi-token passes (default n_threads)
    device: str | None = None  # torch executor: cpu / cuda
    dtype: str | None = None  # torch executor: float32 / float16 / bfloat16
    compile: str = "auto"  # torch executor decode steps: auto (on with CUDA), inductor, graphs, off
    # type an HF directory converts to for the ggml executor; auto: ultrafast/weight_format.py
    gguf_type: str = "auto"
    # `--chat-template`: a built-in name (chat_templates.py) or a Jinja file; None: the model's
    chat_template: str | None = None
    # ggml executor: llama.cpp's fused CPU attention (faster decode, wide batches and prefill
    # on SmolLM2 here: BENCHMARKS.md "Flash attention"); False: the plain attention ops
    flash_attn: bool = True
    # ggml executor: long prefill chunks' KV computed by a bf16 PyTorch/oneDNN pass (the CPU's
    # matrix units); auto = where measured faster at start (executors/wide_route.py), on, off
    wide_pass: str = "auto"
    fake_step_s: float = 0.02  # executor "fake" (load/fault tests only): time per engine step
    # speculative decoding: off, ngram (prompt lookup), draft (model), auto (ngram, else the
    # draft model when one fits the tokenizer). A request's `prediction` is used in any tier.
    spec: str = "auto"
    spec_tiers: tuple[str, ...] = ("priority",)  # tiers that draft (flex never by default)
    draft_model: str | None = None  # HF dir or .gguf; None = the bundled demo draft if it fits
    max_draft_tokens: int = MAX_DRAFT_TOKENS
    # size k from this machine's measured step costs; False: the fixed defaults (tests)
    spec_measured_costs: bool = True
    # the tiered KV cache under the slots (kvcache/): L2 host memory, L3 disk and/or Redis
    kv_host_cache_gb: float = 0.0  # 0 = none (a small staging area when an L3 tier is set)
    kv_disk_dir: str | None = None
    kv_disk_gb: float = 10.0  # hard limit of the disk tier
    kv_store: str | None = None  # redis://host:port[/db]: conversations' KV shared by replicas
    kv_redis_ca_file: str | None = None  # verifies a rediss:// kv_store (--redis-ca-file)
    kv_secret_file: str | None = None  # signs KV blobs (kvcache/secret.py); None: the data dir's

    def __post_init__(self) -> None:
        if self.short_first_window_s < 0:
            raise ValueError("short_first_window_s must be >= 0")
        if self.kv_host_cache_gb < 0 or self.kv_disk_gb <= 0:
            raise ValueError("kv_host_cache_gb must be >= 0 and kv_disk_gb > 0")
        if self.kv_store and not self.kv_store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("kv_store must be a redis://, rediss:// or unix:// URL")
        if self.wide_pass not in ("auto", "on", "off"):
            raise ValueError("wide_pass must be one of auto, on, off")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}")
        if self.spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {', '.join(SPEC_METHODS)}")
        bad = set(self.spec_tiers) - set(SPEC_TIERS)
        if bad:
            raise ValueError(f"unknown spec tier(s) {sorted(bad)}: use {', '.join(SPEC_TIERS)}")
        if not 1 <= self.max_draft_tokens <= 32:
            raise ValueError("max_draft_tokens must be in [1, 32]")
        if self.num_slots < 0 or self.max_num_seqs < 0:
            raise ValueError("num_slots and max_num_seqs must be >= 0 (0 = auto)")
        if self.num_slots and self.max_num_seqs > self.num_slots:
            raise ValueError("max_num_seqs cannot exceed num_slots")


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


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 needs an explicit --host
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory name
    # ttft_ms 0 = auto: from the model's speed measured at start (TierTargets.resolved);
    # itl_ms 0 = auto: 1.2x the measured idle inter-token time
    # default itl_ms 0 = its steps are not sized to a token gap (--default-itl-ms N does):
    # capped, a burst's prefill took more steps and its one-token calls waited 20-35% longer
    # while the 16-stream ITL p99 did not drop (BENCHMARKS.md, "Serving under load")
    # max_in_flight 0 = auto: sized from memory (server/admission.py auto_in_flight); the
    # default and flex tiers are then limited by their predicted wait, not by a count
    priority: TierTargets = TierTargets(
        ttft_ms=0.0, itl_ms=0.0, max_in_flight=8, ttft_floor_ms=250.0, ttft_speed_factor=3.0
    )
    default: TierTargets = TierTargets(
        ttft_ms=0.0, itl_ms=0.0, max_in_flight=0, ttft_floor_ms=30000.0, ttft_speed_factor=100.0
    )
    flex: TierTargets = TierTargets(
        ttft_ms=0.0,
        itl_ms=2000.0,
        max_in_flight=0,
        ttft_floor_ms=120000.0,
        ttft_speed_factor=400.0,
    )
    shaper_window_ms: float = 2.0  # default-tier arrivals coalesce this long; 0 = off
    drain_timeout_s: float = 10.0  # SIGTERM: running streams get this long to finish
    sse_ping_interval_s: float = 15.0  # keeps proxies from cutting idle streams
    header_timeout_s: float = 10.0  # a request head must arrive this fast (slowloris); 0 = off
    body_timeout_s: float = 30.0  # and its body this long after the head; 0 = off
    # open connections from one client address (0 = no cap): far above a 64-call burst from one
    # client, far below what exhausts the server's file descriptors
    max_connections_per_ip: int = 256
    write_stall_timeout_s: float = 30.0  # a client reading nothing this long is cut; 0 = off
    max_stream_buffer_events: int = 256  # per stream, before undelivered outputs are merged
    max_body_bytes: int = 4 * 1024 * 1024
    max_tokens_cap: int = 4096  # per-request ceiling on max_tokens
    # output cap of a call that sets no max_tokens (`--max-tokens`; 0 = the context left, up
    # to max_tokens_cap): a small model at API defaults may never emit its end token
    default_max_tokens: int = 1024
    # `--temperature`, `--top-p`, ...: what a request leaves out, over the model's own defaults
    sampling_defaults: tuple[tuple[str, float], ...] = ()
    max_tool_calls: int = MAX_TOOL_CALLS
    session_store: str = ""  # sqlite:///path or redis://host:port/db; "" = default_session_store()
    redis_ca_file: str | None = None  # verifies rediss:// servers (session store, shared limits)
    session_ttl_s: float = SESSION_TTL_S  # a session expires this long after its last write
    max_sessions_per_tenant: int = MAX_SESSIONS_PER_TENANT
    session_commit_grace_s: float = 30.0  # an answer's commit is retried this long (store outage)
    allowed_hosts: tuple[str, ...] = ()  # Host header names; () = loopback names on loopback
    api_keys_path: str | None = None  # tenants + sha256 keys; None = no auth, loopback only
    api_key_hashes: tuple[str, ...] = ()  # sha256 of each --api-key (tenant `api-key`)
    log_level: str = "info"  # debug, info, warning, error
    access_log: bool = True  # one line per request (server/access_log.py)
    guard_patterns: tuple[str, ...] = ()  # output safety filter regexes; () = no filter
    guard_patterns_path: str | None = None  # JSON file of patterns (server/guard.py)
    guard_hold_back_tokens: int = 4  # tokens withheld after a chunk is cleared
    guard_classifier: str | None = None  # module:function scoring text in [0, 1]
    guard_classifier_threshold: float = 0.5
    # per-token p99 alert threshold for the priority tier; None = 2 ms on GPU, off on CPU
    alert_priority_itl_p99_ms: float | None = None
    # several models resident by use (server/residency/); () = the one engine model
    models: tuple[tuple[str, str], ...] = ()  # (served name, path); the first is the default
    max_resident_bytes: int = 0  # weights + KV of loaded models; 0 = no limit
    pinned_models: tuple[str, ...] = ()  # loaded at start, never evicted
    keep_alive_s: float | None = 300.0  # an idle model unloads after this; None = never
    model_load_timeout_s: float = 120.0  # a call waits this long for its model's load
    preload_models: bool = True  # load a model ahead of its predicted next call

    @property
    def auth_on(self) -> bool:
        return self.api_keys_path is not None or bool(self.api_key_hashes)
