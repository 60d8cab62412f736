"""`ultrafast bench sessions --oversubscribed`: more live conversations than KV slots.

Conversations take turns round-robin, so without the tiered KV cache each next turn finds its
slot taken by another conversation and recomputes its whole history. Measured per server
configuration (no tiers; L2 host memory + L3 disk):
- the warm-slot TTFT: as many conversations as slots, so every next turn finds its slot
- the next-turn TTFT of `--oversub-conversations` conversations round-robin over the slots
- the same after `kill -9` and a restart on the same disk tier halfway through (tiers only)
- turns/s of `--throughput-conversations` conversations at once on the same slots, beside
  two ceilings for the same turn shapes: every conversation warm in a slot of its own (as many
  slots as conversations) and as many conversations as slots; the four setups run round by
  round, interleaved, so a noisy machine weighs on all of them alike
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from ultrafast_harness.bench.report import write_report
from ultrafast_harness.bench.session_chat import _stream_chat, user_text


class Conversation:
    def __init__(self, base_url: str, salt: int, turn_tokens: int, turns: int):
        self.texts = [user_text(base_url, turn_tokens, salt * 1000 + k) for k in range(turns)]
        self.history: list[dict] = []
        self.turn = 0

    def next_turn(self, client: httpx.Client, reply_tokens: int, tier: str) -> float:
        """Sends the next user turn with the whole history; returns its TTFT in seconds."""
        new = {"role": "user", "content": self.texts[self.turn]}
        body = {
            "messages": self.history + [new],
            "max_tokens": reply_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "service_tier": tier,
        }
        ttft_s, answer, _ = _stream_chat(client, body)
        self.history += [new, {"role": "assistant", "content": answer}]
        self.turn += 1
        return ttft_s


def _round_robin(
    base_url: str, conversations: list[Conversation], turns: range, reply_tokens: int
) -> list[float]:
    """TTFTs of every turn after each conversation's first, one call at a time."""
    ttfts = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for k in turns:
            for conv in conversations:
                ttft_s = conv.next_turn(client, reply_tokens, "priority")
                if k:
                    ttfts.append(ttft_s)
    return ttfts


def _throughput(base_url: str, args, salt: int, num_conversations: int) -> dict:
    """Turns/s of conversations running at once, each turn after the previous answer."""
    convs = [
        Conversation(base_url, salt + i, args.turn_tokens, args.oversub_turns)
        for i in range(num_conversations)
    ]
    ttfts: list[float] = []

    def run(conv: Conversation) -> None:
        with httpx.Client(base_url=base_url, timeout=600) as client:
            for k in range(args.oversub_turns):
                ttft_s = conv.next_turn(client, args.reply_tokens, "default")
                if k:
                    ttfts.append(ttft_s)

    started = time.perf_counter()
    with ThreadPoolExecutor(len(convs)) as pool:
        for future in [pool.submit(run, c) for c in convs]:
            future.result()
    return {
        "turns": len(convs) * args.oversub_turns,
        "seconds": time.perf_counter() - started,
        "next_turn_ttfts_s": ttfts,
    }


def _median_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values) if values else float("nan")


def measure(args, server_args: tuple[str, ...], tiered: bool, disk_dir: str) -> dict:
    from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR, ServerProcess

    tier_args = _tier_args(args, disk_dir) if tiered else ()

    def start() -> ServerProcess:
        return ServerProcess(
            *server_args,
            *tier_args,
            model=args.model or DEMO_MODEL_DIR,
            num_slots=args.num_slots,
            max_model_len=args.max_model_len,
        )

    srv = start()
    salt = 5000 if tiered else 7000
    try:
        turns = args.oversub_turns
        warm = [Conversation(srv.url, salt + i, args.turn_tokens, turns) for i in range(2)]
        _round_robin(srv.url, warm, range(1), args.reply_tokens)  # warm-up of the server
        warm = [
            Conversation(srv.url, salt + 10 + i, args.turn_tokens, turns)
            for i in range(args.num_slots)
        ]
        warm_ttfts = _round_robin(srv.url, warm, range(turns), args.reply_tokens)
        many = [
            Conversation(srv.url, salt + 100 + i, args.turn_tokens, turns)
            for i in range(args.oversub_conversations)
        ]
        oversub_ttfts = _round_robin(srv.url, many, range(turns), args.reply_tokens)
        result = {
            "warm_slot_ttft_ms": _median_ms(warm_ttfts),
            "next_turn_ttft_ms": _median_ms(oversub_ttfts),
        }
        result["ratio"] = result["next_turn_ttft_ms"] / result["warm_slot_ttft_ms"]
        if tiered:  # kill -9 halfway through a fresh set of conversations, then go on
            fresh = [
                Conversation(srv.url, salt + 300 + i, args.turn_tokens, turns)
                for i in range(args.oversub_conversations)
            ]
            half = max(1, turns // 2)
            _round_robin(srv.url, fresh, range(half), args.reply_tokens)
            time.sleep(1.0)  # the last turn's write-through reaches the disk
            srv.proc.kill()
            srv.proc.wait()
            srv = start()
            after = _round_robin(srv.url, fresh, range(half, turns), args.reply_tokens)
            # turn `half` of each conversation is its first on the new process
            result["after_restart_ttft_ms"] = _median_ms(after)
            result["after_restart_ratio"] = (
                result["after_restart_ttft_ms"] / result["warm_slot_ttft_ms"]
            )
        return result
    finally:
        srv.stop()


def _tier_args(args, disk_dir: str) -> tuple[str, ...]:
    return ("--kv-host-cache-gb", str(args.kv_host_cache_gb), "--kv-disk-dir", disk_dir)


# setup -> (its server, how many conversations at once); the servers are made by `throughput`
SETUPS = {
    "no_tiers": ("plain", "many"),
    "tiers": ("tiered", "many"),
    "own_slot_each": ("wide", "many"),  # ceiling: every conversation's KV stays in its slot
    "as_many_as_slots": ("plain", "slots"),  # ceiling: no conversation ever loses its slot
}


def throughput(args, server_args: tuple[str, ...], disk_dir: str) -> dict:
    """Turns/s of each setup of SETUPS, `--throughput-rounds` interleaved rounds, with
    fresh conversations every round (so no round finds another's KV)."""
    from ultrafast_harness.bench.server_process import DEMO_MODEL_DIR, ServerProcess

    many, slots = args.throughput_conversations, args.num_slots
    server_shapes = {
        "plain": (slots, ()),
        "tiered": (slots, _tier_args(args, str(Path(disk_dir) / "throughput"))),
        "wide": (max(many, slots), ()),
    }
    counts = {"many": many, "slots": slots}
    runs: dict[str, list[dict]] = {name: [] for name in SETUPS}
    with contextlib.ExitStack() as stack:
        servers = {}
        for key, (num_slots, extra) in server_shapes.items():
            srv = ServerProcess(
                *server_args,
                *extra,
                model=args.model or DEMO_MODEL_DIR,
                num_slots=num_slots,
                max_model_len=args.max_model_len,
            )
            stack.callback(srv.stop)
            warm = [Conversation(srv.url, 900 + i, args.turn_tokens, 1) for i in range(2)]
            _round_robin(srv.url, warm, range(1), args.reply_tokens)  # the server's warm-up
            servers[key] = srv
        for r in range(args.throughput_rounds):
            for i, (name, (server, count)) in enumerate(SETUPS.items()):
                salt = 20_000 + 1000 * (r * len(SETUPS) + i)
                runs[name].append(_throughput(servers[server].url, args, salt, counts[count]))
    return {
        name: {
            "slots": server_shapes[SETUPS[name][0]][0],
            "conversations": counts[SETUPS[name][1]],
            "turns_per_s": sum(x["turns"] for x in rs) / sum(x["seconds"] for x in rs),
            "rounds_turns_per_s": [x["turns"] / x["seconds"] for x in rs],
            "next_turn_ttft_ms": _median_ms([t for x in rs for t in x["next_turn_ttfts_s"]]),
        }
        for name, rs in runs.items()
    }


def main(args, server_args: tuple[str, ...]) -> int:
    for flag in ("throughput_rounds", "throughput_conversations", "oversub_conversations"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.oversub_turns < 2:
        raise SystemExit("--oversub-turns must be at least 2 (next turns are measured)")
    with tempfile.TemporaryDirectory(prefix="uf-kv-bench-") as disk_dir:
        report = {
            "conversations": args.oversub_conversations,
            "num_slots": args.num_slots,
            "turns": args.oversub_turns,
            "throughput_conversations": args.throughput_conversations,
            "throughput_rounds": args.throughput_rounds,
            "turn_tokens": args.turn_tokens,
            "reply_tokens": args.reply_tokens,
            "no_tiers": measure(args, server_args, False, disk_dir),
            "tiers": measure(args, server_args, True, disk_dir),
            "throughput": throughput(args, server_args, disk_dir),
        }
    tp = report["throughput"]
    for key in ("no_tiers", "tiers"):  # where earlier reports had them
        report[key]["turns_per_s"] = tp[key]["turns_per_s"]
    report["turns_per_s_gain"] = tp["tiers"]["turns_per_s"] / tp["no_tiers"]["turns_per_s"]
    return write_report(report, args.out, markdown(report))


SETUP_LABELS = {
    "no_tiers": "no KV tiers",
    "tiers": "L2 host + L3 disk",
    "own_slot_each": "ceiling: a slot per conversation",
    "as_many_as_slots": "ceiling: as many conversations as slots",
}


def markdown(report: dict) -> str:
    rows = [
        f"{report['conversations']} conversations round-robin over {report['num_slots']} slots, "
        f"{report['turns']} turns each (next-turn TTFT median, turns 2..n)",
        "",
        "| server | warm-slot TTFT (ms) | next-turn TTFT (ms) | ratio (target <= 1.5) |",
        "|---|---|---|---|",
    ]
    for name, key in (("no KV tiers", "no_tiers"), ("L2 host + L3 disk", "tiers")):
        r = report[key]
        rows.append(
            f"| {name} | {r['warm_slot_ttft_ms']:.1f} | {r['next_turn_ttft_ms']:.1f} | "
            f"{r['ratio']:.2f} |"
        )
    t = report["tiers"]
    rows.append(
        f"| L3 disk after kill -9 + restart | {t['warm_slot_ttft_ms']:.1f} | "
        f"{t['after_restart_ttft_ms']:.1f} | {t['after_restart_ratio']:.2f} |"
    )
    tp = report["throughput"]
    base = tp["no_tiers"]["turns_per_s"]
    rows += [
        "",
        f"turns/s, the same turn shapes ({report['turns']} turns each), "
        f"{report['throughput_rounds']} interleaved rounds:",
        "",
        "| setup | slots | conversations at once | turns/s | per round | next-turn TTFT (ms) "
        "| vs no tiers |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in SETUP_LABELS.items():
        r = tp[key]
        rounds = " ".join(f"{x:.2f}" for x in r["rounds_turns_per_s"])
        rows.append(
            f"| {label} | {r['slots']} | {r['conversations']} | {r['turns_per_s']:.2f} | "
            f"{rounds} | {r['next_turn_ttft_ms']:.1f} | {r['turns_per_s'] / base:.2f}x |"
        )
    return "\n".join(rows)


def add_oversubscribed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--oversubscribed",
        action="store_true",
        help="instead: more conversations than slots, round-robin, with and without the "
        "tiered KV cache (next-turn vs warm-slot TTFT, after kill -9 + restart, turns/s)",
    )
    p.add_argument("--oversub-conversations", type=int, default=12, help="(default 12)")
    p.add_argument("--oversub-turns", type=int, default=6, help="(default 6)")
    p.add_argument(
        "--throughput-conversations",
        type=int,
        default=16,
        help="conversations at once for turns/s (default 16)",
    )
    p.add_argument(
        "--throughput-rounds",
        type=int,
        default=3,
        help="interleaved rounds of the turns/s setups (no tiers, tiers, the two ceilings; "
        "default 3)",
    )
    p.add_argument(
        "--kv-host-cache-gb",
        type=float,
        default=1.0,
        help="the tiered server's L2 budget (its L3 is a temporary directory)",
    )
