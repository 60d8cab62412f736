"""The `ultrafast` command. Every command and bench suite has --help.

Commands: generate and serve (cli_serve.py), chat (cli_chat.py), bench SUITE (cli_bench.py),
loadtest, keys, convert, and quantize / eval-ppl (quant/command.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ultrafast.cli_bench import add_bench_parser, suites_to_build, with_default_bench_suite
from ultrafast.cli_chat import add_chat_parser
from ultrafast.cli_cluster import add_cluster_parser
from ultrafast.cli_serve import add_generate_parser, add_serve_parser
from ultrafast.weight_format import AUTO, OUT_TYPES


def cmd_keys(args: argparse.Namespace) -> int:
    from ultrafast.server.tenants import hash_key, load_api_keys, new_key

    if args.action == "new":
        key = new_key()
        print(f"key:    {key}\nsha256: {hash_key(key)}")
    elif args.action == "hash":
        key = args.key if args.key is not None else sys.stdin.readline().rstrip("\n")
        if not key:
            raise ValueError("give the key as an argument or on stdin")
        print(hash_key(key))
    else:
        keys = load_api_keys(args.key)
        for tenant in keys.tenants.values():
            print(
                f"{tenant.name}: tiers {sorted(t.api_name for t in tenant.tiers)}, "
                f"{sum(1 for _, t, _ in keys.by_hash.values() if t is tenant)} key(s)"
            )
    return 0


def cmd_loadtest(args: argparse.Namespace) -> int:
    from ultrafast_harness.loadtest.runner import main as loadtest_main

    return loadtest_main(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from ultrafast.convert import convert_hf_to_gguf
    from ultrafast.weight_format import resolve_outtype

    outtype, why = resolve_outtype(args.outtype)
    print(f"weight type: {outtype} ({why})")
    out = convert_hf_to_gguf(args.model_dir, args.out, outtype=outtype)
    print(f"wrote {out}")
    return 0


def add_loadtest_parser(sub: Any) -> None:
    lt = sub.add_parser(
        "loadtest",
        help="load scenarios and fault injections against real "
        "servers on loopback, with the nothing-lost checks (JSON + Markdown)",
    )
    lt.add_argument("--scenario", default="all", help="L1,F3,... or ci or all")
    lt.add_argument(
        "--tier",
        choices=["full", "ci"],
        default="full",
        help="full: the reliability cases' sizes; ci: short runs",
    )
    lt.add_argument("--duration-s", type=float, default=180.0, help="cap per scenario")
    lt.add_argument("--max-requests", type=int, default=10_000, help="cap per scenario")
    lt.add_argument(
        "--url",
        default=None,
        help="an already running loopback server (default: start one per scenario)",
    )
    lt.add_argument("--out", default="runs/loadtest.json", help="JSON report (+ .md beside)")
    lt.set_defaults(func=cmd_loadtest)


def add_keys_parser(sub: Any) -> None:
    keys = sub.add_parser("keys", help="API keys: make one, hash one, check a keys file")
    keys.add_argument(
        "action",
        choices=["new", "hash", "check"],
        help="new: random key + its sha256; hash KEY (or stdin): the sha256 to "
        "put in the keys file; check FILE: parse a keys file",
    )
    keys.add_argument("key", nargs="?", default=None, help="hash: the key; check: the file")
    keys.set_defaults(func=cmd_keys)


def add_convert_parser(sub: Any) -> None:
    conv = sub.add_parser("convert", help="convert an HF model directory to GGUF")
    conv.add_argument("model_dir", help="HF directory (config.json, safetensors, tokenizer.json)")
    conv.add_argument("out", help="output .gguf path")
    conv.add_argument(
        "--outtype",
        choices=[AUTO, *OUT_TYPES],
        default=AUTO,
        help="GGUF weight type; auto (default): bf16 where the CPU has AVX-512 BF16, else f16",
    )
    conv.set_defaults(func=cmd_convert)


def version_text() -> str:
    """`ultrafast --version`: ours, and the llama.cpp binding and Python it runs on (for bug
    reports); from the installed metadata, so nothing heavy is imported."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    ours = installed("ultrafast")
    if ours == "not installed":  # run from a checkout: its pyproject.toml says
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = pyproject.is_file() and re.search(
            r'(?m)^version = "([^"]+)"', pyproject.read_text(encoding="utf-8")
        )
        ours = found.group(1) if found else "(version unknown)"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"ultrafast {ours} (llama-cpp-python {installed('llama-cpp-python')}, Python {python})"


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `argv`, only the bench suite it names gets its options
    (a suite's module is heavy to import: `serve` never imports one)."""
    from functools import partial

    from ultrafast.quant.command import add_parsers as add_quant_parsers

    parser = argparse.ArgumentParser(prog="ultrafast", description="Low-latency LLM inference.")
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        add_generate_parser,
        add_chat_parser,
        add_serve_parser,
        add_cluster_parser,
        partial(add_bench_parser, with_args=suites_to_build(argv)),
        add_loadtest_parser,
        add_keys_parser,
        add_convert_parser,
        add_quant_parsers,
    ):  # quantize, eval-ppl
        add_command(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = with_default_bench_suite(list(sys.argv[1:] if argv is None else argv))
    return build_parser(argv).parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except (FileNotFoundError, ValueError) as exc:
        print(f"ultrafast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
