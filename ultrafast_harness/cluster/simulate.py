"""A discrete-event simulation of a fleet of replicas behind one router (no Ray, no model).

Each replica runs the engine's step loop in miniature: every step carries one token of each
running decode plus whole prefills admitted in tier order (priority first) while slots and the
step's token budget allow, and lasts base_s + per_seq_s * (seqs - 1) + per_token_s * tokens,
the form engine/step_costs.py fits online (`StepCostModel` is fitted here from observed steps
and its fit drives the run). A replica's KV cache is an LRU of prompt blocks: a request's
cached prefix is what that replica really holds, whatever the router guessed.

Traffic: Poisson arrivals whose rate jumps between bursts and lulls every few tens of ms; most
requests want 1 output token, some 64 (the stress test's irregular pattern); some are turns of
conversations whose prompt grows by each turn, the rest share one of a few system prompts.
Policies: `ultrafast` (cluster/router.py), `random`, `round_robin`.

    python -m ultrafast_harness.cluster.simulate --rate 10000 --replicas 64 --duration-s 10
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ultrafast.cluster.router import (
    CHARS_PER_TOKEN,
    PREFIX_BLOCK_CHARS,
    TIERS,
    Router,
    RouterConfig,
    RouteRequest,
    block_hashes,
)
from ultrafast.engine.step_costs import StepCostModel

POLICIES = ("ultrafast", "random", "round_robin")


@dataclass
class SimConfig:
    rate: float = 10_000.0  # requests per second, on average
    replicas: int = 64
    duration_s: float = 10.0
    seed: int = 0
    # step cost: an accelerator-class fit for a 135M model (flags override with a CPU fit)
    base_s: float = 0.003
    per_token_s: float = 0.000015
    per_seq_s: float = 0.00005
    num_slots: int = 32
    step_token_budget: int = 2048
    cache_blocks: int = 4096  # prompt blocks a replica's KV holds
    tier_mix: tuple = (0.2, 0.6, 0.2)  # priority, default, flex
    long_output_share: float = 0.1  # 64-token requests; the rest want 1 token
    conversation_share: float = 0.3
    system_prompts: int = 8
    system_prompt_tokens: int = 400
    report_interval_s: float = 0.05  # replicas report their queues this often
    priority_target_s: float = 0.25


@dataclass
class SimRequest:
    arrival_s: float
    tier: str
    text: str
    output_tokens: int
    key: str | None
    first_token_s: float | None = None
    cached_tokens: int = 0
    uncached_tokens: int = 0
    counted_tokens: int = 0  # what the router counted as dispatched
    replica: int = -1


@dataclass
class SimReplica:
    index: int
    queues: dict = field(default_factory=lambda: {t: deque() for t in TIERS})
    running: list = field(default_factory=list)  # [request, decode tokens left]
    busy: bool = False
    cache: OrderedDict = field(default_factory=OrderedDict)

    def pending_tokens(self) -> dict:
        return {t: sum(r.uncached_tokens for r in q) for t, q in self.queues.items()}


def step_costs_for(cfg: SimConfig) -> StepCostModel:
    """A StepCostModel fitted from steps of the configured cost, as the engine would see them."""
    model = StepCostModel()
    for seqs, tokens in ((1, 1), (1, 64), (8, 8), (4, 512), (16, 300), (2, 2048), (32, 32)):
        elapsed = cfg.base_s + cfg.per_seq_s * (seqs - 1) + cfg.per_token_s * tokens
        model.observe(seqs, tokens, elapsed)
    return model


class Simulation:
    def __init__(self, cfg: SimConfig, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        self.cfg, self.policy = cfg, policy
        self.rng = random.Random(cfg.seed)
        self.costs = step_costs_for(cfg)
        self.replicas = [SimReplica(i) for i in range(cfg.replicas)]
        names = [str(i) for i in range(cfg.replicas)]
        targets = {"priority": cfg.priority_target_s, "default": 5.0, "flex": 60.0}
        self.router = Router(names, RouterConfig(ttft_target_s=targets))
        for name in names:
            self.router.report(name, self._stats(self.replicas[int(name)]))
        self.events: list = []  # (time, seq, kind, payload)
        self._seq = 0
        self._rr = 0
        self.done: list[SimRequest] = []
        self.refused: dict = dict.fromkeys(TIERS, 0)
        self.systems = [self._words(cfg.system_prompt_tokens) for _ in range(cfg.system_prompts)]
        self.conversations: dict[str, str] = {}

    def _words(self, tokens: int) -> str:
        n = max(1, int(tokens * CHARS_PER_TOKEN))
        return f"{self.rng.getrandbits(4 * n):0{n}x}"  # n random hex digits, fast

    def _push(self, t: float, kind: str, payload) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload))

    def _stats(self, rep: SimReplica) -> dict:
        return {
            "ready": True,
            "base_s": self.costs.base_s,
            "per_token_s": self.costs.per_token_s,
            "per_seq_s": self.costs.per_seq_s,
            "num_running": len(rep.running),
            "num_slots": self.cfg.num_slots,
            "pending_tokens": rep.pending_tokens(),
        }

    # -- traffic -----------------------------------------------------------------------------

    def _new_request(self, now: float) -> SimRequest:
        cfg, rng = self.cfg, self.rng
        tier = rng.choices(TIERS, weights=cfg.tier_mix)[0]
        output = 64 if rng.random() < cfg.long_output_share else 1
        if rng.random() < cfg.conversation_share:
            if self.conversations and rng.random() < 0.8:
                key = rng.choice(list(self.conversations))
            else:
                key = f"conv-{self._seq}"
                self.conversations[key] = rng.choice(self.systems)
                if len(self.conversations) > 20 * cfg.replicas:  # old ones end
                    self.conversations.pop(next(iter(self.conversations)))
            text = self.conversations[key] + self._words(rng.randint(20, 80))
            self.conversations[key] = text + self._words(output)  # the answer joins the history
            return SimRequest(now, tier, text, output, key)
        text = rng.choice(self.systems) + self._words(rng.randint(10, 120))
        return SimRequest(now, tier, text, output, None)

    def _arrivals(self) -> None:
        t, end = 0.0, self.cfg.duration_s
        while t < end:  # bursts and lulls: the rate jumps every 20-80 ms
            window = self.rng.uniform(0.02, 0.08)
            rate = self.cfg.rate * self.rng.choice((0.3, 0.6, 1.0, 1.4, 2.0))
            stop = min(end, t + window)
            while True:
                t += self.rng.expovariate(rate)
                if t >= stop:
                    t = stop
                    break
                self._push(t, "arrive", None)

    # -- routing -----------------------------------------------------------------------------

    def _route(self, req: SimRequest) -> int | None:
        n = len(self.replicas)
        if self.policy == "random":
            return self.rng.randrange(n)
        if self.policy == "round_robin":
            self._rr = (self._rr + 1) % n
            return self._rr
        route = RouteRequest(tier=req.tier, affinity_key=req.key, prompt_text=req.text)
        decision = self.router.choose(route)
        if decision.replica is None:
            return None
        req.counted_tokens = self.router.dispatched(decision.replica, route)
        return int(decision.replica)

    # -- replicas ----------------------------------------------------------------------------

    def _arrive(self, now: float) -> None:
        req = self._new_request(now)
        index = self._route(req)
        if index is None:
            self.refused[req.tier] += 1
            return
        rep = self.replicas[index]
        req.replica = index
        hashes = block_hashes(req.text)
        matched = 0
        for h in hashes:
            if h not in rep.cache:
                break
            matched += 1
        total = max(1, int(len(req.text) / CHARS_PER_TOKEN))
        req.cached_tokens = min(total - 1, int(matched * PREFIX_BLOCK_CHARS / CHARS_PER_TOKEN))
        req.uncached_tokens = total - req.cached_tokens
        for h in hashes:
            rep.cache[h] = None
            rep.cache.move_to_end(h)
        while len(rep.cache) > self.cfg.cache_blocks:
            rep.cache.popitem(last=False)
        rep.queues[req.tier].append(req)
        if not rep.busy:
            self._start_step(rep, now)

    def _start_step(self, rep: SimReplica, now: float) -> None:
        cfg = self.cfg
        decodes = list(rep.running)
        admitted: list[SimRequest] = []
        tokens = len(decodes)
        for tier in TIERS:
            queue = rep.queues[tier]
            while queue and len(decodes) + len(admitted) < cfg.num_slots:
                nxt = queue[0]
                if admitted and tokens + nxt.uncached_tokens > cfg.step_token_budget:
                    break
                admitted.append(queue.popleft())
                tokens += nxt.uncached_tokens
        if not decodes and not admitted:
            rep.busy = False
            return
        seqs = len(decodes) + len(admitted)
        elapsed = self.costs.base_s or cfg.base_s
        elapsed += (self.costs.per_token_s or cfg.per_token_s) * tokens
        elapsed += self.costs.per_seq_s * (seqs - 1)
        rep.busy = True
        self._push(now + elapsed, "step", (rep.index, admitted))

    def _end_step(self, now: float, index: int, admitted: list[SimRequest]) -> None:
        rep = self.replicas[index]
        still = []
        for entry in rep.running:
            entry[1] -= 1
            if entry[1] > 0:
                still.append(entry)
        for req in admitted:
            req.first_token_s = now
            self.done.append(req)
            if self.policy == "ultrafast":
                self.router.first_token(str(index), req.tier, req.counted_tokens)
                self.router.finished(str(index))
            if req.output_tokens > 1:
                still.append([req, req.output_tokens - 1])
        rep.running = still
        self._start_step(rep, now)

    def run(self) -> dict:
        self._arrivals()
        if self.policy == "ultrafast":
            t = 0.0
            while t < self.cfg.duration_s:
                t += self.cfg.report_interval_s
                self._push(t, "report", None)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(now)
            elif kind == "step":
                self._end_step(now, *payload)
            else:
                for rep in self.replicas:
                    self.router.report(str(rep.index), self._stats(rep))
        return self.summary()

    def summary(self) -> dict:
        out: dict = {"policy": self.policy, "replicas": self.cfg.replicas, "tiers": {}}
        for tier in TIERS:
            ttfts = sorted(
                r.first_token_s - r.arrival_s
                for r in self.done
                if r.tier == tier and r.first_token_s is not None
            )
            out["tiers"][tier] = {
                "served": len(ttfts),
                "refused": self.refused[tier],
                "p50_ms": round(1000 * _pct(ttfts, 0.50), 2),
                "p99_ms": round(1000 * _pct(ttfts, 0.99), 2),
            }
        cached = sum(r.cached_tokens for r in self.done)
        total = cached + sum(r.uncached_tokens for r in self.done)
        out["prefix_hit_rate"] = round(cached / total, 4) if total else 0.0
        out["routing"] = self.router.decisions if self.policy == "ultrafast" else {}
        return out


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def replicas_needed(cfg: SimConfig, policy: str, counts: list[int]) -> int | None:
    """The fewest replicas (of `counts`) whose priority p99 TTFT meets the target with at most
    1% of priority requests refused."""
    for n in sorted(counts):
        tiers = Simulation(_with(cfg, replicas=n), policy).run()["tiers"]["priority"]
        served, refused = tiers["served"], tiers["refused"]
        met = tiers["p99_ms"] <= 1000 * cfg.priority_target_s
        if met and refused <= 0.01 * max(1, served + refused):
            return n
    return None


def _with(cfg: SimConfig, **changes) -> SimConfig:
    from dataclasses import replace

    return replace(cfg, **changes)


def markdown_table(results: list[dict], needed: dict) -> str:
    lines = [
        "| policy | priority p50 / p99 ms | default p50 / p99 ms | flex p50 / p99 ms "
        "| priority refused | prefix hit rate | replicas for priority p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        t = r["tiers"]
        cells = [f"{t[x]['p50_ms']:.1f} / {t[x]['p99_ms']:.1f}" for x in TIERS]
        need = needed.get(r["policy"])
        lines.append(
            f"| {r['policy']} | {' | '.join(cells)} | {t['priority']['refused']} "
            f"| {r['prefix_hit_rate']:.1%} | {need if need is not None else '> scanned'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rate", type=float, default=SimConfig.rate)
    p.add_argument("--replicas", type=int, default=SimConfig.replicas)
    p.add_argument("--duration-s", type=float, default=SimConfig.duration_s)
    p.add_argument("--seed", type=int, default=SimConfig.seed)
    p.add_argument("--base-ms", type=float, default=1000 * SimConfig.base_s)
    p.add_argument("--per-token-ms", type=float, default=1000 * SimConfig.per_token_s)
    p.add_argument("--per-seq-ms", type=float, default=1000 * SimConfig.per_seq_s)
    p.add_argument("--priority-target-ms", type=float, default=1000 * SimConfig.priority_target_s)
    p.add_argument(
        "--scan", default="", help="replica counts to try for the priority target, e.g. 32,48,64"
    )
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    cfg = SimConfig(
        rate=args.rate,
        replicas=args.replicas,
        duration_s=args.duration_s,
        seed=args.seed,
        base_s=args.base_ms / 1000,
        per_token_s=args.per_token_ms / 1000,
        per_seq_s=args.per_seq_ms / 1000,
        priority_target_s=args.priority_target_ms / 1000,
    )
    results = [Simulation(cfg, policy).run() for policy in POLICIES]
    counts = [int(x) for x in args.scan.split(",") if x.strip()]
    needed = {p: replicas_needed(cfg, p, counts) for p in POLICIES} if counts else {}
    print(markdown_table(results, needed))
    for r in results:
        if r["routing"]:
            print(f"routing decisions ({r['policy']}): {json.dumps(r['routing'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results, "needed": needed}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
