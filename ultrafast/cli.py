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
                   help="kernel threads: ggml's, or torch's on CPU (default: all cores; serve: all "
                   "but one)")
    p.add_argument("--batch-threads", type=int, default=None,
                   help="ggml threads for passes of more than one token: prefill chunks, draft "
                   "verification, several streams' decodes (default: --threads)")
    p.add_argument("--spec", choices=["off", "ngram", "draft", "auto"], default="auto",
                   help="speculative decoding: n-gram prompt lookup, a draft model, or auto "
                   "(n-gram, else the draft model); a request's `prediction` is always used")
    p.add_argument("--spec-tiers", default="priority",
                   help="comma-separated tiers that draft (priority, default, flex)")
    p.add_argument("--draft-model", default=None,
                   help="draft model (HF dir or .gguf, same tokenizer; default: the bundled "
                   "demo draft when it fits the model)")
    p.add_argument("--max-draft-tokens", type=int, default=8,
                   help="upper bound of the adaptive number of draft tokens per step")
    _add_compile_arg(p)


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", nargs="?", const="inductor", default="auto",
                   choices=["auto", "inductor", "graphs", "off"],
                   help="torch executor decode steps: torch.compile (inductor) and, on CUDA, "
                   "CUDA graphs; graphs = CUDA graphs of eager kernels; auto = on with CUDA "
                   "(bare --compile = inductor)")


def _engine_options(args) -> dict:
    tiers = tuple(t.strip() for t in args.spec_tiers.split(",") if t.strip())
    return dict(executor=args.executor, max_model_len=args.max_model_len,
                num_slots=args.num_slots, max_num_seqs=args.num_slots, n_threads=args.threads,
                n_threads_batch=args.batch_threads,
                fake_step_s=args.fake_step_ms / 1000,
                spec=args.spec, spec_tiers=tiers, draft_model=args.draft_model,
                max_draft_tokens=args.max_draft_tokens, compile=args.compile)


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
        spec = llm.engine.spec_stats
        drafted = sum(spec.num_draft_tokens.values()) if spec else 0
        accepted = sum(spec.num_accepted_tokens.values()) if spec else 0
        print(f"[{llm.files.name} on {type(llm.engine.executor).__name__}: "
              f"ttft {1000 * (first_s or total_s):.1f} ms, ~{num_tokens} tokens in "
              f"{total_s:.2f} s; spec {args.spec}: {accepted}/{drafted} drafts accepted]",
              file=sys.stderr)
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
    # --batch-threads stays opt-in: on the 2-core machine all cores cut a 70-token prompt's
    # time to first token from 21 to 13 ms, but raised a 20-token priority prompt's from 4.6 to
    # 7.3 ms with the event loop and clients on the same cores (BENCHMARKS.md, issue 3)
    engine = EngineConfig(model=args.model_path or args.model or default_model(),
                          **_engine_options(args))
    server = ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        priority=TierTargets(args.priority_ttft_ms, args.priority_itl_ms, args.priority_queue),
        default=TierTargets(args.default_ttft_ms, args.default_itl_ms, args.default_queue),
        shaper_window_ms=args.shaper_window_ms, drain_timeout_s=args.drain_timeout_s,
        session_store=args.session_store, session_ttl_s=args.session_ttl_s,
        max_sessions_per_tenant=args.max_sessions_per_tenant,
        api_keys_path=args.api_keys, allowed_hosts=tuple(args.allowed_host),
        guard_patterns=tuple(args.guard_pattern),
        guard_patterns_path=args.guard_patterns, guard_hold_back_tokens=args.guard_hold_back_tokens,
        guard_classifier=args.guard_classifier,
        guard_classifier_threshold=args.guard_classifier_threshold,
        alert_priority_itl_p99_ms=args.alert_priority_itl_p99_ms,
        header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
        write_stall_timeout_s=args.write_stall_timeout_s,
        max_connections_per_ip=args.max_connections_per_ip)
    return serve(engine, server)


def cmd_keys(args) -> int:
    from ultrafast.server.tenants import hash_key, load_api_keys, new_key

    if args.action == "new":
        key = new_key()
        print(f"key:    {key}\nsha256: {hash_key(key)}")
    elif args.action == "hash":
        key = args.key if args.key is not None else sys.stdin.readline().rstrip("\n")
        if not key:
            raise ValueError("give the key as an argument or on stdin")
        print(hash_key(key))
    else:
        keys = load_api_keys(args.key)
        for tenant in keys.tenants.values():
            print(f"{tenant.name}: tiers {sorted(t.api_name for t in tenant.tiers)}, "
                  f"{sum(1 for _, t, _ in keys.by_hash.values() if t is tenant)} key(s)")
    return 0


def cmd_bench(args) -> int:
    from ultrafast.config import default_model

    if args.suite == "gpu":
        from ultrafast.bench.gpu_check import main as gpu_main

        args.out = args.out or "runs/bench_gpu.json"
        return gpu_main(args)
    args.model = args.model or default_model()
    if args.suite == "run":
        from ultrafast.bench.harness_report import main as run_main

        args.concurrency = args.concurrency or "1,4,16"
        args.out = args.out or "runs/bench.json"
        return run_main(args)
    if args.suite == "guard":
        from ultrafast.bench.guard import main as guard_main

        args.rounds = args.rounds or 3
        args.out = args.out or "runs/bench_guard.json"
        return guard_main(args)
    if args.suite == "tiers":
        from ultrafast.bench.tiers import main as tiers_main

        args.out = args.out or "runs/bench_tiers.json"
        return tiers_main(args)
    if args.suite == "sessions":
        from ultrafast.bench.sessions import main as sessions_main

        args.concurrency = int(args.concurrency or 16)
        args.rounds = args.rounds or 3
        args.out = args.out or "runs/bench_sessions.json"
        return sessions_main(args)
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
    srv.add_argument("--session-store", default="",
                     help="conversation history: sqlite:///path (default: sessions.db under "
                     "the user data dir) or redis://host:port/db")
    srv.add_argument("--session-ttl-s", type=float, default=30 * 24 * 3600.0,
                     help="a session expires this long after its last turn")
    srv.add_argument("--max-sessions-per-tenant", type=int, default=10_000)
    srv.add_argument("--api-keys", default=None, metavar="FILE",
                     help="tenants and sha256-hashed keys (YAML/JSON, see deploy/); without it "
                     "there is no auth and the server listens on loopback only")
    srv.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                     help="Host header names to accept (repeatable; default on loopback: "
                     "127.0.0.1, localhost, ::1; otherwise any)")
    srv.add_argument("--guard-pattern", action="append", default=[], metavar="REGEX",
                     help="output safety filter: cut a stream matching REGEX (repeatable)")
    srv.add_argument("--guard-patterns", default=None, metavar="FILE",
                     help='output safety filter patterns, JSON {"patterns": [...]}')
    srv.add_argument("--guard-classifier", default=None, metavar="MODULE:FUNCTION",
                     help="output safety filter: a function text -> score in [0, 1], run off "
                     "the event loop; scores >= --guard-classifier-threshold cut the stream")
    srv.add_argument("--guard-classifier-threshold", type=float, default=0.5)
    srv.add_argument("--guard-hold-back-tokens", type=int, default=4,
                     help="tokens withheld after each cleared chunk (>= longest pattern)")
    srv.add_argument("--alert-priority-itl-p99-ms", type=float, default=None,
                     help="exported threshold of the priority per-token p99 alert "
                     "(default 2 on GPU, off on CPU; 0 = off)")
    srv.add_argument("--header-timeout-s", type=float, default=10.0,
                     help="close a connection whose request head is not complete in this long "
                     "(slowloris; 408 when part of it came; 0 = off)")
    srv.add_argument("--body-timeout-s", type=float, default=30.0,
                     help="answer 408 request_timeout when a request body is not complete this "
                     "long after its head (a slow body; 0 = off)")
    srv.add_argument("--max-connections-per-ip", type=int, default=0,
                     help="refuse (429 too_many_connections) a connection beyond this many open "
                     "ones from one client address (0 = no cap; behind a proxy all clients "
                     "share its address)")
    srv.add_argument("--write-stall-timeout-s", type=float, default=30.0,
                     help="abort a stream whose client reads nothing for this long, freeing "
                     "its KV slot (0 = off)")
    _add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="side-by-side benchmarks (JSON + Markdown table)")
    bench.add_argument("suite", nargs="?",
                       choices=["run", "decode", "tiers", "sessions", "guard", "gpu"],
                       default="run",
                       help="run: ours (engine + HTTP server) vs llama.cpp and transformers at "
                       "concurrency 1/4/16, JSON + Markdown + PNG; decode: batch-1 decode only; "
                       "tiers: priority latency idle vs loaded, and HTTP streaming overhead; "
                       "sessions: TTFT by conversation turn, and exactly-once turns across "
                       "a Redis restart; guard: TTFT and tokens/s with and without the output "
                       "safety filter; "
                       "gpu: Llama-3.2-1B-shaped bf16 decode, eager vs CUDA graphs vs roofline")
    bench.add_argument("--model", default=None, help="HF model directory (default: demo model)")
    bench.add_argument("--num-slots", type=int, default=4, help="tiers: KV slots of the server")
    bench.add_argument("--probes", type=int, default=8, help="tiers: priority requests per phase")
    bench.add_argument("--new-tokens", "--max-tokens", dest="new_tokens", type=int, default=128,
                       help="tokens generated per stream")
    bench.add_argument("--concurrency", default=None,
                       help="run: concurrent streams per level, comma-separated (default "
                       "1,4,16); sessions: conversations at once (default 16)")
    bench.add_argument("--peers", default=None,
                       help="run: comma-separated runners (default: ours-engine, ours-server, "
                       "llama.cpp, transformers; on CUDA also vllm or transformers-cuda; "
                       "ours-engine-torch adds our torch executor)")
    bench.add_argument("--prompt-tokens", type=int, default=None,
                       help="prompt length (default: run 32, gpu 128)")
    bench.add_argument("--roofline", action="store_true",
                       help="run/gpu: batch-1 decode as a fraction of bytes-per-token / "
                       "measured memory bandwidth")
    bench.add_argument("--executor", choices=["auto", "ggml", "torch"], default="auto",
                       help="run, sessions: our executor (auto = ggml on CPU, torch on CUDA)")
    bench.add_argument("--skip-tests", action="store_true", help="gpu: do not run tests/gpu")
    bench.add_argument("--decode-tokens", type=int, default=256,
                       help="gpu: decode steps timed per mode")
    _add_compile_arg(bench)
    bench.add_argument("--rounds", type=int, default=None,
                       help="timed rounds (default: tiers 10, the others 3)")
    bench.add_argument("--threads", type=int, default=None)
    bench.add_argument("--batch-threads", type=int, default=None,
                       help="sessions: the server's --batch-threads")
    bench.add_argument("--gguf-type", default="f16", help="GGUF type for both ggml runners")
    bench.add_argument("--gguf", action="append", default=None, metavar="PATH",
                       help="decode: compare these GGUF files instead (repeatable), ours vs "
                       "llama.cpp on each, e.g. f16 vs q8_0 vs hybrid")
    bench.add_argument("--spec", default="ngram,draft",
                       help="decode: speculative variants of our ggml runner to add, "
                       "comma-separated from ngram, draft, auto (empty: none)")
    bench.add_argument("--turns", type=int, default=20, help="sessions: turns per conversation")
    bench.add_argument("--turn-tokens", type=int, default=50, help="sessions: user turn size")
    bench.add_argument("--reply-tokens", type=int, default=40,
                       help="sessions: answer size (turns of ~100 tokens in all; 20 of them fit"
                       " the demo model's 2048 positions)")
    bench.add_argument("--sessions", type=int, default=200,
                       help="sessions: exactly-once run (0: time to first token only)")
    bench.add_argument("--answer-tokens", type=int, default=16,
                       help="sessions: answer size in the exactly-once run")
    bench.add_argument("--max-model-len", type=int, default=4096,
                       help="sessions: server positions per slot (capped by the model)")
    bench.add_argument("--guard-patterns", default=None,
                       help="guard: patterns file (default deploy/guard-patterns.example.json)")
    bench.add_argument("--hold-back-tokens", type=int, default=4, help="guard: hold-back N")
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

    keys = sub.add_parser("keys", help="API keys: make one, hash one, check a keys file")
    keys.add_argument("action", choices=["new", "hash", "check"],
                      help="new: random key + its sha256; hash KEY (or stdin): the sha256 to "
                      "put in the keys file; check FILE: parse a keys file")
    keys.add_argument("key", nargs="?", default=None, help="hash: the key; check: the file")
    keys.set_defaults(func=cmd_keys)

    conv = sub.add_parser("convert", help="convert an HF model directory to GGUF")
    conv.add_argument("model_dir", help="HF directory (config.json, safetensors, tokenizer.json)")
    conv.add_argument("out", help="output .gguf path")
    conv.add_argument("--outtype", choices=["f32", "f16", "bf16", "q8_0"], default="f16")
    conv.set_defaults(func=cmd_convert)

    from ultrafast.quant.command import add_parsers as add_quant_parsers

    add_quant_parsers(sub)  # quantize, eval-ppl
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
