"""`ultrafast quantize` and `ultrafast eval-ppl`: offline quantization of an HF model directory
into the torch format (saved.py) and/or a GGUF (gguf_export.py), and held-out perplexity of
any model path, side by side with full precision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCHEMES = ("int8", "int4", "hybrid")


def add_parsers(sub) -> None:
    q = sub.add_parser(
        "quantize",
        help="weight-only int8 / int4 / hybrid quantization",
        description="Quantize an HF model directory (weights only). hybrid keeps "
        "the tensors measured most sensitive on calibration text in 16-bit and "
        "the rest int4; the per-tensor plan is written to quantization.json.",
    )
    q.add_argument("model_dir", help="full-precision HF directory (config.json + safetensors)")
    q.add_argument("--scheme", choices=SCHEMES, required=True)
    q.add_argument(
        "--format",
        choices=("torch", "gguf", "both"),
        default="both",
        help="torch: safetensors + quantization.json (torch executor); gguf: "
        "q8_0 / q4_0 / f16 per tensor (ggml executor); both: one directory with both",
    )
    q.add_argument(
        "--out",
        default=None,
        help="output directory (default runs/quant/MODEL-SCHEME); with --format gguf "
        "a path ending in .gguf names the file",
    )
    q.add_argument(
        "--group-size", type=int, default=32, help="int4 group length (GGUF q4 blocks need 32)"
    )
    q.add_argument(
        "--zero-point",
        action="store_true",
        help="int4 with a per-group minimum (GGUF q4_1) instead of symmetric (q4_0)",
    )
    q.add_argument(
        "--calibration",
        default=None,
        help="hybrid: calibration text file (default: training-split stdlib files)",
    )
    q.add_argument("--calibration-tokens", type=int, default=1024)
    q.add_argument(
        "--recover",
        type=float,
        default=0.5,
        help="hybrid: keep tensors in 16-bit until this fraction of int4's "
        "perplexity excess is recovered on calibration text",
    )
    q.add_argument(
        "--max-ppl-ratio",
        type=float,
        default=1.03,
        help="hybrid: and at least until calibration perplexity <= this x fp",
    )
    q.add_argument(
        "--max-keep-fraction",
        type=float,
        default=0.15,
        help="hybrid: at most this fraction of weight parameters in 16-bit",
    )
    q.add_argument(
        "--keep-type",
        choices=("f16", "int8"),
        default="f16",
        help="hybrid: the type of the sensitive tensors (int8 = GGUF q8_0)",
    )
    q.add_argument(
        "--gguf-int4",
        choices=("q4_0", "q4_K_M", "q4_K_S"),
        default="q4_0",
        help="GGUF type of the int4 tensors: q4_0/q4_1 written from our codes, or "
        "llama.cpp's k-quants (its own quantizer and fallbacks; the plan's 16-bit "
        "and int8 tensors become per-tensor overrides)",
    )
    q.add_argument(
        "--eval",
        action="store_true",
        help="report held-out perplexity of fp and the quantized model(s)",
    )
    _add_eval_args(q)
    q.set_defaults(func=cmd_quantize)

    e = sub.add_parser("eval-ppl", help="held-out perplexity of models, side by side")
    e.add_argument("models", nargs="+", help="HF / quantized directories or .gguf files")
    _add_eval_args(e)
    e.add_argument(
        "--parity",
        action="store_true",
        help="for each .gguf: perplexity through our engine (ggml executor, prompt "
        "logprobs) beside llama.cpp's own on the same tokens and windows",
    )
    e.set_defaults(func=cmd_eval_ppl)


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--heldout",
        default=None,
        help="held-out text file (default: the demo models' held-out stdlib files)",
    )
    p.add_argument("--eval-tokens", type=int, default=0, help="0 = all held-out tokens")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)


def perplexity_of(
    path: str | Path, ids: list[int], seq_len: int, max_tokens: int | None, threads: int | None
) -> tuple[float, int]:
    from ultrafast.quant.evaluate import gguf_perplexity, torch_perplexity

    path = Path(path)
    if path.suffix == ".gguf":
        return gguf_perplexity(path, ids, seq_len, max_tokens, threads)
    from ultrafast.model.loader import load_model

    model, _ = load_model(path)
    return torch_perplexity(model, ids, seq_len, max_tokens)


def _evaluate(paths: dict[str, Path], tokenizer_dir: Path, args) -> dict[str, dict]:
    from ultrafast.quant.evaluate import heldout_ids

    return _evaluate_ids(paths, heldout_ids(tokenizer_dir, args.heldout), args)


def _evaluate_ids(paths: dict[str, Path], ids: list[int], args) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for label, path in paths.items():
        t0 = time.perf_counter()
        ppl, count = perplexity_of(path, ids, args.seq_len, args.eval_tokens or None, args.threads)
        results[label] = {
            "path": str(path),
            "perplexity": ppl,
            "num_tokens": count,
            "eval_s": round(time.perf_counter() - t0, 1),
        }
    return results


def markdown(results: dict[str, dict], reference: dict[str, str]) -> str:
    lines = ["| model | held-out perplexity | vs full precision | tokens |", "|---|---|---|---|"]
    for label, r in results.items():
        ref = results.get(reference.get(label, ""))
        ratio = f"{r['perplexity'] / ref['perplexity']:.4f}x" if ref else "-"
        lines.append(f"| {label} | {r['perplexity']:.3f} | {ratio} | {r['num_tokens']} |")
    return "\n".join(lines)


def _output_paths(args, name: str) -> tuple[Path | None, Path | None]:
    out = Path(args.out) if args.out else Path("runs/quant") / f"{name}-{args.scheme}"
    if args.format == "gguf" and out.suffix == ".gguf":
        return None, out
    torch_dir = out if args.format in ("torch", "both") else None
    gguf_path = out / f"{name}-{args.scheme}.gguf" if args.format in ("gguf", "both") else None
    return torch_dir, gguf_path


def _check_args(args, model_dir: Path) -> None:
    from ultrafast.model.loader import read_config

    read_config(model_dir)  # a clear ModelLoadError (a ValueError) for a bad directory
    if (model_dir / "quantization.json").is_file():
        raise ValueError(f"{model_dir} is already quantized; quantize the full-precision model")
    if args.group_size < 2 or args.group_size % 2:
        raise ValueError(f"--group-size must be an even number >= 2, got {args.group_size}")
    if args.format != "torch" and args.scheme != "int8" and args.group_size != 32:
        raise ValueError(
            "GGUF q4_0/q4_1 blocks hold 32 weights: use --group-size 32 or --format torch"
        )
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise FileNotFoundError(f"calibration file {args.calibration} does not exist")


def make_plan(args, model_dir: Path) -> tuple[dict[str, str], dict]:
    from ultrafast.model.loader import load_model
    from ultrafast.quant.evaluate import calibration_ids, windows
    from ultrafast.quant.plan import uniform_plan
    from ultrafast.quant.policy import hybrid_plan

    model, _ = load_model(model_dir, dtype="float32")
    if args.scheme != "hybrid":
        return uniform_plan(model, args.scheme), {}
    ids = calibration_ids(model_dir, args.calibration_tokens, args.calibration)
    plan, report = hybrid_plan(
        model,
        windows(ids, args.seq_len),
        args.group_size,
        args.zero_point,
        args.recover,
        args.max_ppl_ratio,
        args.max_keep_fraction,
        args.keep_type,
    )
    return plan, {"hybrid": report.to_json(), "calibration_tokens": len(ids) - 1}


def _write_gguf(args, model_dir: Path, gguf_path: Path, plan: dict[str, str]) -> dict:
    from ultrafast.quant.gguf_export import export_gguf, gguf_tensor_name
    from ultrafast.quant.llama_quantize import quantize_gguf, tensor_types

    if args.gguf_int4 == "q4_0" or "int4" not in plan.values():
        return export_gguf(model_dir, gguf_path, plan, args.zero_point)
    # llama.cpp's quantizer starts from a 16-bit file; the tied output is written explicitly
    # so that an lm_head override has a tensor to apply to
    staging = gguf_path.with_suffix(".f16-staging.gguf")
    export_gguf(model_dir, staging, {n: "f16" for n in plan}, untie=True)
    overrides = {
        gguf_tensor_name(n): {"f16": "f16", "int8": "q8_0"}[t]
        for n, t in plan.items()
        if t != "int4"
    }
    try:
        quantize_gguf(staging, gguf_path, args.gguf_int4, overrides, args.threads or 0)
    finally:
        staging.unlink(missing_ok=True)
    return tensor_types(gguf_path)


def cmd_quantize(args) -> int:
    import torch

    from ultrafast.model.loader import load_model
    from ultrafast.quant.plan import quantize_model
    from ultrafast.quant.saved import QUANT_CONFIG, save_quantized

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir)
    _check_args(args, model_dir)
    torch_dir, gguf_path = _output_paths(args, model_dir.name)
    plan, meta = make_plan(args, model_dir)
    meta.update(
        scheme=args.scheme,
        group_size=args.group_size,
        zero_point=args.zero_point,
        source=str(model_dir),
    )
    if gguf_path is not None:
        if torch_dir is None:  # tokenizer and config beside the GGUF: a servable directory
            from ultrafast.quant.saved import copy_model_files

            copy_model_files(model_dir, gguf_path.parent)
        meta["gguf"] = {
            "file": gguf_path.name,
            "types": _write_gguf(args, model_dir, gguf_path, plan),
        }
        print(f"wrote {gguf_path}")
    if torch_dir is not None:
        model, _ = load_model(model_dir, dtype="float32")
        quantized = quantize_model(model, plan, args.group_size, args.zero_point)
        save_quantized(model, plan, quantized, model_dir, torch_dir, meta)
        print(f"wrote {torch_dir} (load it like any model directory)")
    if (
        torch_dir is None and gguf_path is not None
    ):  # the plan and its measurements, beside the GGUF
        plan_path = gguf_path.with_suffix(".plan.json")
        plan_path.write_text(json.dumps({**meta, "tensors": plan}, indent=1))
    counts = {t: list(plan.values()).count(t) for t in sorted(set(plan.values()))}
    kept = [n for n, t in plan.items() if t != "int4"] if args.scheme == "hybrid" else []
    print(f"plan: {counts}" + (f"; kept out of int4: {', '.join(kept)}" if kept else ""))
    if args.eval:
        from ultrafast.model_files import gguf_for, resolve_model

        paths = {"fp (torch)": model_dir}
        if torch_dir is not None:
            paths[f"{args.scheme} (torch)"] = torch_dir
        if gguf_path is not None:
            paths["f16 (gguf)"] = gguf_for(resolve_model(model_dir), "f16")
            paths[f"{args.scheme} (gguf)"] = gguf_path
        results = _evaluate(paths, model_dir, args)
        ref = {f"{args.scheme} (torch)": "fp (torch)", f"{args.scheme} (gguf)": "f16 (gguf)"}
        print(markdown(results, ref))
        if torch_dir is not None:
            config = json.loads((torch_dir / QUANT_CONFIG).read_text())
            config["perplexity"] = results
            (torch_dir / QUANT_CONFIG).write_text(json.dumps(config, indent=1))
    return 0


def cmd_eval_ppl(args) -> int:
    from ultrafast.quant.evaluate import model_heldout_ids

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    paths = {p: Path(p) for p in args.models}
    for path in paths.values():
        if not path.exists():
            raise FileNotFoundError(f"model path {path} does not exist")
    if args.parity and not any(p.suffix == ".gguf" for p in paths.values()):
        raise ValueError("--parity compares .gguf files: give at least one")
    # the first model's tokenizer: its tokenizer.json, or a lone GGUF's own metadata
    ids = model_heldout_ids(args.models[0], args.heldout)
    if args.parity:
        return _print_parity(paths, ids, args)
    results = _evaluate_ids(paths, ids, args)
    first = args.models[0]
    print(markdown(results, {p: first for p in args.models[1:]}))
    json.dump(results, sys.stdout, indent=1)
    print()
    return 0


def _print_parity(paths: dict[str, Path], ids: list[int], args) -> int:
    from dataclasses import asdict

    from ultrafast.quant.perplexity import parity_markdown, perplexity_parity

    results = {
        label: perplexity_parity(path, ids, args.seq_len, args.eval_tokens or None, args.threads)
        for label, path in paths.items()
        if path.suffix == ".gguf"
    }
    print(parity_markdown(results))
    json.dump(
        {k: {**asdict(r), "ratio": r.ratio} for k, r in results.items()}, sys.stdout, indent=1
    )
    print()
    return 0
