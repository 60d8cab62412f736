"""The outputs of `ultrafast bench harness`: JSON, Markdown tables and the latency PNG,
plus the command's entry point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ultrafast_harness.bench.suite_args import (
    add_compile,
    add_executor,
    add_model,
    add_new_tokens,
    add_out,
    add_rounds,
    add_threads,
)


def _f(value, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _pcts(p: dict | None, digits: int) -> list[str]:
    return [_f((p or {}).get(k), digits) for k in ("p50", "p90", "p99")]


def markdown(report: dict) -> str:
    lines = [
        f"model `{report['model']}` (ggml runners: {report['gguf']}), {report['prompt_tokens']} "
        f"prompt tokens, {report['max_tokens']} new tokens per stream (greedy, EOS ignored), "
        f"{report['threads']} threads, {report['rounds']} interleaved rounds after a "
        f"warm-up; ours = executor `{report['executor']}`, compile `{report['compile']}`",
        "",
    ]
    for note in report["notes"].values():
        lines.append(f"- {note}")
    for name, why in report["skipped"].items():
        lines.append(f"- {name} not run: {why}")
    lines += [
        "",
        "| concurrency | runner | TTFT p50 / p90 / p99 ms | per-token p50 / p90 / p99 ms "
        "| tok/s (all streams) | decode tok/s per stream |",
        "|---|---|---|---|---|---|",
    ]
    for c, level in report["results"].items():
        for name, r in level.items():
            lines.append(
                f"| {c} | {name} | {' / '.join(_pcts(r['ttft_ms'], 1))} | "
                f"{' / '.join(_pcts(r['itl_ms'], 2))} | {_f(r['tok_s'])} | "
                f"{_f(r['decode_tok_s_per_stream'])} |"
            )
    lines += [
        "",
        "ours / peer, same concurrency, same run (tok/s: higher is better; latencies: "
        "lower is better)",
        "",
        "| concurrency | pair | tok/s | TTFT p50 | per-token p50 |",
        "|---|---|---|---|---|",
    ]
    for c, pairs in report["ratios"].items():
        for pair, r in pairs.items():
            lines.append(
                f"| {c} | {pair} | {_f(r['tok_s'], 2, 'x')} | "
                f"{_f(r['ttft_p50'], 2, 'x')} | {_f(r['itl_p50'], 2, 'x')} |"
            )
    roof = report.get("roofline")
    if roof:
        bw = ", ".join(f"{d} {v:.1f} GB/s" for d, v in roof["bandwidth_gb_s"].items())
        lines += [
            "",
            f"batch-1 decode vs the memory roofline (measured read bandwidth: {bw}; "
            f"mean context {roof['mean_context_tokens']:.0f} tokens)",
            "",
            "| runner | bytes / token | roofline tok/s | measured tok/s | fraction |",
            "|---|---|---|---|---|",
        ]
        for name, r in roof["runners"].items():
            tok_s = r["measured_tok_s"]
            lines.append(
                f"| {name} | {r['bytes_per_token'] / 1e6:.2f} MB | "
                f"{r['roofline_tok_s']:.0f} | {_f(tok_s)} | "
                f"{_f(r['fraction'] and 100 * r['fraction'], 1, '%')} |"
            )
    return "\n".join(lines)


def write_outputs(report: dict, out_json: str | Path) -> dict[str, Path]:
    """JSON (latency samples split off into the plot), Markdown beside it, PNG beside it."""
    from ultrafast_harness.bench.latency_plot import plot_latencies

    out_json = Path(out_json)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    samples = {
        c: {n: r.pop("samples") for n, r in level.items()} for c, level in report["results"].items()
    }
    report["results"] = {str(c): level for c, level in report["results"].items()}
    report["ratios"] = {str(c): level for c, level in report["ratios"].items()}
    table = markdown(report)
    paths = {
        "json": out_json,
        "markdown": out_json.with_suffix(".md"),
        "png": out_json.with_suffix(".png"),
    }
    plot_latencies(samples, paths["png"], f"{report['model']}: latency distributions")
    report["latency_samples_ms"] = {str(c): v for c, v in samples.items()}
    out_json.write_text(json.dumps(report, indent=1))
    paths["markdown"].write_text(table + "\n")
    print(table)
    for kind, path in paths.items():
        print(f"wrote {kind}: {path}")
    return paths


def main(args) -> int:
    from ultrafast_harness.bench.harness import run_harness

    concurrency = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
    if not concurrency or min(concurrency) < 1:
        raise ValueError("--concurrency takes positive integers, e.g. 1,4,16")
    peers = [p.strip() for p in args.peers.split(",")] if args.peers else None
    report = run_harness(
        args.model,
        max_tokens=args.new_tokens,
        rounds=args.rounds,
        concurrency=concurrency,
        peers=peers,
        threads=args.threads,
        prompt_tokens=args.prompt_tokens,
        executor=args.executor,
        compile=args.compile,
        gguf_type=args.gguf_type,
        with_roofline=args.roofline,
    )
    write_outputs(report, args.out)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench harness_report --help`)."""
    add_model(p)
    add_new_tokens(p, "tokens generated per stream")
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
    add_executor(p)
    add_compile(p)
    add_rounds(p, 3)
    add_threads(
        p,
        "kernel threads of every runner (default: the serve default for our "
        "server, all cores for the others)",
    )
    p.add_argument("--gguf-type", default="f16", help="GGUF type for both ggml runners")
    add_out(p, "runs/bench.json")
