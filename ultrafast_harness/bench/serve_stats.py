"""The arithmetic and the tables of `ultrafast bench serve`: what one request's timing was, what a
phase of requests sums to, and the Markdown a report prints. Pure functions of timings, so the
unit tests feed them synthetic ones."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ultrafast_harness.bench.harness import percentiles_ms


@dataclass
class RequestResult:
    """One streamed request, times in seconds on one clock (perf_counter)."""

    start_s: float
    token_times_s: list[float] = field(default_factory=list)  # arrival of each content event
    num_tokens: int = 0  # the server's usage count when it sent one, else content events
    end_s: float | None = None
    error: str | None = None  # "HTTP 503: the default queue is full", "connection reset", ...
    max_tokens: int = 0  # what was asked (the burst mixes two sizes)
    prompt_tokens: int | None = None  # the server's usage count, when it sent one
    # the overload refusals answered by retrying (serve_client.stream_chat's `retries`), in
    # order; the request's times still count from its first send
    retried: list[str] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    @property
    def gaps_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s


def _p(values_s: list[float], q: str) -> float | None:
    p = percentiles_ms(values_s)
    return None if p is None else p[q]


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    """Aggregate tok/s over the phase's wall time, TTFT and inter-token latency percentiles,
    the errors grouped by message (status code included), and the requests that were refused
    and retried (`retried`, their refusals by message)."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tokens = sum(r.num_tokens for r in ok)
    prompt_sizes = sorted(r.prompt_tokens for r in ok if r.prompt_tokens is not None)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_messages": dict(Counter(r.error for r in results if r.error is not None)),
        "retried": sum(1 for r in results if r.retried),
        "retry_messages": dict(Counter(m for r in results for m in r.retried)),
        "tokens": tokens,
        "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_ms": _p(ttfts, "p50"),
        "ttft_p99_ms": _p(ttfts, "p99"),
        "itl_p50_ms": _p(gaps, "p50"),
        "itl_p99_ms": _p(gaps, "p99"),
        "prompt_tokens": prompt_sizes[len(prompt_sizes) // 2] if prompt_sizes else None,
        "samples": {
            "ttft_ms": [1000 * t for t in ttfts],
            "itl_ms": [1000 * g for g in gaps],
        },
    }


def merge_rounds(rounds: list[dict]) -> dict:
    """One level's rounds as one: tokens over summed wall time, percentiles over all samples."""
    ttfts = [t / 1000 for r in rounds for t in r["samples"]["ttft_ms"]]
    gaps = [g / 1000 for r in rounds for g in r["samples"]["itl_ms"]]
    errors: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    for r in rounds:
        errors.update(r["error_messages"])
        refusals.update(r.get("retry_messages", {}))
    wall = sum(r["wall_s"] for r in rounds)
    tokens = sum(r["tokens"] for r in rounds)
    prompt_sizes = [r["prompt_tokens"] for r in rounds if r.get("prompt_tokens") is not None]
    return {
        "rounds": len(rounds),
        # how long each round waited for a quiet machine, and how busy it was then
        "quiet_wait_s": max((r.get("quiet_wait_s", 0.0) for r in rounds), default=0.0),
        "busy_cores_before": max((r.get("busy_cores_before", 0.0) for r in rounds), default=0.0),
        "requests": sum(r["requests"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "error_messages": dict(errors),
        "retried": sum(r.get("retried", 0) for r in rounds),
        "retry_messages": dict(refusals),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": _p(ttfts, "p50"),
        "ttft_p99_ms": _p(ttfts, "p99"),
        "itl_p50_ms": _p(gaps, "p50"),
        "itl_p99_ms": _p(gaps, "p99"),
        "prompt_tokens": max(prompt_sizes) if prompt_sizes else None,  # as the server counted
        "samples": {"ttft_ms": [1000 * t for t in ttfts], "itl_ms": [1000 * g for g in gaps]},
    }


def summarize_burst(results: list[RequestResult], wall_s: float, short_tokens: int) -> dict:
    """The burst: the short requests' whole latency (they are one token: their latency is their
    TTFT plus the end of the stream), the long ones' TTFT and ITL, errors over both."""
    short = [r for r in results if r.max_tokens <= short_tokens]
    long = [r for r in results if r.max_tokens > short_tokens]
    short_lat = [r.latency_s for r in short if r.error is None and r.latency_s is not None]
    both = summarize(results, wall_s)
    return {
        "requests": len(results),
        "short_requests": len(short),
        "long_requests": len(long),
        "errors": both["errors"],
        "error_messages": both["error_messages"],
        "retried": both["retried"],
        "retry_messages": both["retry_messages"],
        "wall_s": wall_s,
        "tok_s": both["tok_s"],
        "short_latency_p50_ms": _p(short_lat, "p50"),
        "short_latency_p99_ms": _p(short_lat, "p99"),
        "long": {k: v for k, v in summarize(long, wall_s).items() if k != "samples"},
    }


def ratio(loaded: float | None, idle: float | None) -> float | None:
    return loaded / idle if loaded is not None and idle else None


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _errors_cell(summary: dict) -> str:
    """The errors by kind, then the requests served only after a retry (and their refusals):
    "0, 6 retried (7x HTTP 429: ...)"."""
    cell = "0"
    if summary["errors"]:
        kinds = "; ".join(f"{n}x {msg[:80]}" for msg, n in summary["error_messages"].items())
        cell = f"{summary['errors']} ({kinds})"
    if summary.get("retried"):
        refusals = summary.get("retry_messages", {})
        kinds = "; ".join(f"{n}x {msg[:80]}" for msg, n in refusals.items())
        cell += f", {summary['retried']} retried ({kinds})"
    return cell


def cpu_cell(cpu: dict | None) -> str:
    """ "Intel(R) Xeon(R) Processor, 2 cores: AMX, AVX512-BF16, VNNI" (what a row ran on)."""
    if not cpu:
        return "-"
    names = {"amx": "AMX", "avx512_bf16": "AVX512-BF16", "vnni": "VNNI"}
    have = [label for key, label in names.items() if cpu.get(f"cpu_{key}")]
    return f"{cpu.get('cpu_model', '?')}, {cpu.get('cores', '?')} cores: " + (
        ", ".join(have) or "no AMX, AVX512-BF16 or VNNI"
    )


def _retries_said(retries: int) -> str:
    if not retries:
        return "a refusal is an error (no client retry)"
    return (
        f"a 429/503 retried up to {retries}x as the OpenAI SDK does (TTFT from the first send; "
        "the errors column counts the retried)"
    )


def markdown(report: dict) -> str:
    """The report's tables: one row per server and level, the burst, startup and memory, and
    the priority probe of ours."""
    servers = report["servers"]
    lines = [
        f"model: {report['model']}; prompts ~{report['prompt_tokens']} tokens (chat), "
        f"{report['new_tokens']} new tokens per stream, EOS ignored; "
        f"{report['rounds']} round(s) per level; {report['cpu_count']} CPUs; "
        f"{report.get('order', 'one server at a time')}; "
        f"{_retries_said(report.get('client_retries', 0))}",
        f"CPU: {cpu_cell(report.get('cpu'))}; vLLM reference: "
        f"{report.get('vllm_reference') or '-'} (the better of its configurations)",
        "",
        "| server | configuration | precision | startup s | peak RSS MiB | peak PSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in servers.items():
        if "skipped" in s:
            lines.append(f"| {name} | skipped: {s['skipped'][:300]} | | | | |")
            continue
        lines.append(
            f"| {name} | {s.get('config', '-')} | {s['precision']} | {_f(s['startup_s'])} | "
            f"{_f(s['peak_rss_mib'], 0)} | {_f(s.get('peak_pss_mib'), 0)} |"
        )
    lines += [
        "",
        "| server | streams | prompt tokens | tok/s (aggregate) | TTFT p50 ms | TTFT p99 ms "
        "| ITL p99 ms | errors | CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in servers.items():
        for level, lv in s.get("levels", {}).items():
            lines.append(
                f"| {name} | {level} | {lv.get('prompt_tokens') or '-'} | {_f(lv['tok_s'])} | "
                f"{_f(lv['ttft_p50_ms'])} | "
                f"{_f(lv['ttft_p99_ms'])} | {_f(lv['itl_p99_ms'])} | {_errors_cell(lv)} | "
                f"{cpu_cell(lv.get('cpu'))} |"
            )
    bursts = {n: s["burst"] for n, s in servers.items() if s.get("burst")}
    if bursts:
        lines += [
            "",
            "| burst | requests | short p50 ms | short p99 ms | long TTFT p50 ms | "
            "long ITL p99 ms | errors | CPU |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, b in bursts.items():
            lines.append(
                f"| {name} | {b['short_requests']} x short + {b['long_requests']} x long | "
                f"{_f(b['short_latency_p50_ms'])} | {_f(b['short_latency_p99_ms'])} | "
                f"{_f(b['long']['ttft_p50_ms'])} | {_f(b['long']['itl_p99_ms'])} | "
                f"{_errors_cell(b)} | {cpu_cell(b.get('cpu'))} |"
            )
    probe = servers.get("ours", {}).get("priority_probe")
    if probe:
        idle, loaded = probe["idle"], probe["loaded"]
        lines += [
            "",
            f"ours, priority tier, idle vs under {probe['load_streams']} default-tier streams",
            "",
            "| | TTFT p50 ms | ITL p99 ms | errors |",
            "|---|---|---|---|",
            f"| idle | {_f(idle['ttft_p50_ms'])} | {_f(idle['itl_p99_ms'])} | "
            f"{_errors_cell(idle)} |",
            f"| loaded | {_f(loaded['ttft_p50_ms'])} | {_f(loaded['itl_p99_ms'])} | "
            f"{_errors_cell(loaded)} |",
            f"| loaded / idle | {_f(probe['ttft_p50_ratio'], 2)}x | "
            f"{_f(probe['itl_p99_ratio'], 2)}x | |",
        ]
    return "\n".join(lines)


def plot_samples(report: dict) -> dict:
    """latency_plot's input: {streams: {server: {"ttft_ms": [...], "itl_ms": [...]}}}."""
    samples: dict = {}
    for name, s in report["servers"].items():
        for level, lv in s.get("levels", {}).items():
            samples.setdefault(level, {})[name] = lv["samples"]
    return samples
