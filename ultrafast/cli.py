"""The `ultrafast` command: generate, convert (and more as they land). Every command has --help."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the bundled demo model)")
    p.add_argument("--executor", choices=["auto", "ggml", "torch"], default="auto",
                   help="auto = ggml (llama.cpp kernels) on CPU, torch on CUDA")
    p.add_argument("--max-model-len", type=int, default=2048, help="positions per KV slot")
    p.add_argument("--num-slots", type=int, default=4, help="KV slots (concurrent sequences)")
    p.add_argument("--threads", type=int, default=None, help="ggml threads (default: all cores)")


def _engine_options(args) -> dict:
    return dict(executor=args.executor, max_model_len=args.max_model_len,
                num_slots=args.num_slots, max_num_seqs=args.num_slots, n_threads=args.threads)


def cmd_generate(args) -> int:
    from ultrafast.llm import LLM
    from ultrafast.request import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    llm = LLM(args.model, **_engine_options(args))
    started = time.perf_counter()
    first_s = None
    pieces = []
    sys.stdout.write(args.prompt)
    for delta in llm.stream(args.prompt, params):
        if first_s is None:
            first_s = time.perf_counter() - started
        pieces.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()
    total_s = time.perf_counter() - started
    sys.stdout.write("\n")
    num_tokens = len(llm.tokenizer.encode("".join(pieces), add_special_tokens=False))
    if args.stats:
        print(f"[{llm.files.name} on {type(llm.engine.executor).__name__}: "
              f"ttft {1000 * (first_s or total_s):.1f} ms, ~{num_tokens} tokens in "
              f"{total_s:.2f} s]", file=sys.stderr)
    llm.close()
    return 0


def cmd_convert(args) -> int:
    from ultrafast.convert import convert_hf_to_gguf

    out = convert_hf_to_gguf(args.model_dir, args.out, outtype=args.outtype)
    print(f"wrote {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ultrafast", description="Low-latency LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stats", action="store_true", help="print TTFT and speed to stderr")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="convert an HF model directory to GGUF")
    conv.add_argument("model_dir", help="HF directory (config.json, safetensors, tokenizer.json)")
    conv.add_argument("out", help="output .gguf path")
    conv.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16")
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"ultrafast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
