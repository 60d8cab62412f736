"""`ultrafast bench startup`: time to first answer and memory of a fresh server, ours beside
llama-cpp-python's server (`python -m llama_cpp.server`) on the same GGUF file.

For each server, `--starts` starts one after another: the process is spawned, and a short chat
request (a few tokens, greedy) is sent every POLL_S until one is answered with text; the time
from the spawn to that answer is the time to first answer, as a user who starts the server and
asks at once sees it (a refused connection or a 503 while loading are retried). Then, after the
server has settled for SETTLE_S, its idle RSS and PSS summed over its process tree.

Ours: the first start runs with an empty cache directory (`cold`: nothing measured before, so
the start costs are measured in the background while it serves), the later ones with the cache
the first one filled (`warm`). llama.cpp's server has no cache of its own: its starts differ
only by the OS page cache, as ours do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ultrafast.cpu_info import describe_cpu
from ultrafast_harness.bench.serve_servers import pss_bytes, rss_bytes, tree_pids
from ultrafast_harness.bench.server_process import free_port, wait_start_costs
from ultrafast_harness.bench.suite_args import add_out

POLL_S = 0.05
SETTLE_S = 2.0
QUESTION = "What is the capital of France?"


@dataclasses.dataclass
class StartResult:
    server: str
    start: str  # cold / warm
    first_answer_s: float | None
    idle_rss_mib: float | None
    idle_pss_mib: float | None
    error: str | None = None
    start_costs: str | None = None  # ours: cached / measured / contended (never cached)
    cpu_s: float | None = None  # CPU seconds the server used up to its first answer
    wide_pass: str | None = None  # ours: the wide path's state when idle (by need, on, off)


def ours_argv(gguf: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "ultrafast.cli", "serve", str(gguf), "--port", str(port)]


def llama_cpp_argv(gguf: Path, port: int) -> list[str]:
    threads = str(len(os.sched_getaffinity(0)))
    return [
        sys.executable,
        "-m",
        "ultrafast_harness.bench.llama_server_peer",  # llama_cpp.server, AMX buffers off as ours
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        threads,
        "--n_threads_batch",
        threads,
    ]


def first_answer_s(url: str, proc: subprocess.Popen, started: float, timeout_s: float) -> float:
    """Seconds from `started` to the first chat answer with text; RuntimeError if the process
    exits or `timeout_s` passes first."""
    body = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 8,
        "temperature": 0,
    }
    deadline = started + timeout_s
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with {proc.returncode} before answering")
            try:
                r = client.post("/v1/chat/completions", json=body)
                if r.status_code == 200 and r.json()["choices"][0]["message"].get("content"):
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(POLL_S)
    raise RuntimeError(f"no answer in {timeout_s:.0f} s")


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds the process tree has used: on a busy machine, where the wall
    time to the first answer mostly waits for a core, about what it takes on a quiet one."""
    total = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def tree_memory_mib(pid: int) -> tuple[float, float]:
    pids = tree_pids(pid)
    return (
        sum(rss_bytes(p) for p in pids) / 2**20,
        sum(pss_bytes(p) for p in pids) / 2**20,
    )


def one_start(
    name: str, start: str, argv: list[str], port: int, env: dict, timeout_s: float, log: Path
) -> StartResult:
    with open(log, "a") as out:
        out.write(f"\n=== {name} {start}: {' '.join(argv)}\n")
        out.flush()
        started = time.perf_counter()
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            ttfa = first_answer_s(url, proc, started, timeout_s)
            cpu_s = tree_cpu_s(proc.pid)
            time.sleep(SETTLE_S)
            rss, pss = tree_memory_mib(proc.pid)
            ready: dict = {}
            if name == "ours":  # the next start is warm only once they are in the cache
                wait_start_costs(url, timeout_s)
                ready = httpx.get(url + "/ready", timeout=10).json()
            return StartResult(
                name,
                start,
                ttfa,
                rss,
                pss,
                start_costs=ready.get("start_costs"),
                cpu_s=cpu_s,
                wide_pass=ready.get("wide_pass"),
            )
        except RuntimeError as exc:
            return StartResult(name, start, None, None, None, str(exc))
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def llama_cpp_server_missing() -> str | None:
    probe = [sys.executable, "-c", "import llama_cpp.server.app"]
    done = subprocess.run(probe, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["?"])[-1]
    return f"llama_cpp.server is not importable ({last}): pip install 'llama-cpp-python[server]'"


def run(gguf: Path, starts: int, servers: list[str], timeout_s: float, log: Path) -> dict:
    results: list[StartResult] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="ultrafast-startup-cache-") as cache:
        env = {"ULTRAFAST_CACHE_DIR": cache, "ULTRAFAST_SMOLLM2_GGUF": str(gguf)}
        for i in range(starts):
            kind = "cold" if i == 0 else "warm"
            if "ours" in servers:
                port = free_port()
                results.append(
                    one_start("ours", kind, ours_argv(gguf, port), port, env, timeout_s, log)
                )
            if "llama.cpp" in servers:
                missing = llama_cpp_server_missing()
                if missing:
                    skipped["llama.cpp"] = missing
                    continue
                port = free_port()
                argv = llama_cpp_argv(gguf, port)
                results.append(one_start("llama.cpp", kind, argv, port, {}, timeout_s, log))
    return {
        "model": str(gguf),
        "cpu": describe_cpu(),
        "starts": [dataclasses.asdict(r) for r in results],
        "skipped": skipped,
        "note": "cold: ours with an empty cache directory; warm: with the cache the cold start "
        "filled. Both servers alternate, one at a time.",
    }


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _short(wide_pass: str | None) -> str:
    """The wide path's state without its reason: by need, loading, weights loaded, on, off."""
    if not wide_pass:
        return "-"
    states = ("by need", "loading", "weights loaded", "on", "off")
    state = next((s for s in states if wide_pass.startswith(s)), wide_pass)
    return f"{state} (cached)" if "cached" in wide_pass else state


def markdown(report: dict) -> str:
    lines = [
        f"model: {report['model']}; CPU: {report['cpu']['cpu_model']}, "
        f"{report['cpu']['cores']} cores",
        "",
        "| server | start | first answer s | CPU s to it | idle RSS MiB | idle PSS MiB "
        "| start costs | wide path | error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["starts"]:
        lines.append(
            f"| {r['server']} | {r['start']} | {_f(r['first_answer_s'])} | {_f(r['cpu_s'])} | "
            f"{_f(r['idle_rss_mib'], 0)} | {_f(r['idle_pss_mib'], 0)} | "
            f"{r.get('start_costs') or '-'} | {_short(r.get('wide_pass'))} | {r['error'] or ''} |"
        )
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped | | | | | | | {why} |")
    return "\n".join(lines)


def main(args) -> int:
    from ultrafast.config import default_model_choice

    gguf = Path(args.gguf or default_model_choice().path)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is not a GGUF file: `make setup` fetches the default")
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = run(gguf, args.starts, servers, args.timeout_s, out.with_suffix(".log"))
    out.write_text(json.dumps(report, indent=2))
    text = markdown(report)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out}, {out.with_suffix('.md')}")
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench startup_bench --help`)."""
    p.add_argument(
        "--gguf",
        default=None,
        help="the GGUF file both serve (default: the default chat model, SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--servers",
        default="ours,llama.cpp",
        help="comma-separated from ours, llama.cpp (default both)",
    )
    p.add_argument(
        "--starts", type=int, default=3, help="starts per server: 1 cold, then warm (default 3)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="per start, to the first answer (300)"
    )
    add_out(p, "runs/bench_startup.json")
