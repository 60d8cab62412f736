"""What the protocol front ends add to a call (issue 33's target: at most 2% of TTFT, nothing
measurable per token): the same greedy request through chat completions, Anthropic Messages
and Ollama chat, interleaved (the order rotates each round), each prompt unique (no prefix
cache hits), timed at the client.

  python scripts/protocol_overhead.py [--rounds 40] [--tokens 1] [--model DIR]

--tokens 1 times a one-token call (TTFT plus the translation); --tokens 64 reports the time
per output token (chat completions with ignore_eos; the others may stop earlier, so compare
per token).
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.server_process import ServerProcess

PROTOCOLS = ("chat", "anthropic", "ollama")


def request(protocol: str, text: str, tokens: int, model: str) -> tuple[str, dict]:
    messages = [{"role": "user", "content": text}]
    if protocol == "chat":
        body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
        return "/v1/chat/completions", {**body, "ignore_eos": tokens > 1}
    if protocol == "anthropic":
        body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
        return "/v1/messages", body
    options = {"temperature": 0, "num_predict": tokens}
    return "/api/chat", {"model": model, "messages": messages, "stream": False, "options": options}


def output_tokens(body: dict) -> int:
    usage = body.get("usage", {})
    return usage.get("completion_tokens") or usage.get("output_tokens") or body["eval_count"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR))
    args = parser.parse_args()
    srv = ServerProcess("--priority-ttft-ms", "10000", model=args.model, max_model_len=1024)
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    times: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            for i in range(5):  # warm-up
                for p in PROTOCOLS:
                    path, body = request(p, f"warm {i} {p}", args.tokens, model)
                    client.post(path, json=body)
            for i in range(args.rounds):
                for p in PROTOCOLS[i % 3 :] + PROTOCOLS[: i % 3]:
                    path, body = request(
                        p, f"# round {i:03d} {p[0]}\ndef f(x):", args.tokens, model
                    )
                    start = time.perf_counter()
                    r = client.post(path, json=body)
                    elapsed = time.perf_counter() - start
                    r.raise_for_status()
                    times[p].append(elapsed / (output_tokens(r.json()) if args.tokens > 1 else 1))
    finally:
        srv.stop()
    unit = "ms/token" if args.tokens > 1 else "ms/call"
    base = statistics.median(times["chat"])
    for p, values in times.items():
        median = statistics.median(values)
        print(
            f"{p:10s} median {median * 1000:8.3f} {unit}  ({(median / base - 1) * 100:+.1f}% vs "
            f"chat)  mean {statistics.mean(values) * 1000:8.3f}  n={len(values)}"
        )


if __name__ == "__main__":
    main()
