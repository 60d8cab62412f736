"""The "nothing lost" checks of docs/RELIABILITY.md, run after every load or fault scenario.

(i) every accepted call ended with exactly one terminal event and one [DONE], and no bytes
followed; (ii) the text received is exactly the expected token sequence (the fake executor's
known output, or the non-streamed answer at temperature 0) and `usage.completion_tokens` is its
length; (iii) at rest the server has nothing running or waiting, every KV slot free and every
admission seat released; plus server memory (RssAnon + VmSwap) growth after warm-up.
Each check returns a list of human-readable violations (empty = pass).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx

from ultrafast_harness.loadtest.client import CallRecord


def check_terminal(
    rec: CallRecord, allowed_finish: tuple[str, ...] = ("length", "stop")
) -> list[str]:
    """(i) for one accepted (200) streamed call that the client read to the end."""
    where = f"{rec.tag} call"
    problems = []
    if rec.transport_error:
        return [f"{where}: transport error {rec.transport_error}"]
    if rec.num_terminal != 1:
        problems.append(f"{where}: {rec.num_terminal} terminal events (want exactly 1)")
    if rec.num_done != 1:
        problems.append(f"{where}: {rec.num_done} [DONE] (want exactly 1)")
    if rec.bytes_after_done:
        problems.append(f"{where}: {rec.bytes_after_done} bytes after [DONE]")
    bad = [f for f in rec.finish_reasons if f not in allowed_finish]
    if bad:
        problems.append(f"{where}: finish_reason {bad[0]!r} (allowed {allowed_finish})")
    return problems


def check_content(rec: CallRecord, expected_text: str, expected_tokens: int | None) -> list[str]:
    """(ii): the exact text, and the usage count of a call that ran to its end."""
    where = f"{rec.tag} call"
    problems = []
    if rec.text != expected_text:
        cut = next(
            (i for i, (a, b) in enumerate(zip(rec.text, expected_text)) if a != b),
            min(len(rec.text), len(expected_text)),
        )
        problems.append(
            f"{where}: text differs from the expected at char {cut} (got "
            f"{len(rec.text)} chars, want {len(expected_text)}): lost, duplicated "
            f"or reordered tokens"
        )
    got_tokens = (rec.usage or {}).get("completion_tokens")
    if expected_tokens is not None and got_tokens != expected_tokens:
        problems.append(f"{where}: usage.completion_tokens={got_tokens}, want {expected_tokens}")
    return problems


def check_rejection(rec: CallRecord, status: int, code: str, retry_after: bool = True) -> list[str]:
    where = f"{rec.tag} call"
    if rec.status != status:
        return [f"{where}: status {rec.status}, want {status} {code}"]
    problems = []
    if not rec.error or set(rec.error) != {"message", "type", "param", "code"}:
        problems.append(f"{where}: the {status} body is not the OpenAI error envelope")
    elif rec.error["code"] != code:
        problems.append(f"{where}: error code {rec.error['code']!r}, want {code!r}")
    if retry_after:
        value = rec.headers.get("retry-after", "")
        if not value.isdigit() or int(value) < 1:
            problems.append(f"{where}: Retry-After {value!r}, want an integer >= 1")
    return problems


async def wait_at_rest(
    client: httpx.AsyncClient, timeout_s: float = 10.0
) -> tuple[list[str], dict]:
    """(iii): poll /ready until nothing runs, waits or holds a slot or seat."""
    deadline = time.monotonic() + timeout_s
    state: dict = {}
    while True:
        try:
            state = (await client.get("/ready", timeout=5)).json()
        except (httpx.HTTPError, ValueError) as exc:
            state = {"status": f"unreachable: {type(exc).__name__}"}
        busy = _busy(state)
        if not busy:
            return [], state
        if time.monotonic() > deadline:
            return [f"not at rest {timeout_s:.0f} s after the load: {', '.join(busy)}"], state
        await asyncio.sleep(0.05)


def _busy(state: dict) -> list[str]:
    if state.get("status") != "ready":
        return [f"/ready status {state.get('status')!r}"]
    busy = [f"{k}={state.get(k)}" for k in ("running", "waiting", "kv_slots_busy") if state.get(k)]
    busy += [f"in_flight[{t}]={n}" for t, n in (state.get("in_flight") or {}).items() if n]
    return busy


def mem_kib(pid: int) -> int:
    """RssAnon + VmSwap of a process (RSS alone hides swapped and counts file pages)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmSwap", "VmRSS"):
                fields[key] = int(value.split()[0])
    return fields.get("RssAnon", fields.get("VmRSS", 0)) + fields.get("VmSwap", 0)


def num_fds(pid: int) -> int:
    import os

    return len(os.listdir(f"/proc/{pid}/fd"))


async def check_fds_back(
    pid: int, baseline: int, tolerance: int = 5, wait_s: float = 3.0
) -> tuple[list[str], int]:
    """(iii) open file descriptors back to the baseline (+-tolerance) once clients are gone."""
    deadline = time.monotonic() + wait_s
    while True:
        now = num_fds(pid)
        if now <= baseline + tolerance or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    if now > baseline + tolerance:
        return [
            f"server holds {now} file descriptors at rest, baseline {baseline} "
            f"(tolerance {tolerance}): leaked sockets or files"
        ], now
    return [], now


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    import os

    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class MemoryWatch:
    """Memory after warm-up vs at the end; `limit_mib` is the pass threshold."""

    pid: int | None
    limit_mib: float = 20.0
    warm_kib: int | None = None
    end_kib: int | None = None

    def warm(self) -> None:
        if self.pid:
            self.warm_kib = mem_kib(self.pid)

    def end(self) -> list[str]:
        if not self.pid or self.warm_kib is None:
            return []
        self.end_kib = mem_kib(self.pid)
        growth_mib = (self.end_kib - self.warm_kib) / 1024
        if growth_mib >= self.limit_mib:
            return [
                f"server memory grew {growth_mib:.1f} MiB after warm-up "
                f"(limit {self.limit_mib:.0f} MiB)"
            ]
        return []

    def summary(self) -> dict:
        if self.warm_kib is None or self.end_kib is None:
            return {}
        return {
            "mem_warm_mib": round(self.warm_kib / 1024, 1),
            "mem_end_mib": round(self.end_kib / 1024, 1),
            "mem_growth_mib": round((self.end_kib - self.warm_kib) / 1024, 2),
        }


def percentiles_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"n": 0}
    v = sorted(values_s)

    def q(p: float) -> float:
        return round(1000 * v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))], 2)

    return {"n": len(v), "p50_ms": q(50), "p99_ms": q(99), "max_ms": round(1000 * v[-1], 2)}
