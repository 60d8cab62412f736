"""Two checkouts' servers under one fixed client: N concurrent streamed chat requests (distinct
~100-token prompts, 128 tokens each, EOS ignored, greedy), optionally after the warm-up `bench
serve` sends (8 short prompts at once), alternating the checkouts round by round.

Why: `bench serve` itself changed between the checkouts a before/after compares (the harness
moved, a warm-up was added), so its two runs differ on the client side too. Here only the
server differs: each checkout's `ultrafast serve` is started from its own tree (PYTHONPATH).

  python scripts/serve_same_client.py BEFORE_TREE AFTER_TREE [--rounds 2] [--streams 16]
      [--warm-up] [--model GGUF] [-- extra serve flags, e.g. --wide-pass off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / "runs/models/smollm2/SmolLM2-135M-Instruct.bf16.gguf"
FILLER = " ".join(f"item{j} is listed with value {j * 7 % 13}" for j in range(14))


async def _stream(client, port: int, body: dict) -> tuple[float, float | None, int]:
    started, first, tokens = time.perf_counter(), None, 0
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    async with client.stream("POST", url, json=body, timeout=600) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                tokens += 1
                first = first if first is not None else time.perf_counter() - started
    return started, first, tokens


def _body(text: str, max_tokens: int, stream: bool = True) -> dict:
    messages = [{"role": "user", "content": f"{text}: summarize this list. {FILLER}"}]
    return {
        "model": "bench",
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }


async def load(port: int, streams: int, warm_up: bool) -> tuple[float, float]:
    """Aggregate tok/s and TTFT p50 (ms) of `streams` requests sent at once."""
    async with httpx.AsyncClient() as client:
        await _stream(client, port, _body("Warm", 8))
        if warm_up:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            await asyncio.gather(
                *[client.post(url, json=_body(f"Warm {i}", 8, False)) for i in range(8)]
            )
            await _wide_settled(client, port)
        started = time.perf_counter()
        runs = await asyncio.gather(
            *[_stream(client, port, _body(f"Request {i}", 128)) for i in range(streams)]
        )
        elapsed = time.perf_counter() - started
    ttfts = sorted(first or 0.0 for _, first, _ in runs)
    return sum(n for _, _, n in runs) / elapsed, ttfts[len(ttfts) // 2] * 1000


async def _wide_settled(client, port: int, timeout_s: float = 180) -> None:
    """Until /ready's wide path has left its loading and timing states (as `bench serve`
    waits), so the level does not run beside them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = (await client.get(f"http://127.0.0.1:{port}/ready")).json().get("wide_pass")
        if not state or not str(state).startswith(("loading", "weights loaded")):
            return
        await asyncio.sleep(0.25)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(tree: Path, model: Path, extra: list[str], streams: int, warm_up: bool):
    port = _free_port()
    argv = [sys.executable, "-m", "ultrafast.cli", "serve", str(model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--served-model-name", "bench", *extra]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        time.sleep(3)  # the start's own background work settles
        return asyncio.run(load(port, streams, warm_up))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    for r in range(args.rounds):
        order = [("before", args.before), ("after", args.after)]
        for name, tree in order if r % 2 == 0 else order[::-1]:
            tok_s, ttft = run_once(tree, args.model, extra, args.streams, args.warm_up)
            print(f"round {r} {name}: {tok_s:.1f} tok/s, TTFT p50 {ttft:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
