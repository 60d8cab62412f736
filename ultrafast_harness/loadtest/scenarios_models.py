"""Model residency faults (docs/RELIABILITY.md 7b: F33, F34, F35, F36) against `serve --models`
with a resident budget, on the demo model ("code") and the demo draft model, which answer the
same prompt differently: a call served by the wrong model, or a stream cut or garbled by a
swap, changes the text, and every call's text is checked against its own model's
temperature-0 answer.

F33 streams the resident model while two other names take turns in the room that is left
(each call loads one and evicts the other, and a pair asked at once waits for each other).
F36 asks for a model larger than the budget, F34 for one whose files disappeared while it was
not resident (then came back): clean 503s naming the model, never a 500 or a hang, while the
default model's streams go on exact.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
import time
from pathlib import Path

from ultrafast.config import DEMO_DRAFT_DIR, DEMO_MODEL_DIR
from ultrafast.executors.fake_exec import FAULT_FATAL, fault_prompt
from ultrafast.model_files import resolve_model
from ultrafast.server.residency.budget import resident_bytes
from ultrafast_harness.loadtest.client import CallRecord, metric_total, plain_call, stream_call
from ultrafast_harness.loadtest.harness import Context, Result, ServerSpec
from ultrafast_harness.loadtest.invariants import check_content, check_rejection, check_terminal
from ultrafast_harness.loadtest.scenarios_load import client_for, fake_body, finish_checks

NUM_SLOTS, MAX_LEN = 4, 512
PROMPT = "def fibonacci(n):\n"
SERVE_FLAGS = ("--threads", "1", "--model-load-timeout-s", "60", "--no-preload")


def model_bytes(path: Path | str) -> int:
    """What the server charges the budget for this model (the same sizing as serve's)."""
    return resident_bytes(resolve_model(path), NUM_SLOTS, MAX_LEN)


def swap_spec() -> ServerSpec:
    """code (the default) stays; `b` and `c` (two names of the draft model) share what is left."""
    return _demo_models(
        (("code", str(DEMO_MODEL_DIR)), ("b", str(DEMO_DRAFT_DIR)), ("c", str(DEMO_DRAFT_DIR))),
        model_bytes(DEMO_MODEL_DIR) + model_bytes(DEMO_DRAFT_DIR) + 1,
    )


def _demo_models(models: tuple[tuple[str, str], ...], budget: int) -> ServerSpec:
    """`serve --models` on real (demo-sized) weights within `budget` bytes."""
    return ServerSpec(
        executor="demo",
        num_slots=NUM_SLOTS,
        max_model_len=MAX_LEN,
        extra=SERVE_FLAGS,
        models=models,
        max_resident_bytes=budget,
    )


_copies: dict[str, Path] = {}


def draft_copy() -> Path:
    """A copy of the draft model that F34 may take away (one per loadtest process)."""
    if "draft" not in _copies:
        root = Path(tempfile.mkdtemp(prefix="uf-models-"))
        atexit.register(shutil.rmtree, root, True)
        _copies["draft"] = root / "draft"
        shutil.copytree(DEMO_DRAFT_DIR, _copies["draft"])
    return _copies["draft"]


def fault_spec() -> ServerSpec:
    """`small` (the default) and `gone` fit together; `code` never fits the budget."""
    draft = model_bytes(DEMO_DRAFT_DIR)
    return _demo_models(
        (
            ("small", str(DEMO_DRAFT_DIR)),
            ("gone", str(draft_copy())),
            ("code", str(DEMO_MODEL_DIR)),
        ),
        2 * draft + 1,
    )


def body(model: str, tokens: int, **extra) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


async def answer(client, result: Result, model: str, tokens: int, tag: str, **extra) -> str:
    """One non-streamed call that must succeed; its text ("" when it failed, recorded)."""
    rec = await plain_call(client, body(model, tokens, **extra), tag)
    result.num_requests += 1
    if rec.status != 200:
        result.fail([f"{tag}: status {rec.status} {rec.error or rec.transport_error}"])
    return rec.text


async def model_status(client) -> dict[str, str]:
    data = (await client.get("/v1/models")).json()["data"]
    return {m["id"]: m["status"] for m in data}


class Streams:
    """Streams of one model, back to back, until stopped; each must equal `expected`."""

    def __init__(self, client, result: Result, model: str, tokens: int, expected: str):
        self.client, self.result, self.model = client, result, model
        self.tokens, self.expected = tokens, expected
        self.records: list[CallRecord] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _loop(self) -> None:
        while not self._stop.is_set():
            rec = await stream_call(self.client, body(self.model, self.tokens), self.model)
            self.result.num_requests += 1
            self.records.append(rec)
            if rec.status != 200:
                self.result.fail([f"{self.model} stream: status {rec.status} {rec.error}"])
                return
            self.result.fail(check_terminal(rec) + check_content(rec, self.expected, self.tokens))

    async def start(self, num: int) -> None:
        """Once one stream has ended, the loops keep `num` in flight: faults land mid-stream."""
        self._tasks = [asyncio.create_task(self._loop()) for _ in range(num)]
        for _ in range(1200):
            if self.records or all(t.done() for t in self._tasks):
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


# ---- F33: a swap under load ----------------------------------------------------------------


async def f33_swap_under_load(ctx: Context, result: Result) -> None:
    tokens, rounds = ctx.size(48, 24), ctx.size(12, 4)
    srv = ctx.server(swap_spec())
    async with client_for(srv.url) as client:
        code_text = await answer(client, result, "code", tokens, "code-baseline")
        draft_text = await answer(client, result, "b", tokens, "draft-baseline")
        if code_text == draft_text:
            result.fail(["code and the draft answer alike: a mix-up would not show"])
        evictions_before = await metric_total(client, "ultrafast_model_evictions")
        streams = Streams(client, result, "code", tokens, code_text)
        await streams.start(2)
        for i in range(rounds):  # b is loaded: each call loads the other, evicting this one
            name = "c" if i % 2 == 0 else "b"
            text = await answer(client, result, name, tokens, f"swap-{i}-{name}")
            if text and text != draft_text:
                result.fail([f"swap-{i}-{name}: not the draft model's answer"])
        # both at once: one waits until the other's call ends, then evicts it
        texts = await asyncio.gather(
            *(answer(client, result, name, tokens, f"pair-{name}") for name in ("b", "c"))
        )
        if any(t and t != draft_text for t in texts):
            result.fail(["a call of the pair got another model's answer"])
        await streams.stop()
        status = await model_status(client)
        if status["code"] != "loaded":
            result.fail([f"the streaming model is {status['code']}, want loaded"])
        evictions = await metric_total(client, "ultrafast_model_evictions") - evictions_before
        if evictions < rounds:
            result.fail([f"{evictions:.0f} evictions for {rounds} swaps"])
        result.metrics.update(
            swaps=rounds, evictions=evictions, code_streams=len(streams.records), status=status
        )
        await finish_checks(ctx, client, result)


# ---- F36: a model larger than the budget ----------------------------------------------------


async def f36_over_budget(ctx: Context, result: Result) -> None:
    tokens = ctx.size(32, 16)
    srv = ctx.server(fault_spec())
    async with client_for(srv.url) as client:
        small_text = await answer(client, result, "small", tokens, "small-baseline")
        streams = Streams(client, result, "small", tokens, small_text)
        await streams.start(2)
        calls = [
            plain_call(client, body("code", tokens), "code-plain"),
            stream_call(client, body("code", tokens), "code-stream"),
            plain_call(
                client,
                {"model": "code", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                "code-chat",
                path="/v1/chat/completions",
            ),
        ]
        for rec in await asyncio.gather(*calls):
            result.num_requests += 1
            result.fail(check_rejection(rec, 503, "model_exceeds_budget", retry_after=False))
            if rec.error and "'code'" not in rec.error.get("message", ""):
                result.fail([f"{rec.tag}: the 503 does not name the model"])
        rec = await plain_call(client, body("nope", 4), "unknown")
        result.num_requests += 1
        result.fail(check_rejection(rec, 404, "model_not_found", retry_after=False))
        if rec.error and "'nope'" not in rec.error.get("message", ""):
            result.fail(["the 404 does not name the model"])
        await streams.stop()
        status = await model_status(client)
        if status["code"] != "unloaded" or status["small"] != "loaded":
            result.fail([f"models after the refusals: {status}"])
        result.metrics.update(small_streams=len(streams.records), status=status)
        await finish_checks(ctx, client, result)


# ---- F34: a model's files disappear while it is not resident ---------------------------------


async def _until_status(client, name: str, want: str, timeout_s: float = 30.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if (await model_status(client))[name] == want:
            return True
        await asyncio.sleep(0.05)
    return False


async def f34_files_gone(ctx: Context, result: Result) -> None:
    tokens = ctx.size(32, 16)
    srv = ctx.server(fault_spec())
    path = draft_copy()
    hidden = path.with_name("draft-hidden")
    async with client_for(srv.url) as client:
        small_text = await answer(client, result, "small", tokens, "small-baseline")
        gone_text = await answer(client, result, "gone", tokens, "gone-first", keep_alive=0)
        if gone_text != small_text:  # the same weights: the same answer
            result.fail(["the copied model answers differently before its files went"])
        if not await _until_status(client, "gone", "unloaded"):
            result.fail(["keep_alive 0 did not unload the model"])
            return
        failures_before = await metric_total(client, "ultrafast_model_load_failures")
        streams = Streams(client, result, "small", tokens, small_text)
        await streams.start(2)
        path.rename(hidden)  # gone while not resident
        try:
            for rec in await asyncio.gather(
                plain_call(client, body("gone", tokens), "gone-plain"),
                stream_call(client, body("gone", tokens), "gone-stream"),
            ):
                result.num_requests += 1
                result.fail(check_rejection(rec, 503, "model_unavailable"))
                if rec.error and "'gone'" not in rec.error.get("message", ""):
                    result.fail([f"{rec.tag}: the 503 does not name the model"])
            ready = await client.get("/ready")
            if ready.status_code != 200:
                result.fail([f"/ready {ready.status_code} while one model is unavailable"])
        finally:
            hidden.rename(path)  # back: the next call retries the load
        text = await answer(client, result, "gone", tokens, "gone-back", keep_alive=0)
        if text and text != small_text:
            result.fail(["the model's answer after its files came back differs"])
        await streams.stop()
        failures = await metric_total(client, "ultrafast_model_load_failures") - failures_before
        if failures < 1:
            result.fail(["the failed load is not counted in ultrafast_model_load_failures"])
        result.metrics.update(load_failures=failures, small_streams=len(streams.records))
        await _until_status(client, "gone", "unloaded")
        await finish_checks(ctx, client, result)


# ---- F35: a resident model's engine dies ------------------------------------------------------


def engine_death_spec() -> ServerSpec:
    """The fake executor (it can be told to die) behind two names, a budget for one of them:
    each call for the other name evicts (stops) the resident engine on purpose."""
    return ServerSpec(
        executor="fake",
        num_slots=NUM_SLOTS,
        max_model_len=MAX_LEN,
        models=(("a", str(DEMO_MODEL_DIR)), ("b", str(DEMO_DRAFT_DIR))),
        max_resident_bytes=model_bytes(DEMO_MODEL_DIR) + 1,
    )


async def f35_engine_dies(ctx: Context, result: Result) -> None:
    srv = ctx.server(engine_death_spec(), fresh=True)
    try:
        async with client_for(srv.url) as client:
            for name in ("a", "b"):  # b's load evicts a: an engine stopped on purpose
                rec = await plain_call(client, {**fake_body(ctx, 4)[0], "model": name}, name)
                result.num_requests += 1
                if rec.status != 200:
                    result.fail([f"{name}: status {rec.status} {rec.error}"])
            status = await model_status(client)
            ready = await client.get("/ready")
            if status != {"a": "unloaded", "b": "loaded"} or ready.status_code != 200:
                result.fail([f"after an eviction: {status}, /ready {ready.status_code}"])
            inflight = [
                asyncio.create_task(
                    stream_call(client, {**fake_body(ctx, 200)[0], "model": "b"}, "victim")
                )
                for _ in range(3)
            ]
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            fatal = {
                "model": "b",
                "prompt": fault_prompt(FAULT_FATAL, 2, ctx.fake_prompt()),
                "max_tokens": 20,
                "ignore_eos": True,
            }
            killer = await stream_call(client, fatal, "fatal")
            recs = await asyncio.wait_for(asyncio.gather(*inflight), timeout=10)
            result.num_requests += 4
            for rec in recs + [killer]:
                if rec.status == 200 and rec.num_terminal != 1:
                    result.fail([f"{rec.tag}: {rec.num_terminal} terminal events after the death"])
                if rec.status not in (200, 500, 503):
                    result.fail([f"{rec.tag}: status {rec.status} after the engine died"])
        for _ in range(100):  # the server exits for its supervisor to restart it
            if not srv.alive:
                break
            await asyncio.sleep(0.1)
        result.metrics["exit_after_fatal_ms"] = round(1000 * (time.monotonic() - t0), 1)
        if srv.alive:
            result.fail(["the server keeps running after a resident model's engine died"])
        elif srv.proc.returncode == 0:
            result.fail(["the server exited 0 after a resident model's engine died"])
        result.metrics["exit_code"] = srv.proc.returncode
    finally:
        srv.stop()
