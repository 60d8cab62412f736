"""The agent fast path: when can a client dispatch a turn's first tool call, against when the
response has finished? A two-call agent turn (`tool_choice: required`, parallel calls) is
streamed over chat completions (with `stream_options.include_tool_call_done`) and over the
Responses API; each round records the time of the first call's completion event
(`event: tool_call.done`, `response.output_item.done` of a function_call) and of the end of
the stream, both from the request's send. Turns where the model made fewer than two calls
are reported and left out of the ratio (a small model does not always make the second call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.server_process import ServerProcess
from ultrafast_harness.bench.suite_args import add_model, add_out, add_rounds

TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {
        "name": "get_time",
        "description": "Local time of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
]
PROMPT = "What are the weather and the local time in Paris? Call both tools."


def chat_body(max_tokens: int, seed: int) -> dict:
    return {
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"type": "function", "function": t} for t in TOOLS],
        "tool_choice": "required",
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_tool_call_done": True},
    }


def responses_body(max_tokens: int, seed: int) -> dict:
    # the Responses API takes no seed: its rounds differ by sampling alone
    return {
        "input": PROMPT,
        "tools": [{"type": "function", **t} for t in TOOLS],
        "tool_choice": "required",
        "max_output_tokens": max_tokens,
        "temperature": 0.7,
        "store": False,
        "stream": True,
    }


def time_stream(client: httpx.Client, path: str, body: dict) -> dict:
    """Seconds from send to the first call's completion event and to the stream's end."""
    start = time.perf_counter()
    first_call_s, calls, event_name = None, 0, None
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event_name = line[7:]
                continue
            if not line.startswith("data: "):
                continue
            data = line[6:]
            done_call = event_name == "tool_call.done" or (
                event_name == "response.output_item.done"
                and json.loads(data)["item"]["type"] == "function_call"
            )
            if done_call:
                calls += 1
                if first_call_s is None:
                    first_call_s = time.perf_counter() - start
            event_name = None
    return {"first_call_s": first_call_s, "finished_s": time.perf_counter() - start, "calls": calls}


def summarize(rounds: list[dict]) -> dict:
    two = [r for r in rounds if r["calls"] >= 2]
    ratios = [r["first_call_s"] / r["finished_s"] for r in two]
    return {
        "rounds": len(rounds),
        "two_call_rounds": len(two),
        "calls_per_round": [r["calls"] for r in rounds],
        "first_call_ms_median": statistics.median(r["first_call_s"] for r in two) * 1000
        if two
        else None,
        "finished_ms_median": statistics.median(r["finished_s"] for r in two) * 1000
        if two
        else None,
        "first_call_fraction_median": statistics.median(ratios) if ratios else None,
    }


def main(args) -> int:
    srv = ServerProcess(
        "--priority-ttft-ms", "10000", model=args.model, num_slots=2, max_model_len=2048
    )
    report: dict = {"model": str(args.model), "rounds": args.rounds, "apis": {}}
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as client:
            time_stream(client, "/v1/chat/completions", chat_body(args.max_tokens, 0))  # warm-up
            for api, path, build in (
                ("chat", "/v1/chat/completions", chat_body),
                ("responses", "/v1/responses", responses_body),
            ):
                rounds = [
                    time_stream(client, path, build(args.max_tokens, seed))
                    for seed in range(args.rounds)
                ]
                report["apis"][api] = {**summarize(rounds), "raw": rounds}
    finally:
        srv.stop()
    lines = [
        "| API | two-call rounds | first call dispatchable (ms) | finished (ms) | fraction |",
        "|---|---|---|---|---|",
    ]
    for api, s in report["apis"].items():

        def fmt(value, spec=".1f"):
            return "-" if value is None else format(value, spec)

        lines.append(
            f"| {api} | {s['two_call_rounds']}/{s['rounds']} | {fmt(s['first_call_ms_median'])}"
            f" | {fmt(s['finished_ms_median'])} | {fmt(s['first_call_fraction_median'], '.2f')} |"
        )
    table = "\n".join(lines)
    Path(args.out).with_suffix(".md").parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    return write_report(report, args.out, table)


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench tool_dispatch --help`)."""
    add_model(p)
    add_rounds(p, 10, "streamed agent turns per API")
    p.add_argument("--max-tokens", type=int, default=200, help="output cap per turn (default 200)")
    add_out(p, "runs/bench_tools.json")
