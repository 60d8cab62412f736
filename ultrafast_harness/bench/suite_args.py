"""Options several bench suites share (each suite's `add_args`, beside its `main`, uses
them): the model, the report path, rounds, tokens, threads, the executor, the server's slots,
and `--compile` as `serve` has it (from EngineConfig's field). Light: `ultrafast bench SUITE`
builds its parser from these before the suite's heavy imports run."""

from __future__ import annotations

import argparse

from ultrafast.config import EngineConfig
from ultrafast.config_flags import add_flags


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1]")
    return value


def add_out(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--out", default=default, help=f"JSON report, Markdown beside it (default {default})"
    )


def add_model(p: argparse.ArgumentParser, what: str = "HF model directory") -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"{what} (default: $ULTRAFAST_MODEL or the bundled demo model)",
    )


def add_rounds(p: argparse.ArgumentParser, default: int, what: str = "timed rounds") -> None:
    p.add_argument("--rounds", type=int, default=default, help=f"{what} (default {default})")


def add_new_tokens(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--new-tokens",
        "--max-tokens",
        dest="new_tokens",
        type=int,
        default=128,
        help=f"{what} (default 128)",
    )


def add_threads(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--threads", type=int, default=None, help=what)


def add_executor(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--executor",
        choices=["auto", "ggml", "torch"],
        default="auto",
        help="our executor (auto = ggml on CPU, torch on CUDA)",
    )


def add_server_slots(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-slots", type=int, default=4, help="KV slots of the server (default 4)")


def add_compile(p: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """EngineConfig's `--compile`, with the suite's own help text."""
    add_flags(p, EngineConfig, names=("compile",), help=help_text)
