"""`ultrafast bench sessions`: server-side conversations, measured and checked.

1. Time to first token by turn: one conversation of `--turns` turns (user text of
   `--turn-tokens` tokens, answers of `--reply-tokens` tokens), once with `session_id` (the client
   sends only the new turn; its KV stays warm in the server) and once as a stateless client
   resending the whole history. Reports turn N / turn 1 for both (target: at most 1.2x), and
   the floor: the executor's own forward pass over the same prefills with no server (llama.cpp's
   eval for the ggml executor, `--executor torch`: the torch executor's).
2. Exactly once under a Redis restart (docs/RELIABILITY.md L5): `--sessions` x `--turns` turns,
   `--concurrency` at a time, against a real redis-server (AOF always) restarted once halfway.
   Clients retry a refused or broken call with the same Idempotency-Key; afterwards every
   session must hold each turn exactly once, in order. The run fails (exit 1) otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from ultrafast_harness.bench import sessions_oversub
from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.session_chat import _stream_chat, user_text
from ultrafast_harness.bench.suite_args import (
    add_executor,
    add_model,
    add_out,
    add_rounds,
    add_server_slots,
    add_threads,
)


def prefill_shape(usage: dict) -> tuple[int, int]:
    """(tokens served from the cache, tokens prefilled) of one call's prompt."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return cached, usage["prompt_tokens"] - cached


def ttft_by_turn(
    base_url: str,
    num_turns: int,
    turn_tokens: int,
    new_tokens: int,
    stateful: bool,
    salt: int,
    shapes: list | None = None,
) -> list[float]:
    """TTFT per turn; `shapes` (if given) gets each turn's prefill_shape."""
    texts = [user_text(base_url, turn_tokens, salt * 1000 + k) for k in range(num_turns)]
    history: list[dict] = []
    ttfts = []
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for text in texts:
            new = {"role": "user", "content": text}
            body = {
                "max_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "service_tier": "priority",
            }
            if stateful:
                body.update(messages=[new], session_id=f"bench-ttft-{salt}")
            else:
                body.update(messages=history + [new])
            ttft_s, answer, usage = _stream_chat(client, body)
            ttfts.append(ttft_s)
            if shapes is not None:
                shapes.append(prefill_shape(usage))
            history += [new, {"role": "assistant", "content": answer}]
    return ttfts


def llama_cpp_floor(
    gguf: str, threads: int, shapes: dict[str, tuple[int, int]], rounds: int = 5, **llama_kwargs
) -> dict[str, float]:
    """llama.cpp's own `eval` of the same prefills, no server: per name, the median seconds to
    evaluate `new` tokens after `cached` ones. Turn N over turn 1 here is what exact attention
    over the history costs on this model and machine, the floor for any server's ratio."""
    from ultrafast.executors.llama_cpp_params import open_llama

    longest = max(c + n for c, n in shapes.values())
    llm = open_llama(
        gguf,
        n_ctx=longest + 16,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
        **llama_kwargs,
    )  # e.g. flash_attn, type_k
    tokens = [(7 * i + 3) % (llm.n_vocab() - 1) + 1 for i in range(longest)]
    out = {}
    try:
        for name, (cached, new) in shapes.items():
            llm.reset()
            llm.eval(tokens[:cached])  # the history, already in the KV cache
            times = []
            for _ in range(rounds):
                llm.n_tokens = cached  # eval drops the KV past n_tokens first
                started = time.perf_counter()
                llm.eval(tokens[cached : cached + new])
                times.append(time.perf_counter() - started)
            out[name] = statistics.median(times)
    finally:
        llm.close()
    return out


def torch_floor(
    model_dir: str, threads: int, shapes: dict[str, tuple[int, int]], rounds: int = 5
) -> dict[str, float]:
    """`llama_cpp_floor` for the torch executor: its own forward pass over the same prefills,
    no server, no scheduler (CPU, float32, eager as the server runs prefills). Each shape has
    its own KV slot, so the timed passes alternate between shapes round by round and a machine
    that drifts in speed moves them alike."""
    from ultrafast.core.types import ScheduledSeq, StepPlan
    from ultrafast.executors.torch_exec import TorchExecutor
    from ultrafast.request import SamplingParams

    longest = max(c + n for c, n in shapes.values())
    executor = TorchExecutor(
        model_dir,
        num_slots=len(shapes),
        max_model_len=longest,
        device="cpu",
        compile="off",
        n_threads=threads,
    )
    tokens = [(7 * i + 3) % (executor.vocab_size - 1) + 1 for i in range(longest)]
    greedy = SamplingParams(temperature=0.0)

    def forward(slot: int, start: int, end: int) -> float:
        seq = ScheduledSeq("floor", slot, tokens[start:end], start, 1, greedy, 0, 0)
        started = time.perf_counter()
        executor.execute(StepPlan([seq]))
        return time.perf_counter() - started

    times: dict[str, list[float]] = {name: [] for name in shapes}
    try:
        for slot, (cached, new) in enumerate(shapes.values()):
            for start in range(0, cached, 512):  # the history, already in the KV cache
                forward(slot, start, min(cached, start + 512))
            forward(slot, cached, cached + new)  # warm-up at this shape
        for _ in range(rounds):
            for slot, (name, (cached, new)) in enumerate(shapes.items()):
                times[name].append(forward(slot, cached, cached + new))
    finally:
        executor.close()
    return {name: statistics.median(t) for name, t in times.items()}


# ---- exactly once under a Redis restart -----------------------------------------------------


@dataclass
class ConversationRun:
    session_ids: list[str]
    sent: dict[str, list[str]] = field(default_factory=dict)  # session -> user texts in order
    num_retries: int = 0
    num_restarts: int = 0
    num_503: int = 0
    num_turns_before_restart_end: int | None = None  # < all turns: the outage hit mid-run
    elapsed_s: float = 0.0


def _turn(
    client: httpx.Client,
    run: ConversationRun,
    lock,
    session_id: str,
    k: int,
    max_tokens: int,
    deadline_s: float = 120.0,
) -> None:
    text = f"# {session_id} turn {k}\ndef step_{k}(state):"
    body = {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "session_id": session_id,
    }
    headers = {"Idempotency-Key": f"{session_id}-t{k}"}
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            r = client.post("/v1/chat/completions", json=body, headers=headers)
            if r.status_code == 200:
                break
            if r.status_code != 503:
                raise RuntimeError(f"turn {k} of {session_id}: {r.status_code} {r.text[:200]}")
            with lock:
                run.num_503 += 1
        except httpx.TransportError:
            pass
        if time.monotonic() > give_up:
            raise RuntimeError(f"turn {k} of {session_id} not accepted in {deadline_s} s")
        with lock:
            run.num_retries += 1
        time.sleep(0.2)
    run.sent[session_id].append(text)


def run_conversations(
    base_url: str,
    num_sessions: int,
    num_turns: int,
    concurrency: int,
    max_tokens: int,
    restart=None,
    restart_after_turns: int | None = None,
    session_prefix: str = "bench",
) -> ConversationRun:
    """Each worker runs whole conversations; `restart()` runs once, in its own thread, when
    `restart_after_turns` turns are done (so calls are in flight while Redis is down)."""
    stamp = f"{int(time.time() * 1000) % 10**9}"
    run = ConversationRun([f"{session_prefix}-{stamp}-{i}" for i in range(num_sessions)])
    run.sent = {sid: [] for sid in run.session_ids}
    lock = threading.Lock()
    done_turns = [0]
    restarter: list[threading.Thread] = []

    def restart_and_count() -> None:
        restart(1.0)
        with lock:
            run.num_turns_before_restart_end = done_turns[0]

    def conversation(session_id: str) -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            for k in range(num_turns):
                _turn(client, run, lock, session_id, k, max_tokens)
                with lock:
                    done_turns[0] += 1
                    if (
                        restart is not None
                        and not restarter
                        and done_turns[0] >= (restart_after_turns or 0)
                    ):
                        run.num_restarts += 1
                        restarter.append(threading.Thread(target=restart_and_count))
                        restarter[0].start()

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(conversation, sid) for sid in run.session_ids]:
            future.result()
    for thread in restarter:
        thread.join()
    run.elapsed_s = time.perf_counter() - started
    return run


def check_exactly_once(base_url: str, run: ConversationRun) -> dict:
    """Every session holds user, assistant, user, ... with each sent user turn once, in order."""
    problems, num_found = [], 0
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for session_id in run.session_ids:
            items, after = [], None
            while True:
                params: dict[str, str | int] = {"order": "asc", "limit": 100}
                if after:
                    params["after"] = after
                page = client.get(f"/v1/conversations/{session_id}/items", params=params).json()
                items += page["data"]
                if not page["has_more"]:
                    break
                after = page["last_id"]
            num_found += len(items)
            ids = [i["id"] for i in items]
            users = [i["content"][0]["text"] for i in items if i["role"] == "user"]
            roles = [i["role"] for i in items]
            if len(set(ids)) != len(ids):
                problems.append(f"{session_id}: duplicate turn ids")
            if users != run.sent[session_id]:
                problems.append(
                    f"{session_id}: user turns {len(users)} stored vs "
                    f"{len(run.sent[session_id])} sent, or out of order"
                )
            if roles != ["user", "assistant"] * len(run.sent[session_id]):
                problems.append(f"{session_id}: roles {roles[:6]}... are not one answer per turn")
    return {"num_turns_found": num_found, "problems": problems[:20]}


# ---- the command ----------------------------------------------------------------------------


def _median(runs: list[list[float]], k: int) -> float:
    return statistics.median(r[k] for r in runs)


def _oversub_server_args(args) -> tuple[str, ...]:
    return (
        "--priority-ttft-ms",
        "60000",
        *(["--executor", args.executor] if args.executor != "auto" else []),
        "--default-queue",
        str(max(64, 2 * args.throughput_conversations)),
        *(["--threads", str(args.threads)] if args.threads else []),
        *(["--batch-threads", str(args.batch_threads)] if args.batch_threads else []),
    )


def main(args) -> int:
    from ultrafast.model_files import gguf_for, resolve_model
    from ultrafast_harness.bench.redis_server import RedisServer
    from ultrafast_harness.bench.server_process import (
        DEMO_MODEL_DIR,
        ServerProcess,
        serve_default_threads,
    )

    if getattr(args, "oversubscribed", False):  # more conversations than slots (issue 20)
        return sessions_oversub.main(args, _oversub_server_args(args))
    redis = RedisServer()
    torch_executor = args.executor == "torch"
    server_args = (
        "--priority-ttft-ms",
        "60000",
        "--session-store",
        redis.url,
        *(["--executor", args.executor] if args.executor != "auto" else []),
        "--default-queue",
        str(max(64, args.concurrency * 2)),
        *(["--threads", str(args.threads)] if args.threads else []),
        *(["--batch-threads", str(args.batch_threads)] if args.batch_threads else []),
    )
    srv = ServerProcess(
        *server_args,
        model=args.model or DEMO_MODEL_DIR,
        num_slots=args.num_slots,
        max_model_len=args.max_model_len,
    )
    try:
        ttft = {}
        ttft_by_turn(srv.url, 3, args.turn_tokens, args.reply_tokens, True, salt=999)  # warm-up
        shapes: list[tuple[int, int]] = []  # (cached, prefilled) per turn, sessions mode
        for mode, stateful in (("sessions", True), ("stateless", False)):
            runs = [
                ttft_by_turn(
                    srv.url,
                    args.turns,
                    args.turn_tokens,
                    args.reply_tokens,
                    stateful,
                    salt=r + (100 if stateful else 200),
                    shapes=shapes if stateful and r == 0 else None,
                )
                for r in range(args.rounds)
            ]
            first, last = _median(runs, 0), _median(runs, args.turns - 1)
            ttft[mode] = {
                "turn_1_ms": 1000 * first,
                f"turn_{args.turns}_ms": 1000 * last,
                "ratio": last / first,
                "by_turn_ms": [1000 * _median(runs, k) for k in range(args.turns)],
            }
        ttft["sessions"]["prefill_turn_1"] = shapes[0]  # (cached, prefilled) tokens
        ttft["sessions"][f"prefill_turn_{args.turns}"] = shapes[-1]
        srv.stop()  # the floor runs alone on the machine
        files = resolve_model(args.model or DEMO_MODEL_DIR)
        # prefills are multi-token passes: the server's batch threads
        floor_threads = args.batch_threads or args.threads or serve_default_threads()
        floor_shapes = {"turn_1": shapes[0], "turn_n": shapes[-1]}
        if torch_executor:
            floor = torch_floor(
                str(files.hf_dir), args.threads or serve_default_threads(), floor_shapes
            )
        else:
            floor = llama_cpp_floor(str(gguf_for(files)), floor_threads, floor_shapes)
        ttft["torch executor eval (floor)" if torch_executor else "llama.cpp eval (floor)"] = {
            "turn_1_ms": 1000 * floor["turn_1"],
            f"turn_{args.turns}_ms": 1000 * floor["turn_n"],
            "ratio": floor["turn_n"] / floor["turn_1"],
        }
        conv, check = ConversationRun([]), {"num_turns_found": 0, "problems": []}
        if args.sessions:  # 0: time to first token only (e.g. a model too slow for 4,000 turns)
            srv = ServerProcess(
                *server_args,
                model=args.model or DEMO_MODEL_DIR,
                num_slots=args.num_slots,
                max_model_len=args.max_model_len,
            )
            conv = run_conversations(
                srv.url,
                args.sessions,
                args.turns,
                args.concurrency,
                args.answer_tokens,
                restart=redis.restart,
                restart_after_turns=args.sessions * args.turns // 2,
            )
            check = check_exactly_once(srv.url, conv)
    finally:
        srv.stop()
        redis.close()
    expected = 2 * args.sessions * args.turns
    report = {
        "ttft": ttft,
        "turn_tokens": args.turn_tokens,
        "reply_tokens": args.reply_tokens,
        "num_slots": args.num_slots,
        "exactly_once": {
            "sessions": args.sessions,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "expected_turns": expected,
            **check,
            "retries": conv.num_retries,
            "refused_503": conv.num_503,
            "redis_restarts": conv.num_restarts,
            "turns_done_when_redis_was_back": conv.num_turns_before_restart_end,
            "elapsed_s": conv.elapsed_s,
        },
    }
    ok = check["num_turns_found"] == expected and not check["problems"]
    write_report(report, args.out, markdown(report, args.turns))
    if not ok:
        print("FAILED: turns missing or duplicated:", check["problems"])
    return 0 if ok else 1


def markdown(report: dict, num_turns: int) -> str:
    rows = [
        f"| client | TTFT turn 1 (ms) | TTFT turn {num_turns} (ms) | ratio (target <= 1.2) |",
        "|---|---|---|---|",
    ]
    for mode, t in report["ttft"].items():
        rows.append(
            f"| {mode} | {t['turn_1_ms']:.1f} | {t[f'turn_{num_turns}_ms']:.1f} | "
            f"{t['ratio']:.2f} |"
        )
    sessions = report["ttft"]["sessions"]
    if "prefill_turn_1" in sessions:
        (c1, n1), (cn, nn) = sessions["prefill_turn_1"], sessions[f"prefill_turn_{num_turns}"]
        rows.append(
            f"\nprompt tokens with sessions, cached + prefilled: turn 1 {c1} + {n1}, "
            f"turn {num_turns} {cn} + {nn} (the floor row evaluates the same counts)"
        )
    e = report["exactly_once"]
    if not e["sessions"]:
        return "\n".join(rows)
    rows.append(
        f"\n{e['sessions']} sessions x {e['turns']} turns, {e['concurrency']} concurrent,"
        f" {e['redis_restarts']} Redis restart: {e['num_turns_found']} of "
        f"{e['expected_turns']} turns stored (user + assistant), problems: "
        f"{len(e['problems'])}, retried calls: {e['retries']} ({e['refused_503']} x 503),"
        f" {e['elapsed_s']:.0f} s"
    )
    return "\n".join(rows)


def add_args(p: argparse.ArgumentParser) -> None:
    """This suite's options (`ultrafast bench sessions --help`)."""
    add_model(p)
    add_executor(p)
    add_server_slots(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="server positions per slot, capped by the model (default 4096)",
    )
    add_rounds(p, 3, "conversations timed per mode")
    add_threads(p, "the server's --threads (default: the serve default)")
    p.add_argument("--batch-threads", type=int, default=None, help="the server's --batch-threads")
    p.add_argument("--turns", type=int, default=20, help="turns per conversation (default 20)")
    p.add_argument("--turn-tokens", type=int, default=50, help="user turn size (default 50)")
    p.add_argument(
        "--reply-tokens",
        type=int,
        default=40,
        help="answer size (default 40: turns of ~100 tokens in all, so 20 of them "
        "fit the demo model's 2048 positions)",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=200,
        help="conversations of the exactly-once run (0: time to first token only)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="conversations at once in the exactly-once run (default 16)",
    )
    p.add_argument(
        "--answer-tokens",
        type=int,
        default=16,
        help="answer size in the exactly-once run (default 16)",
    )
    sessions_oversub.add_oversubscribed_args(p)
    add_out(p, "runs/bench_sessions.json")
