"""`ultrafast bench harness` (or bare `ultrafast bench`): ours vs peers on one model, side by side.

For every concurrency level (default 1, 4, 16) every runner (see `peers.py`) gets the same
prompts (distinct per stream and per round, so no prefix cache helps anyone), generates the
same number of tokens greedily with EOS ignored, and the runners are interleaved inside each
round, so drift on a shared machine hits all of them alike. Round 0 is a discarded warm-up.

Reported per (concurrency, runner): TTFT and per-token latency p50/p90/p99, aggregate tokens/s
(all streams' tokens / wall time) and per-stream decode tokens/s (first to last token); and
ours/peer ratios of those at the same concurrency. With `roofline=True`, each batch-1 decode
rate is also given as a fraction of the memory-bandwidth roofline (`roofline.py`).
Outputs: a JSON report, a Markdown table (printed, and written beside the JSON) and a PNG of
the latency distributions.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path
from typing import Any

from ultrafast.model_files import gguf_for, load_tokenizer, resolve_model
from ultrafast_harness.bench.peers import (
    Batch,
    EngineRunner,
    LlamaCppRunner,
    ServerRunner,
    TransformersRunner,
    VllmRunner,
)
from ultrafast_harness.bench.server_process import serve_default_threads

PROMPT_TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
OURS = ("ours-engine", "ours-engine-torch", "ours-server")
# pause before each run: the previous runner's spinning worker threads (OpenMP, ggml's pool)
# park instead of competing with the next one for the same cores
SETTLE_S = 0.2


def percentiles_ms(values_s: list[float]) -> dict | None:
    """p50/p90/p99 in ms (nearest rank); None when there is nothing to rank."""
    if not values_s:
        return None
    ranked = sorted(values_s)

    def rank(q: float) -> float:
        return 1000 * ranked[min(len(ranked) - 1, int(round(q / 100 * (len(ranked) - 1))))]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99)}


def make_prompts(base_ids: list[int], vocab_size: int, count: int, round_idx: int) -> list:
    """`count` prompts of equal length whose first two tokens differ per stream and round."""
    prompts = []
    for i in range(count):
        k = round_idx * 64 + i
        head = [16 + (k % 997) % (vocab_size - 16), 16 + (k // 997 + 7 * i) % (vocab_size - 16)]
        prompts.append(head + list(base_ids))
    return prompts


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def default_peers(cuda: bool) -> list[str]:
    peers = ["ours-engine", "ours-server", "llama.cpp", "transformers"]
    if cuda:
        peers.append("vllm" if importlib.util.find_spec("vllm") else "transformers-cuda")
    return peers


def build_runners(names: list[str], files, gguf: Path, opts: dict) -> tuple[dict, dict]:
    """Runner objects by name, and {name: why it was skipped} for those that could not start."""
    hf_dir = str(files.hf_dir) if files.hf_dir else None
    ours_model = str(files.hf_dir or gguf)

    def hf() -> str:  # the runners that read it start only when it exists (checked below)
        if hf_dir is None:
            raise ValueError("needs an HF directory")
        return hf_dir

    common = dict(
        num_slots=opts["num_slots"],
        max_model_len=opts["max_model_len"],
        threads=opts["threads"],
        compile=opts["compile"],
    )
    makers = {
        "ours-engine": lambda: EngineRunner("ours-engine", ours_model, opts["executor"], **common),
        "ours-engine-torch": lambda: EngineRunner(
            "ours-engine-torch", ours_model, "torch", **common
        ),
        "ours-server": lambda: ServerRunner(
            "ours-server",
            ours_model,
            opts["executor"],
            **{**common, "threads": opts["server_threads"]},
        ),
        "llama.cpp": lambda: LlamaCppRunner(str(gguf), opts["max_model_len"], opts["threads"]),
        "transformers": lambda: TransformersRunner(hf(), opts["threads"], "cpu"),
        "transformers-cuda": lambda: TransformersRunner(hf(), opts["threads"], "cuda"),
        "vllm": lambda: VllmRunner(hf(), opts["max_model_len"]),
    }
    runners, skipped = {}, {}
    for name in names:
        if name not in makers:
            raise ValueError(f"unknown runner {name!r}; choose from {', '.join(makers)}")
        needs_hf = name.startswith(("transformers", "vllm", "ours-engine-torch"))
        if needs_hf and hf_dir is None:
            skipped[name] = "needs an HF directory"
            continue
        try:
            runners[name] = makers[name]()
        except Exception as exc:  # a peer that cannot start is reported, not fatal
            skipped[name] = f"{type(exc).__name__}: {exc}"[:300]
    return runners, skipped


def summarize(batches: list[Batch]) -> dict:
    ttfts = [s.ttft_s for b in batches for s in b.streams if s.ttft_s is not None]
    gaps = [g for b in batches for s in b.streams for g in s.gaps_s]
    rates = [
        (len(s.token_times_s) - 1) / (s.token_times_s[-1] - s.token_times_s[0])
        for b in batches
        for s in b.streams
        if len(s.token_times_s) > 1 and s.token_times_s[-1] > s.token_times_s[0]
    ]
    num_tokens = sum(s.num_tokens for b in batches for s in b.streams)
    wall_s = sum(b.wall_s for b in batches)
    return {
        "ttft_ms": percentiles_ms(ttfts),
        "itl_ms": percentiles_ms(gaps),
        "tok_s": num_tokens / wall_s if wall_s else None,
        "decode_tok_s_per_stream": statistics.median(rates) if rates else None,
        "num_streams": sum(len(b.streams) for b in batches),
        "num_tokens": num_tokens,
        "samples": {"ttft_ms": [1000 * t for t in ttfts], "itl_ms": [1000 * g for g in gaps]},
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def ratios(level: dict) -> dict:
    """ours/peer at one concurrency: tokens/s (higher is better), latencies (lower is better)."""
    out = {}
    for ours in [n for n in level if n in OURS]:
        for peer in [n for n in level if n not in OURS]:
            o, p = level[ours], level[peer]
            out[f"{ours} / {peer}"] = {
                "tok_s": _ratio(o["tok_s"], p["tok_s"]),
                "ttft_p50": _ratio(
                    (o["ttft_ms"] or {}).get("p50"), (p["ttft_ms"] or {}).get("p50")
                ),
                "itl_p50": _ratio((o["itl_ms"] or {}).get("p50"), (p["itl_ms"] or {}).get("p50")),
            }
    return out


def measure(
    runners: dict,
    concurrency: list[int],
    base_ids: list[int],
    vocab_size: int,
    max_tokens: int,
    rounds: int,
    failed: dict[str, str],
) -> dict:
    """Summaries by concurrency and runner; a runner that fails is recorded in `failed` and
    dropped from the remaining runs (its earlier batches are dropped too: no partial rows)."""
    batches: dict[int, dict[str, list[Batch]]] = {c: {} for c in concurrency}
    for round_idx in range(rounds + 1):  # round 0 warms every runner and shape up
        for c in concurrency:
            prompts = make_prompts(base_ids, vocab_size, c, round_idx)
            for name, runner in runners.items():
                if name in failed or (
                    runner.max_concurrency is not None and c > runner.max_concurrency
                ):
                    continue
                time.sleep(SETTLE_S)
                try:
                    batch = runner.run(prompts, max_tokens)
                except Exception as exc:  # noqa: BLE001 - report the peer, keep the others
                    failed[name] = f"concurrency {c}: {type(exc).__name__}: {exc}"[:300]
                    continue
                if round_idx > 0:
                    batches[c].setdefault(name, []).append(batch)
    return {
        c: {n: summarize(b) for n, b in by_name.items() if n not in failed}
        for c, by_name in batches.items()
    }


def _decode_profile(name: str, executor: str, cuda: bool, gguf_type: str) -> tuple:
    """(device, bytes per weight, bytes per KV value) of a runner's decode."""
    from ultrafast_harness.bench.roofline import GGUF_BYTES_PER_WEIGHT

    if executor == "auto":
        executor = "torch" if cuda else "ggml"
    ours = name in ("ours-engine", "ours-server")
    if name == "llama.cpp" or (ours and executor == "ggml"):
        return "cpu", GGUF_BYTES_PER_WEIGHT[gguf_type], 2.0  # llama.cpp's KV cache is f16
    if name in ("transformers-cuda", "vllm") or (cuda and name != "transformers"):
        return "cuda", 2.0, 2.0  # bf16
    return "cpu", 4.0, 4.0  # fp32 on the CPU


def _add_roofline(report: dict, files, gguf_type: str, cuda: bool) -> None:
    from ultrafast.model.loader import read_config
    from ultrafast_harness.bench.roofline import (
        count_weight_params,
        kv_bytes_per_position,
        measure_bandwidth_gb_s,
        roofline,
    )

    config = read_config(files.hf_dir)
    num_params = count_weight_params(config)
    mean_context = report["prompt_tokens"] + report["max_tokens"] / 2
    bandwidth: dict[str, float] = {}
    out = {
        "bandwidth_gb_s": bandwidth,
        "num_weight_params": num_params,
        "mean_context_tokens": mean_context,
        "runners": {},
    }
    for name, r in report["results"].get(1, {}).items():
        device, weight_b, kv_b = _decode_profile(name, report["executor"], cuda, gguf_type)
        if device not in bandwidth:
            bandwidth[device] = measure_bandwidth_gb_s(device=device)
        line = roofline(
            int(num_params * weight_b),
            kv_bytes_per_position(config, kv_b),
            mean_context,
            bandwidth[device],
        )
        tok_s = r["decode_tok_s_per_stream"]
        out["runners"][name] = {
            "device": device,
            **line.as_dict(),
            "measured_tok_s": tok_s,
            "fraction": line.fraction(tok_s) if tok_s else None,
        }
    report["roofline"] = out


def run_harness(
    model: str,
    max_tokens: int = 128,
    rounds: int = 3,
    concurrency: tuple[int, ...] = (1, 4, 16),
    peers: list[str] | None = None,
    threads: int | None = None,
    prompt_tokens: int = 32,
    executor: str = "auto",
    compile: str = "auto",
    gguf_type: str = "f16",
    with_roofline: bool = False,
) -> dict:
    # the server keeps one core for its event loop and the clients, as `serve` does by default
    # (kernel threads spinning on every core starve it and slow HTTP streaming)
    server_threads = threads or serve_default_threads()
    threads = threads or len(os.sched_getaffinity(0))
    cuda = _gpu_available()
    files = resolve_model(model)
    gguf = gguf_for(files, gguf_type)
    tokenizer = load_tokenizer(files)
    base_ids = (tokenizer.encode(PROMPT_TEXT) * 16)[: max(1, prompt_tokens - 2)]
    vocab_size = tokenizer.vocab_size
    names = peers or default_peers(cuda)
    levels = sorted(set(concurrency))
    opts = {
        "num_slots": max(levels),
        "max_model_len": prompt_tokens + max_tokens + 16,
        "threads": threads,
        "server_threads": server_threads,
        "compile": compile,
        "executor": executor,
    }
    runners, skipped = build_runners(names, files, gguf, opts)
    try:
        results = measure(runners, levels, base_ids, vocab_size, max_tokens, rounds, skipped)
    finally:
        for runner in runners.values():
            runner.close()
    notes = {
        "llama.cpp": "llama.cpp: llama-cpp-python's generate cannot batch, so it runs at "
        "concurrency 1 only",
        "ours-server": f"ours-server: default tier, admission TTFT target raised to 600 s so "
        f"that no stream is refused; {server_threads} kernel thread(s) (the serve default)",
    }
    report: dict[str, Any] = {
        "model": files.name,
        "gguf": gguf.name,
        "threads": threads,
        "cuda": cuda,
        "executor": executor,
        "compile": compile,
        "max_tokens": max_tokens,
        "prompt_tokens": len(base_ids) + 2,
        "rounds": rounds,
        "concurrency": levels,
        "runners": list(runners),
        "skipped": skipped,
        "notes": {n: v for n, v in notes.items() if n in runners},
        "results": results,
        "ratios": {c: ratios(level) for c, level in results.items()},
    }
    if with_roofline and files.hf_dir is None:
        report["notes"]["roofline"] = "roofline: needs the model's config.json (an HF dir)"
    elif with_roofline:
        _add_roofline(report, files, gguf_type, cuda)
    return report
