"""What does the HTTP streaming path cost per token? Batch-1 tokens/s, in-process vs over HTTP.

The in-process engine and the server run the same model with the same engine settings (slots,
context, kernel threads); rounds alternate between them so drift on a shared machine hits both
alike, and the overhead is the median of the per-round ratios. Two clients read the stream:
a lean SSE reader (the server's own cost) and httpx (what a Python client library adds).

The server's engine thread hands each step's outputs to the event loop thread, which sleeps
between tokens, so every token pays one cross-thread wake on the engine's critical path. On a
VM whose idle vCPUs halt at once (this one) that wake alone costs tens of microseconds, a
share of a 1 ms token that no HTTP code removes: `handoff` rounds measure it in-process, the
engine thread handing each output to a sleeping thread vs keeping it.
"""

from __future__ import annotations

import asyncio
import os
import queue
import statistics
import threading
import time

import httpx

from ultrafast_harness.bench.server_process import ServerProcess
from ultrafast_harness.bench.sse_client import completion_token_stamps

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def _rate(stamps: list[float], num_tokens: int) -> float:
    """Tokens after the first per second. Counted in tokens, not events: a client that falls
    behind gets several tokens merged into one delta."""
    return (num_tokens - 1) / (stamps[-1] - stamps[0])


def _body(max_tokens: int) -> dict:
    # the default tier on both sides: plain decode (the priority tier would add speculative
    # decoding on the server only), exactly max_tokens tokens (EOS ignored)
    return {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far, all threads (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_process_round(engine, prompt_ids: list[int], max_tokens: int, tag: str) -> float:
    from ultrafast.request import Request, SamplingParams

    engine.pool.reset_cache()  # every round prefills, like a new HTTP request with no cache hit
    engine.add_request(
        Request(
            tag, prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    )
    stamps = []
    while engine.has_work():
        if any(o.new_token_ids for o in engine.step()):
            stamps.append(time.perf_counter())
    return _rate(stamps, max_tokens)


async def lean_round(port: int, max_tokens: int) -> float:
    _, stamps = await completion_token_stamps("127.0.0.1", port, _body(max_tokens))
    return _rate(stamps, max_tokens)


async def httpx_round(url: str, max_tokens: int) -> float:
    stamps = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async with client.stream("POST", "/v1/completions", json=_body(max_tokens)) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text":' in line:
                    stamps.append(time.perf_counter())
    return _rate(stamps, max_tokens)


def handoff_rounds(
    engine, prompt_ids: list[int], max_tokens: int, rounds: int
) -> tuple[list[float], list[float]]:
    """The engine on its own long-lived thread (as in the server), each output either recorded
    by the engine thread itself or handed to a sleeping consumer thread, as the server hands
    it to its event loop; alternating rounds. The pair isolates what one cross-thread wake
    per token costs on this machine. Returns (kept tok/s, handed tok/s) per round."""
    from ultrafast.engine.thread import EngineThread
    from ultrafast.request import Request, SamplingParams

    inbox: queue.SimpleQueue = queue.SimpleQueue()
    consumer = threading.Thread(
        target=lambda: [f(o) for f, o in iter(inbox.get, None)], daemon=True
    )
    consumer.start()
    thread = EngineThread(engine).start()
    kept: list[float] = []
    handed: list[float] = []
    try:
        for i in range(2 * rounds + 1):  # round 0 warms the thread up, then alternate
            to_thread = i % 2 == 0
            stamps: list[float] = []
            done = threading.Event()

            def record(output, stamps=stamps, done=done) -> None:
                if output.new_token_ids:
                    stamps.append(time.perf_counter())
                if output.finished:
                    done.set()

            def hand_over(output, record=record) -> None:
                inbox.put((record, output))

            engine.pool.reset_cache()  # the engine thread is idle between rounds
            thread.submit(
                Request(
                    f"handoff{i}",
                    prompt_ids,
                    SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                ),
                hand_over if to_thread else record,
            )
            if not done.wait(120):
                raise RuntimeError("the engine thread did not finish a benchmark round")
            if i:
                (handed if to_thread else kept).append(_rate(stamps, max_tokens))
    finally:
        thread.stop()
        inbox.put(None)
        consumer.join()
    return kept, handed


def _summary(in_process: list[float], over_http: list[float]) -> dict:
    ratios = [h / p for h, p in zip(over_http, in_process)]
    return {
        "http_tok_s": statistics.median(over_http),
        "overhead": 1 - statistics.median(ratios),
        "overhead_per_round": [1 - r for r in ratios],
    }


def run_overhead_bench(
    model: str,
    threads: int,
    num_slots: int = 4,
    max_model_len: int = 512,
    max_tokens: int = 128,
    rounds: int = 10,
) -> dict:
    from ultrafast.config import EngineConfig
    from ultrafast.llm import build_engine

    engine, tokenizer, _ = build_engine(
        EngineConfig(
            model=model,
            num_slots=num_slots,
            max_num_seqs=num_slots,
            max_model_len=max_model_len,
            n_threads=threads,
        )
    )
    engine.warmup()
    ids = tokenizer.encode(PROMPT)
    server = ServerProcess(
        "--threads", str(threads), model=model, num_slots=num_slots, max_model_len=max_model_len
    )
    in_process, lean, lib = [], [], []
    cpu_in_process_s = cpu_server_s = 0.0  # CPU per token does not depend on machine load
    try:
        in_process_round(engine, ids, max_tokens, "warm")
        asyncio.run(lean_round(server.port, max_tokens))
        for i in range(rounds):
            t0 = time.process_time()
            in_process.append(in_process_round(engine, ids, max_tokens, f"r{i}"))
            cpu_in_process_s += time.process_time() - t0
            t0 = process_cpu_s(server.proc.pid)
            lean.append(asyncio.run(lean_round(server.port, max_tokens)))
            cpu_server_s += process_cpu_s(server.proc.pid) - t0
            lib.append(asyncio.run(httpx_round(server.url, max_tokens)))
        kept, handed = handoff_rounds(engine, ids, max_tokens, rounds)
    finally:
        server.stop()
        engine.executor.close()
    return {
        "threads": threads,
        "num_slots": num_slots,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "in_process_tok_s": statistics.median(in_process),
        "cpu_us_per_token": {
            "in_process": 1e6 * cpu_in_process_s / (rounds * max_tokens),
            "server": 1e6 * cpu_server_s / (rounds * max_tokens),
        },
        "in_process_per_round": in_process,
        "handoff": {
            "kept_tok_s": statistics.median(kept),
            **_summary(kept, handed),
            "kept_per_round": kept,
            "handed_per_round": handed,
        },
        "lean_client": {**_summary(in_process, lean), "per_round": lean},
        "httpx_client": {**_summary(in_process, lib), "per_round": lib},
    }


def markdown(s: dict) -> str:
    lean, lib = s["lean_client"], s["httpx_client"]
    return "\n".join(
        [
            f"batch-1 streaming, {s['rounds']} alternating rounds of {s['max_tokens']} tokens, "
            f"{s['threads']} kernel thread(s) on both sides",
            "",
            "| path | tok/s (median) | overhead vs in-process (median of per-round ratios) |",
            "|---|---|---|",
            f"| in-process engine | {s['in_process_tok_s']:.1f} | |",
            f"| HTTP SSE, lean client | {lean['http_tok_s']:.1f} | {100 * lean['overhead']:.1f}% |",
            f"| HTTP SSE, httpx client | {lib['http_tok_s']:.1f} | {100 * lib['overhead']:.1f}% |",
            "",
            f"CPU per token (all threads): in-process {s['cpu_us_per_token']['in_process']:.0f} us,"
            f" server with the lean client {s['cpu_us_per_token']['server']:.0f} us",
            "",
            f"Handing each output to a sleeping thread, no HTTP (engine thread in-process, same "
            f"rounds): {s['handoff']['kept_tok_s']:.1f} -> {s['handoff']['http_tok_s']:.1f} tok/s,"
            f" {100 * s['handoff']['overhead']:.1f}% slower: the share of the HTTP overhead that is"
            f" the wake alone",
        ]
    )
