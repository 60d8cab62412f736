"""`ultrafast bench gpu`: the GPU check, in one short command (under 5 minutes on an H200).

A Llama-3.2-1B-shaped model with dummy bf16 weights (hidden 2048, 16 layers, 32 heads, 8 KV
heads, intermediate 8192, vocab 128256, tied embeddings) decodes at batch 1 through our whole
engine (scheduler, executor, sampler), once per decode mode: eager, CUDA graphs of the eager
kernels, CUDA graphs of the inductor-compiled step. Each rate is given as a fraction of the HBM
roofline (weight + KV bytes per token / measured read bandwidth). transformers `generate` on
the same weights is the peer when it is installed. Then `pytest tests/gpu`. Phases that would
overrun the time budget are skipped and say so; a machine without torch or CUDA says so.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ultrafast_harness.bench.suite_args import add_compile, add_out, add_rounds

LLAMA_1B_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "torch_dtype": "bfloat16",
}


def _environment() -> dict:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": False, "why": "torch is not installed on this machine"}
    env: dict[str, object] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda": torch.cuda.is_available(),
    }
    if not env["cuda"]:
        env["why"] = (
            f"torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})"
        )
        return env
    props = torch.cuda.get_device_properties(0)
    env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    for name in ("transformers", "vllm", "sglang", "triton"):
        try:  # the installed version, without importing (vllm/sglang imports take seconds)
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    return env


def _decode_rate(
    model, mode: str, prompt_len: int, num_decode: int, rounds: int, device: str = "cuda"
) -> dict:
    """Batch-1 decode through EngineCore; the first (warm-up) request compiles and captures.
    (device is a parameter so the CPU test suite can run this exact code on a tiny model.)"""
    import torch

    from ultrafast.core.scheduler import SchedulerConfig
    from ultrafast.engine.core import EngineCore
    from ultrafast.executors.torch_exec import TorchExecutor
    from ultrafast.request import Request, SamplingParams

    max_len = 1024
    executor = TorchExecutor(model, num_slots=1, max_model_len=max_len, device=device, compile=mode)
    core = EngineCore(executor, SchedulerConfig(max_num_seqs=1, max_model_len=max_len))
    params = SamplingParams(temperature=0.0, max_tokens=num_decode + 1, ignore_eos=True)
    vocab = executor.vocab_size
    prompt = [(i * 7919) % (vocab - 8) + 4 for i in range(prompt_len)]
    rates, ttfts, exec_s, num_steps = [], [], 0.0, 0
    warmup_s = 0.0
    for i in range(rounds + 1):
        core.pool.reset_cache()
        start = time.perf_counter()
        core.add_request(Request(f"gpu-{mode}-{i}", prompt, params))
        stamps = []
        while core.has_work():
            if any(o.new_token_ids for o in core.step()):
                stamps.append(time.perf_counter())
                stats = core.last_stats
                if i and len(stamps) > 1 and stats is not None:
                    exec_s += stats.execute_time_s + stats.sample_time_s
                    num_steps += 1
        if i == 0:
            warmup_s = time.perf_counter() - start
            continue
        ttfts.append(stamps[0] - start)
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    decode = executor.decode
    out = {
        "mode": mode,
        "decode_tok_s": max(rates),
        "decode_tok_s_rounds": rates,
        "ttft_ms": 1000 * min(ttfts),
        "warmup_s": warmup_s,
        "executor_ms_per_token": 1000 * exec_s / max(1, num_steps),
        "compiled_steps": decode.num_steps if decode else 0,
        "compiled_disabled": decode.disabled_reason if decode else None,
    }
    executor.close()
    del core
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _transformers_rate(
    model, prompt_len: int, num_decode: int, shape: dict = LLAMA_1B_SHAPE, device: str = "cuda"
) -> dict:
    """transformers generate on the same weights (state dict names match HF's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ultrafast_harness.bench.peers import _StampStreamer

    config = LlamaConfig(
        **{k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype")}
    )
    with torch.device(device):  # (no dtype= keyword: its name differs across versions)
        hf = LlamaForCausalLM(config).to(model.lm_head.weight.dtype)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weights do not map onto transformers: {missing} {unexpected}")
    hf.eval()
    vocab = shape["vocab_size"]
    ids = torch.tensor([[(i * 7919) % (vocab - 8) + 4 for i in range(prompt_len)]], device=device)
    rates = []
    for _ in range(2):  # the first run warms the kernels up
        streamer = _StampStreamer(time.perf_counter())
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_decode,
                min_new_tokens=num_decode,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        t = streamer.stamps_s
        rates.append((len(t) - 1) / (t[-1] - t[0]))
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"decode_tok_s": rates[-1]}


def _roofline(prompt_len: int, num_decode: int) -> dict:
    from ultrafast.model.config import ModelConfig
    from ultrafast_harness.bench.roofline import (
        count_weight_params,
        kv_bytes_per_position,
        measure_bandwidth_gb_s,
        roofline,
    )

    config = ModelConfig.from_hf(LLAMA_1B_SHAPE)
    line = roofline(
        2 * count_weight_params(config),
        kv_bytes_per_position(config, 2.0),
        prompt_len + num_decode / 2,
        measure_bandwidth_gb_s(device="cuda"),
    )
    return line.as_dict()


def _run_gpu_tests(timeout_s: float) -> dict:
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"]
    try:
        done = subprocess.run(
            cmd,
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONPATH": str(repo)},
        )
    except subprocess.TimeoutExpired:
        return {"rc": None, "tail": f"timed out after {timeout_s:.0f} s"}
    return {"rc": done.returncode, "tail": (done.stdout + done.stderr)[-3000:]}


def markdown(report: dict) -> str:
    env = report["environment"]
    if not env.get("cuda"):
        return f"GPU check not run: {env.get('why')}"
    roof = report.get("roofline") or {}
    lines = [
        f"{env['gpu']} ({env['gpu_memory_gib']} GiB), torch {env['torch']} (CUDA "
        f"{env['torch_cuda']}); Llama-3.2-1B-shaped dummy bf16, batch 1, "
        f"{report['prompt_tokens']} prompt tokens, {report['decode_tokens']} decoded",
        "",
    ]
    if roof:
        lines += [
            f"HBM roofline: {roof['bytes_per_token'] / 1e9:.3f} GB/token at "
            f"{roof['bandwidth_gb_s']:.0f} GB/s measured = {roof['roofline_tok_s']:.0f} "
            "tok/s",
            "",
        ]
    lines += [
        "| decode | tok/s | of roofline | executor ms/token | TTFT ms | warm-up s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["modes"].items():
        if "error" in r or "skipped" in r:
            lines.append(f"| {name} | {r.get('error') or r.get('skipped')} | | | | |")
            continue
        frac = r["decode_tok_s"] / roof["roofline_tok_s"] if roof else None
        lines.append(
            f"| {name} | {r['decode_tok_s']:.1f} | "
            f"{'' if frac is None else f'{100 * frac:.1f}%'} | "
            f"{r.get('executor_ms_per_token', float('nan')):.3f} | "
            f"{r.get('ttft_ms', float('nan')):.1f} | {r.get('warmup_s', 0):.1f} |"
        )
    tests = report.get("tests")
    if tests:
        lines += ["", f"tests/gpu: rc {tests['rc']}", "", "```", tests["tail"][-800:], "```"]
    return "\n".join(lines)


def main(args) -> int:
    started = time.monotonic()
    budget_s = 280.0  # the whole check, under 5 minutes

    def left_s() -> float:
        return budget_s - (time.monotonic() - started)

    prompt_len, num_decode = args.prompt_tokens, args.decode_tokens
    report: dict = {
        "environment": _environment(),
        "prompt_tokens": prompt_len,
        "decode_tokens": num_decode,
        "modes": {},
    }
    if report["environment"].get("cuda"):
        import torch

        from ultrafast.model.loader import build_dummy_model

        model = build_dummy_model(LLAMA_1B_SHAPE, dtype="bfloat16", device="cuda")
        report["roofline"] = _roofline(prompt_len, num_decode)
        modes = ["off", "graphs", "inductor"] if args.compile == "auto" else ["off", args.compile]
        for mode in modes:
            if left_s() < (150 if mode == "inductor" else 40):
                report["modes"][mode] = {"skipped": "time budget"}
                continue
            try:
                report["modes"][mode] = _decode_rate(
                    model, mode, prompt_len, num_decode, rounds=max(1, args.rounds)
                )
            except Exception as exc:  # noqa: BLE001 - report and carry on with the next mode
                report["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(
                f"[{time.monotonic() - started:.0f} s] {mode}: {report['modes'][mode]}", flush=True
            )
        if report["environment"].get("transformers") and left_s() > 60:
            try:
                report["modes"]["transformers"] = _transformers_rate(
                    model, prompt_len, min(num_decode, 128)
                )
            except Exception as exc:  # noqa: BLE001
                report["modes"]["transformers"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        del model
        torch.cuda.empty_cache()
        if not args.skip_tests:
            report["tests"] = _run_gpu_tests(max(30.0, left_s()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    table = markdown(report)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out} and {out.with_suffix('.md')} in {time.monotonic() - started:.0f} s")
    if not report["environment"].get("cuda"):
        return 1
    tests_ok = report.get("tests", {"rc": 0})["rc"] == 0
    modes_ok = all("error" not in r for r in report["modes"].values())
    return 0 if tests_ok and modes_ok else 1


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench gpu_check --help`)."""
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (default 128)")
    p.add_argument(
        "--decode-tokens", type=int, default=256, help="decode steps timed per mode (default 256)"
    )
    add_compile(
        p,
        "decode modes timed beside eager: auto = CUDA graphs and inductor; "
        "inductor or graphs = that one only",
    )
    add_rounds(p, 3)
    p.add_argument("--skip-tests", action="store_true", help="do not run tests/gpu")
    add_out(p, "runs/bench_gpu.json")
