"""Configuration: frozen dataclasses, one per concern, each flag declared on its field
(config_flags.py). Reads the environment's locations: cache and data dirs, the default model."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ultrafast import server_config as _server
from ultrafast.config_flags import flag, on_off, reads, scaled
from ultrafast.weight_format import AUTO, OUT_TYPES

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODEL_DIR = REPO_ROOT / "models" / "demo-code"
DEMO_DRAFT_DIR = REPO_ROOT / "models" / "demo-draft"


EXECUTORS = ("auto", "ggml", "torch", "fake")
SPECULATION_METHODS = ("off", "ngram", "draft", "auto")
SPECULATION_TIERS = ("priority", "default", "flex")

COMPILE_MODES = ("auto", "inductor", "graphs", "off")

# ServerConfig and its tiers' TierTargets are declared in server_config.py, imported from here
ServerConfig = _server.ServerConfig
TierTargets = _server.TierTargets

# Defaults that modules outside this file also state: they import these names instead.
SESSION_TTL_S = _server.SESSION_TTL_S
MAX_SESSIONS_PER_TENANT = _server.MAX_SESSIONS_PER_TENANT
MAX_TOOL_CALLS = _server.MAX_TOOL_CALLS
MAX_DRAFT_TOKENS = 8  # bound of the adaptive draft length (engine/speculation.py's too)


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


def _chat_template_help() -> str:
    from ultrafast.chat_templates import builtin_names

    return (
        f"chat template over the model's own: a built-in ({builtin_names()}) or a "
        "Jinja file; needed for a model without one (a base model's GGUF) (default: the "
        "model's own template)"
    )


@dataclass(frozen=True)
class EngineConfig:
    """The engine's configuration. Fields with a flag are options of `generate`, `chat`,
    `serve` and `cluster` (parts: "main" all four; "chat_template" not generate; "kv" the
    KV tiers, serve and cluster); config_flags.py makes the parser from them."""

    model: str = field(  # HF model directory, or a .gguf file (its metadata holds the tokenizer)
        metadata=flag(
            "--model",
            "model",
            "HF model directory or .gguf file (default: $ULTRAFAST_MODEL, else "
            "SmolLM2-135M-Instruct as fetched by `make setup`, else the bundled demo model)",
            default=None,
        )
    )
    executor: str = field(
        default="auto",
        metadata=flag(
            "--executor",
            "engine",
            "auto = ggml (llama.cpp kernels) on CPU, torch on CUDA; fake = no model, "
            "deterministic word tokens (load and fault tests only)",
            choices=EXECUTORS,
        ),
    )
    # KV slots: concurrent sequences plus cached prefixes. 0 = sized from free memory and the
    # model's KV bytes per slot (model/kv_budget.py auto_num_slots)
    num_slots: int = field(
        default=0,
        metadata=flag(
            "--num-slots",
            "KV cache",
            "KV slots (concurrent sequences and cached prefixes); 0 = sized from free memory",
            type=int,
        ),
    )
    max_model_len: int = field(  # positions per slot (capped by the model's own limit)
        default=2048,
        metadata=flag(
            "--max-model-len",
            "model",
            "positions per KV slot, prompt and answer together (default: 2048, or the model's "
            "context when smaller; more than the model's context is an error)",
            type=int,
            default=None,  # None: the field's default, capped (an explicit value is checked)
        ),
    )
    # sequences running at once (the scheduler's cap), at most num_slots; 0 = every slot.
    # Without --max-num-seqs, `--num-slots N` sets it to N too: every slot may run (a slot not
    # running holds a cached prefix)
    max_num_seqs: int = field(
        default=0,
        metadata={
            **flag(
                "--max-num-seqs",
                "KV cache",
                "sequences running at once, at most --num-slots; the other slots keep cached "
                "prefixes (default: every slot, as 0 does)",
                type=int,
                default=None,
            ),
            **reads("num_slots"),
        },
    )
    max_num_batched_tokens: int = field(  # token budget per step
        default=1024,
        metadata=flag(
            "--max-num-batched-tokens",
            "engine",
            "tokens one step may hold, prompt chunks and decodes together (default 1024); a "
            "larger budget prefills long prompts in fewer, wider passes, a smaller one keeps "
            "running streams' token gaps short",
            type=int,
            bounds=(16, 16384),
        ),
    )
    # chunked prefill size, 0 = the whole budget: concurrent long prompts then finish their
    # prefill one after another (first come, first served) instead of in lockstep pairs
    max_prefill_chunk_tokens: int = 0
    # queued requests over all tiers: a waiting request holds only its token ids, so this is a
    # memory bound, not a latency one (admission refuses on predicted wait first)
    max_waiting: int = 4096
    # shortest first within the default and flex tiers: a request goes ahead of longer ones
    # that arrived at most this much earlier (SchedulerConfig.short_first_window_s); 0 = FIFO
    short_first_window_s: float = field(
        default=2.0,
        metadata=flag(
            "--short-first-window-ms",
            "engine",
            "default/flex requests expected to finish sooner go ahead of longer ones that "
            "arrived up to this long before them (0: first come, first served)",
            type=float,
            **scaled(1000),
        ),
    )
    n_threads: int | None = field(  # kernel threads, ggml or torch on CPU (default: every core)
        default=None,
        metadata=flag(
            "--threads",
            "engine",
            "kernel threads: ggml's, or torch's on CPU (default: all cores; serve with ggml: "
            "timed at start for each pass width, all cores or all but one)",
            type=int,
        ),
    )
    n_threads_batch: int | None = field(  # ggml threads for multi-token passes
        default=None,
        metadata=flag(
            "--batch-threads",
            "engine",
            "ggml threads for passes of more than one token: prefill chunks, draft "
            "verification, several streams' decodes (default: --threads)",
            type=int,
        ),
    )
    device: str | None = None  # torch executor: cpu / cuda
    dtype: str | None = None  # torch executor: float32 / float16 / bfloat16
    compile: str = field(  # torch executor decode steps
        default="auto",
        metadata=flag(
            "--compile",
            "engine",
            "torch executor decode steps: torch.compile (inductor) and, on CUDA, CUDA graphs; "
            "graphs = CUDA graphs of eager kernels; auto = on with CUDA (bare --compile = "
            "inductor)",
            nargs="?",
            const="inductor",
            choices=COMPILE_MODES,
        ),
    )
    # type an HF directory converts to for the ggml executor; auto: ultrafast/weight_format.py
    gguf_type: str = field(
        default=AUTO,
        metadata=flag(
            "--gguf-type",
            "model",
            "weight type an HF directory converts to for the ggml executor: auto = bf16 "
            "where the CPU has AVX-512 BF16, else f16; q8_0 = half of f16's bytes",
            choices=(AUTO, *OUT_TYPES),
        ),
    )
    chat_template: str | None = field(  # a built-in name (chat_templates.py) or a Jinja file
        default=None,
        metadata=flag(
            "--chat-template",
            "model",
            _chat_template_help,
            metavar="NAME|FILE",
            part="chat_template",
        ),
    )
    # ggml executor: llama.cpp's fused CPU attention (faster decode, wide batches and prefill
    # on SmolLM2 here: BENCHMARKS.md "Flash attention"); False: the plain attention ops
    flash_attn: bool = field(
        default=True,
        metadata=flag(
            "--flash-attn",
            "engine",
            "ggml executor: llama.cpp's fused CPU attention (default on: faster decode, "
            "batches and prefill on SmolLM2 here); off: the plain attention ops",
            **on_off(),
        ),
    )
    # ggml executor: long prefill chunks' KV computed by a bf16 PyTorch/oneDNN pass (the CPU's
    # matrix units); auto = where measured faster at start (executors/wide_route.py), on, off
    wide_pass: str = field(
        default="auto",
        metadata=flag(
            "--wide-pass",
            "engine",
            "ggml executor: long prefill chunks through a bf16 PyTorch (oneDNN) pass on the "
            "CPU's matrix units; auto = where it measures faster at start, on, off",
            choices=("auto", "on", "off"),
        ),
    )
    # ggml executor: a bf16 GGUF served from an exact float16 copy where llama.cpp's f16
    # kernels measure faster (executors/f16_twin.py); off = the file as stored
    f16_twin: str = field(
        default="auto",
        metadata=flag(
            "--f16-twin",
            "engine",
            "ggml executor: a bf16 GGUF runs from an exact float16 copy (checked equal, its "
            "matmul inputs bounded within float16) where that measures faster at the first "
            "start (auto), or as stored (off)",
            choices=("auto", "off"),
        ),
    )
    fake_step_s: float = field(  # executor "fake" (load/fault tests only): time per step
        default=0.02,
        metadata=flag("--fake-step-ms", "engine", "", type=float, hidden=True, **scaled(1000)),
    )
    # speculative decoding: off, ngram (prompt lookup), draft (model), auto (ngram, else the
    # draft model when one fits the tokenizer). A request's `prediction` is used in any tier.
    speculation: str = field(
        default="auto",
        metadata=flag(
            "--speculation",
            "speculative decoding",
            "speculative decoding: n-gram prompt lookup, a draft model, or auto "
            "(n-gram, else the draft model); a request's `prediction` is always used",
            choices=SPECULATION_METHODS,
            aliases=("--spec",),
        ),
    )
    speculation_tiers: tuple[str, ...] = field(  # tiers that draft (flex never by default)
        default=("priority",),
        metadata=flag(
            "--speculation-tiers",
            "speculative decoding",
            "comma-separated tiers that draft (priority, default, flex)",
            aliases=("--spec-tiers",),
            shown=",".join,
            to_field=lambda text: tuple(t.strip() for t in text.split(",") if t.strip()),
        ),
    )
    draft_model: str | None = field(  # HF dir or .gguf; None = the bundled demo draft if it fits
        default=None,
        metadata=flag(
            "--draft-model",
            "speculative decoding",
            "draft model (HF dir or .gguf, same tokenizer; default: the bundled "
            "demo draft when it fits the model)",
        ),
    )
    max_draft_tokens: int = field(
        default=MAX_DRAFT_TOKENS,
        metadata=flag(
            "--max-draft-tokens",
            "speculative decoding",
            "upper bound of the adaptive number of draft tokens per step",
            type=int,
        ),
    )
    # size k from this machine's measured step costs; False: the fixed defaults (tests)
    speculation_measured_costs: bool = field(
        default=True,
        metadata=flag(
            "--speculation-costs",
            "speculative decoding",
            "step costs that size the number of draft tokens: measured on this machine "
            "(default), or fixed defaults, so the drafts do not depend on the machine's load "
            "(reproducible runs, tests)",
            aliases=("--spec-costs",),
            choices=("measured", "fixed"),
            shown=lambda measured: "measured" if measured else "fixed",
            to_field=lambda v: v == "measured",
        ),
    )
    # the tiered KV cache under the slots (kvcache/): L2 host memory, L3 disk and/or Redis
    kv_host_cache_gb: float = field(  # 0 = none (a small staging area when an L3 tier is set)
        default=0.0,
        metadata=flag(
            "--kv-host-cache-gb",
            "KV cache",
            "host memory for conversations' KV evicted from the slots (L2, a hard limit; "
            "0 = none): a conversation's next turn restores it instead of recomputing",
            type=float,
            part="kv",
        ),
    )
    kv_disk_dir: str | None = field(
        default=None,
        metadata=flag(
            "--kv-disk-dir",
            "KV cache",
            "directory for conversations' KV (L3): written after each turn, so a restart "
            "(even kill -9) keeps conversations warm (default: none)",
            part="kv",
        ),
    )
    kv_disk_gb: float = field(
        default=10.0,
        metadata=flag(
            "--kv-disk-gb",
            "KV cache",
            "hard limit of --kv-disk-dir (least recently used out)",
            type=float,
            part="kv",
        ),
    )
    kv_store: str | None = field(  # redis://host:port[/db]: conversations' KV shared by replicas
        default=None,
        metadata=flag(
            "--kv-store",
            "KV cache",
            "Redis for conversations' KV (L3), shared by every server of the same model "
            "(default: none)",
            metavar="redis://HOST:PORT",
            part="kv",
        ),
    )
    # verifies a rediss:// kv_store: ServerConfig's --redis-ca-file (one CA for every Redis)
    kv_redis_ca_file: str | None = field(default=None, metadata=reads("redis_ca_file"))
    kv_secret_file: str | None = field(  # signs KV blobs (kvcache/secret.py); None: the data dir's
        default=None,
        metadata=flag(
            "--kv-secret-file",
            "KV cache",
            "the secret that signs KV blobs (HMAC-SHA256; created 0600 on first start; "
            "default: kv-secret in the data dir): replicas sharing KV must share this file",
            metavar="FILE",
            part="kv",
        ),
    )

    @property
    def prefill_chunk_tokens(self) -> int:
        """The largest prefill chunk a request gets in one step (0 in the field: the budget)."""
        return self.max_prefill_chunk_tokens or self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_prefill_chunk_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 1, max_prefill_chunk_tokens >= 0")
        if self.short_first_window_s < 0:
            raise ValueError("short_first_window_s must be >= 0")
        if self.kv_host_cache_gb < 0 or self.kv_disk_gb <= 0:
            raise ValueError("kv_host_cache_gb must be >= 0 and kv_disk_gb > 0")
        if self.kv_store and not self.kv_store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("kv_store must be a redis://, rediss:// or unix:// URL")
        if self.wide_pass not in ("auto", "on", "off"):
            raise ValueError("wide_pass must be one of auto, on, off")
        if self.f16_twin not in ("auto", "off"):
            raise ValueError("f16_twin must be auto or off")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}")
        if self.speculation not in SPECULATION_METHODS:
            raise ValueError(f"speculation must be one of {', '.join(SPECULATION_METHODS)}")
        bad = set(self.speculation_tiers) - set(SPECULATION_TIERS)
        if bad:
            tiers = ", ".join(SPECULATION_TIERS)
            raise ValueError(f"unknown speculation tier(s) {sorted(bad)}: use {tiers}")
        if not 1 <= self.max_draft_tokens <= 32:
            raise ValueError("max_draft_tokens must be in [1, 32]")
        if self.num_slots < 0 or self.max_num_seqs < 0:
            raise ValueError("num_slots and max_num_seqs must be >= 0 (0 = auto)")
        if self.num_slots and self.max_num_seqs > self.num_slots:
            raise ValueError("max_num_seqs cannot exceed num_slots")
