"""`ultrafast bench SUITE`: one subcommand per benchmark, each with only the options it reads.

The suites are `ultrafast_harness.bench` modules: each has `add_args(parser)` beside its
`main(args)`, and this file is their table. A suite's module is imported (with its heavy
imports) only when its options are needed: `ultrafast bench SUITE ...` or the full parser the
tests walk (`build_parser()` with no argv), never for `ultrafast serve`.

`ultrafast bench [options]` with no suite is `ultrafast bench harness [options]` (see
`with_default_bench_suite`), so invocations written before the suites were subcommands still run.
Every suite writes a JSON report and a Markdown table beside it (under runs/ by default).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Suite:
    name: str
    module: str  # has add_args(parser) and main(args)
    summary: str
    aliases: tuple[str, ...] = ()


SUITES = (
    Suite(
        DEFAULT_SUITE,
        "ultrafast_harness.bench.harness_report",
        "ours (engine + HTTP server) vs llama.cpp and transformers at several "
        "concurrencies; JSON + Markdown + PNG",
        aliases=("run",),
    ),
    Suite(
        "decode",
        "ultrafast_harness.bench.decode",
        "batch-1 decode speed: ours vs llama.cpp vs transformers",
    ),
    Suite(
        "tiers",
        "ultrafast_harness.bench.tiers",
        "priority-tier latency on an idle vs a loaded server, and the HTTP streaming overhead",
    ),
    Suite(
        "sessions",
        "ultrafast_harness.bench.sessions",
        "time to first token by conversation turn, and exactly-once turns across a Redis restart",
    ),
    Suite(
        "guard",
        "ultrafast_harness.bench.guard",
        "time to first token and tokens/s with and without the output safety filter",
    ),
    Suite(
        "gpu",
        "ultrafast_harness.bench.gpu_check",
        "Llama-3.2-1B-shaped bf16 decode on CUDA: eager vs CUDA graphs vs the roofline, "
        "then tests/gpu",
    ),
    Suite(
        "serve",
        "ultrafast_harness.bench.serve_bench",
        "servers side by side (ours, llama.cpp's server, vLLM's CPU backend bound and unbound), "
        "each in its best configuration, interleaved per level on the same weights: concurrent "
        "streams, long prompts, the burst, startup, memory; JSON + Markdown + PNG",
    ),
    Suite(
        "startup",
        "ultrafast_harness.bench.startup_bench",
        "time to first answer and idle RSS of a fresh server, cold and warm, ours beside "
        "llama-cpp-python's server on the same GGUF",
    ),
    Suite(
        "models",
        "ultrafast_harness.bench.models",
        "several models in one server with a budget for one: swap cost vs load time, and "
        "cold loads of a periodic trace with and without preloading",
    ),
    Suite(
        "tools",
        "ultrafast_harness.bench.tool_dispatch",
        "agent fast path: first tool call dispatchable vs response finished, two-call turns",
    ),
    Suite(
        "grammar",
        "ultrafast_harness.bench.grammar",
        "constrained decoding: time per token vs unconstrained, schema compile and TTFT",
    ),
)


def suite_named(name: str) -> Suite | None:
    return next((s for s in SUITES if name == s.name or name in s.aliases), None)


def add_bench_parser(sub: Any, with_args: Iterable[str] | None = None) -> None:
    """`bench` and a subcommand per suite; the suites named in `with_args` (None: all) get
    their options, which imports their modules."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks, ours vs peers (JSON + Markdown table)",
        description="Benchmarks. Each suite has its own options: ultrafast bench SUITE --help. "
        f"Without a suite, `ultrafast bench [options]` runs `{DEFAULT_SUITE}`.",
    )
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    wanted = None if with_args is None else set(with_args)
    for suite in SUITES:
        p: argparse.ArgumentParser = suites.add_parser(
            suite.name,
            aliases=list(suite.aliases),
            help=suite.summary,
            description=suite.summary[0].upper() + suite.summary[1:],
        )
        p.set_defaults(func=SuiteRunner(suite.module), suite=suite.name)
        if wanted is None or suite.name in wanted:
            importlib.import_module(suite.module).add_args(p)


def suites_to_build(argv: list[str] | None) -> list[str] | None:
    """Which suites' options a parse of `argv` needs: None (all) without argv; the named
    suite for `bench SUITE ...`; none for any other command."""
    if argv is None:
        return None
    if len(argv) >= 2 and argv[0] == "bench":
        suite = suite_named(argv[1])
        return [suite.name] if suite else []
    return []


def with_default_bench_suite(argv: list[str]) -> list[str]:
    """`bench` followed by options (or nothing) means `bench harness` followed by them; a suite
    name must come first, as it always did in the documented invocations."""
    if not argv or argv[0] != "bench":
        return argv
    rest = argv[1:]
    if rest and (not rest[0].startswith("-") or rest[0] in ("-h", "--help")):
        return argv
    return ["bench", DEFAULT_SUITE, *rest]
