"""`ultrafast bench grammar --served`: what a first-seen ~10 KB schema adds to the TTFT a client
sees, through the server (HTTP, the request checks, the chat template, tokenization, the
engine).

Each round streams chat completions to one server, closing each stream at its first content
delta, with `max_tokens` the room the context leaves (the server refuses a budget that the
schema's shortest answer cannot fit in, and the 10 KB schema's answer is longer than one
token): no schema,
a schema the
server has never seen, the same schema again (cached; the no-schema call goes first or last,
alternately), and a long prompt (new to the prefix cache) with another first-seen schema
beside one without; TTFT is from the send to the first content delta. The server starts
compiling a schema when the request is parsed, before the prompt is rendered and tokenized,
so part of the compile runs beside that work rather than beside the prefill (the in-process
figures of `bench grammar` start both at once). Medians over rounds; the client shares the
machine's cores, as every served benchmark's does.
"""

from __future__ import annotations

import json
import statistics
import time

import httpx

from ultrafast_harness.bench.grammar_inputs import big_schema, long_prompt
from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.server_process import ServerProcess

SHORT_PROMPT = "Give the record as JSON."
SETTLE_S = 0.1  # after a close, for the server to drop the call before the next send


def chat_body(prompt: str, schema: dict | None) -> dict:
    body: dict = {
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0.0,
        "stream": True,
    }
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": schema, "strict": False},
        }
    return body


_ROOM: dict[str, int] = {}


def _room(client: httpx.Client, messages: list) -> int:
    """The tokens the context leaves after the prompt (asked once per prompt, untimed)."""
    key = json.dumps(messages)
    if key not in _ROOM:
        r = client.post("/tokenize", json={"messages": messages})
        r.raise_for_status()
        _ROOM[key] = r.json()["max_model_len"] - r.json()["count"]
    return _ROOM[key]


def time_to_first_content(client: httpx.Client, body: dict) -> float:
    """Seconds from the send to the first chunk that carries content (the role-only first
    chunk does not count)."""
    body = {**body, "max_tokens": _room(client, body["messages"])}
    start = time.perf_counter()
    elapsed = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if any(c.get("delta", {}).get("content") for c in json.loads(line[6:])["choices"]):
                elapsed = time.perf_counter() - start
                break  # closing the stream ends the call
    if elapsed is None:
        raise RuntimeError("the stream ended without content")
    time.sleep(SETTLE_S)  # the next call starts on a quiet server
    return elapsed


def run(client: httpx.Client, rounds: int) -> dict:
    ttft: dict[str, list[float]] = {
        k: [] for k in ("none", "first_seen", "cached", "long_none", "long_first_seen")
    }
    salt = time.monotonic_ns() % 1_000_003
    time_to_first_content(client, chat_body(SHORT_PROMPT, big_schema(salt)))  # warm-up
    for r in range(rounds):
        schema = big_schema(salt + 1 + r)
        # an unmeasured call first: the last round's long prompts leave work behind them
        time_to_first_content(client, chat_body(SHORT_PROMPT, None))
        # alternate where the no-schema call sits, so neither kind always follows the other
        order = ("none", "first_seen", "cached") if r % 2 else ("first_seen", "cached", "none")
        for kind in order:
            body = chat_body(SHORT_PROMPT, None if kind == "none" else schema)
            ttft[kind].append(time_to_first_content(client, body))
        ttft["long_none"].append(time_to_first_content(client, chat_body(long_prompt(), None)))
        fresh = big_schema(salt + 10_000 + r)
        ttft["long_first_seen"].append(
            time_to_first_content(client, chat_body(long_prompt(), fresh))
        )
    medians = {f"ttft_{k}_ms": statistics.median(v) * 1000 for k, v in ttft.items()}
    return {
        **medians,
        "first_seen_added_ms": medians["ttft_first_seen_ms"] - medians["ttft_none_ms"],
        "cached_added_ms": medians["ttft_cached_ms"] - medians["ttft_none_ms"],
        "long_first_seen_added_ms": medians["ttft_long_first_seen_ms"]
        - medians["ttft_long_none_ms"],
        "raw_ms": {k: [round(x * 1000, 2) for x in v] for k, v in ttft.items()},
    }


def markdown(report: dict) -> str:
    return (
        f"served, {report['schema_bytes']} B schema, median of {report['rounds']} rounds: TTFT "
        f"{report['ttft_none_ms']:.1f} ms without a schema, {report['ttft_first_seen_ms']:.1f} "
        f"first-seen ({report['first_seen_added_ms']:+.1f}), {report['ttft_cached_ms']:.1f} "
        f"cached ({report['cached_added_ms']:+.1f}); long prompt "
        f"{report['ttft_long_none_ms']:.1f} without, {report['ttft_long_first_seen_ms']:.1f} "
        f"first-seen ({report['long_first_seen_added_ms']:+.1f})"
    )


def main(args) -> int:
    srv = ServerProcess(model=args.model, num_slots=2, max_model_len=2048)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            report = run(client, args.rounds)
    finally:
        srv.stop()
    report.update(
        model=str(args.model), rounds=args.rounds, schema_bytes=len(json.dumps(big_schema(0)))
    )
    return write_report(report, args.out, markdown(report))
