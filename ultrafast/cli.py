"""The `ultrafast` command: generate, convert (and more as they land). Every command has --help."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the bundled demo model)")
    p.add_argument("--executor", choices=["auto", "ggml", "torch", "fake"], default="auto",
                   help="auto = ggml (llama.cpp kernels) on CPU, torch on CUDA; fake = no model, "
                   "deterministic word tokens (load and fault tests only)")
    p.add_argument("--fake-step-ms", type=float, default=20.0, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=2048, help="positions per KV slot")
    p.add_argument("--num-slots", type=int, default=8, help="KV slots (concurrent sequences)")
    p.add_argument("--threads", type=int, default=None,
                   help="ggml threads (default: all cores; serve: all but one)")


def _engine_options(args) -> dict:
    return dict(executor=args.executor, max_model_len=args.max_model_len,
                num_slots=args.num_slots, max_num_seqs=args.num_slots, n_threads=args.threads,
                fake_step_s=args.fake_step_ms / 1000)


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


def cmd_serve(args) -> int:
    from ultrafast.config import EngineConfig, ServerConfig, TierTargets, default_model
    from ultrafast.server.serve import serve

    if args.threads is None:
        # leave one core to the event loop, tokenizer and clients: on the 2-core machine this
        # streams 224 tok/s over HTTP instead of 184 with both cores on the kernels
        from ultrafast.executors.ggml_exec import physical_cores

        args.threads = max(1, physical_cores() - 1)
    engine = EngineConfig(model=args.model_path or args.model or default_model(),
                          **_engine_options(args))
    server = ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        priority=TierTargets(args.priority_ttft_ms, args.priority_itl_ms, args.priority_queue),
        default=TierTargets(args.default_ttft_ms, args.default_itl_ms, args.default_queue),
        shaper_window_ms=args.shaper_window_ms, drain_timeout_s=args.drain_timeout_s,
        header_timeout_s=args.header_timeout_s, write_stall_timeout_s=args.write_stall_timeout_s)
    return serve(engine, server)


def cmd_bench(args) -> int:
    from ultrafast.config import default_model

    args.model = args.model or default_model()
    if args.suite == "tiers":
        from ultrafast.bench.tiers import main as tiers_main

        args.out = args.out or "runs/bench_tiers.json"
        return tiers_main(args)
    from ultrafast.bench.decode import main as decode_main

    args.out = args.out or "runs/bench_decode.json"
    return decode_main(args)


def cmd_loadtest(args) -> int:
    from ultrafast.loadtest.runner import main as loadtest_main

    return loadtest_main(args)


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

    srv = sub.add_parser("serve", help="start the OpenAI-compatible server")
    srv.add_argument("model_path", nargs="?", default=None,
                     help="HF model directory or .gguf (default: the bundled demo model)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="model id clients send")
    srv.add_argument("--priority-ttft-ms", type=float, default=250.0,
                     help="priority tier time-to-first-token target; later is refused (429)")
    srv.add_argument("--priority-itl-ms", type=float, default=0.0,
                     help="priority inter-token target; steps carrying priority work are sized "
                     "to it (0 = auto: 1.2x the measured idle inter-token time)")
    srv.add_argument("--priority-queue", type=int, default=8, help="priority calls in flight")
    srv.add_argument("--default-ttft-ms", type=float, default=5000.0)
    srv.add_argument("--default-itl-ms", type=float, default=250.0)
    srv.add_argument("--default-queue", type=int, default=64, help="default calls in flight")
    srv.add_argument("--shaper-window-ms", type=float, default=2.0,
                     help="coalesce default-tier arrivals this long (0 = off)")
    srv.add_argument("--drain-timeout-s", type=float, default=10.0)
    srv.add_argument("--header-timeout-s", type=float, default=10.0,
                     help="close a connection whose request head is not complete in this long "
                     "(slowloris; 408 when part of it came; 0 = off)")
    srv.add_argument("--write-stall-timeout-s", type=float, default=30.0,
                     help="abort a stream whose client reads nothing for this long, freeing "
                     "its KV slot (0 = off)")
    _add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="side-by-side benchmarks (JSON + Markdown table)")
    bench.add_argument("suite", nargs="?", choices=["decode", "tiers"], default="decode",
                       help="decode: batch-1 decode vs llama.cpp and transformers; tiers: "
                       "priority latency idle vs loaded, and HTTP streaming overhead")
    bench.add_argument("--model", default=None, help="HF model directory (default: demo model)")
    bench.add_argument("--num-slots", type=int, default=4, help="tiers: KV slots of the server")
    bench.add_argument("--probes", type=int, default=8, help="tiers: priority requests per phase")
    bench.add_argument("--new-tokens", type=int, default=128)
    bench.add_argument("--rounds", type=int, default=None,
                       help="timed rounds (default: decode 3, tiers 10)")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--gguf-type", default="f16", help="GGUF type for both ggml runners")
    bench.add_argument("--out", default=None, help="JSON report (default under runs/)")
    bench.set_defaults(func=cmd_bench)

    lt = sub.add_parser("loadtest", help="load scenarios and fault injections against real "
                        "servers on loopback, with the nothing-lost checks (JSON + Markdown)")
    lt.add_argument("--scenario", default="all", help="L1,F3,... or ci or all")
    lt.add_argument("--tier", choices=["full", "ci"], default="full",
                    help="full: the spec's sizes; ci: short runs")
    lt.add_argument("--duration-s", type=float, default=180.0, help="cap per scenario")
    lt.add_argument("--max-requests", type=int, default=10_000, help="cap per scenario")
    lt.add_argument("--url", default=None, help="an already running loopback server "
                    "(default: start one per scenario)")
    lt.add_argument("--out", default="runs/loadtest.json", help="JSON report (+ .md beside)")
    lt.set_defaults(func=cmd_loadtest)

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
