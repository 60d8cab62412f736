"""Which replica serves a request: session affinity, then the cached prefix when it pays, then
the least loaded; a priority request only where its predicted TTFT meets the tier's target.

Pure Python and Ray-free: the cluster ingress (cluster/ingress.py) and the simulation
(ultrafast_harness/cluster/simulate.py) both route with `Router.choose`. Ray's own request
routers cannot do this (docs/ARCHITECTURE.md, "Cluster"): they see headers only, never the
body's session, conversation or prompt, and they queue FIFO across tiers.

Time to first token on a replica is predicted the way its own admission does
(server/admission.py): the prefill queued ahead of the request's tier plus its own uncached
prefill, at the replica's measured step cost. The ingress adds what it dispatched since the
replica's last report, so a burst does not all land on the replica that looked idle.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

TIERS = ("priority", "default", "flex")  # rank order: a tier waits for those before it
REASONS = ("affinity", "prefix", "load", "refused", "unavailable")
PREFIX_BLOCK_CHARS = 64  # prompt text is indexed in blocks this long (about 16 tokens)
CHARS_PER_TOKEN = 4.0  # the ingress does not tokenize: a rough estimate is enough to rank


@dataclass
class ReplicaLoad:
    """What routing knows of one replica: its last report plus the ingress's own count."""

    name: str
    healthy: bool = True  # false: failed a call or its health check; skipped until it reports
    base_s: float = 0.01  # step cost: base + per_token * tokens (engine/step_costs.py)
    per_token_s: float = 0.002
    per_seq_s: float = 0.0
    num_running: int = 0
    num_slots: int = 4
    # prefill tokens queued on the replica per tier, as it last reported
    pending_tokens: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    # prefill tokens the ingress sent since, not yet past their first token
    dispatched_tokens: dict = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    in_flight: int = 0  # requests the ingress has open on it

    def queue_ahead_tokens(self, tier: str) -> int:
        rank = TIERS.index(tier)
        return sum(
            self.pending_tokens.get(t, 0) + self.dispatched_tokens.get(t, 0)
            for t in TIERS[: rank + 1]
        )

    def predict_ttft_s(self, tier: str, uncached_tokens: int) -> float:
        ahead = self.queue_ahead_tokens(tier)
        sharing = self.per_seq_s * self.num_running  # running decodes share every step
        return self.base_s + self.per_token_s * (ahead + uncached_tokens) + sharing


@dataclass
class RouteRequest:
    tier: str = "default"
    affinity_key: str | None = None  # session / conversation / previous response
    home: str | None = None  # the replica known to hold it (a Responses chain's), if any
    cache_hint: str | None = None  # prompt_cache_key: a soft preference
    prompt_text: str = ""  # what the prefix index matches on

    @property
    def prompt_tokens(self) -> int:
        return max(1, int(len(self.prompt_text) / CHARS_PER_TOKEN))


@dataclass
class Decision:
    replica: str | None  # None: refused or nothing to route to
    reason: str  # one of REASONS
    predicted_ttft_s: float = 0.0
    retry_after_s: int = 0  # for a refusal
    fallbacks: tuple = ()  # where to go if the chosen replica fails before answering


def block_hashes(text: str, block: int = PREFIX_BLOCK_CHARS) -> list[bytes]:
    """Chained hashes of the text's whole blocks: equal leading hashes mean an equal prefix."""
    hashes, prev = [], b""
    for start in range(0, len(text) - block + 1, block):
        prev = hashlib.blake2b(prev + text[start : start + block].encode(), digest_size=8).digest()
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """Per replica, an LRU of prefix block hashes it has prefilled (an approximation of its
    KV cache: the ingress never sees the cache itself)."""

    def __init__(self, capacity_blocks: int = 8192):
        self.capacity = capacity_blocks
        self._blocks: dict[str, OrderedDict] = {}

    def record(self, replica: str, hashes: list[bytes]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def matched_blocks(self, replica: str, hashes: list[bytes]) -> int:
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def forget(self, replica: str) -> None:
        self._blocks.pop(replica, None)


def rendezvous(key: str, names: list[str]) -> list[str]:
    """Names ranked for a key (highest random weight): every ingress ranks alike, and losing
    a replica moves only the keys it held."""
    return sorted(
        names,
        key=lambda n: hashlib.blake2b(f"{key}\0{n}".encode(), digest_size=8).digest(),
        reverse=True,
    )


@dataclass
class RouterConfig:
    # TTFT target per tier in seconds; a priority request goes only where it is predicted met
    ttft_target_s: dict = field(
        default_factory=lambda: {"priority": 0.25, "default": 2.0, "flex": 30.0}
    )
    # the cached prefix must save at least this many tokens to beat the least loaded replica
    min_prefix_tokens: int = 32
    # a cache hint (prompt_cache_key) keeps its replica while this much slower than the best
    hint_slack_s: float = 0.05


class Router:
    def __init__(self, replicas: list[str], config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.loads: dict[str, ReplicaLoad] = {n: ReplicaLoad(n) for n in replicas}
        self.prefixes = PrefixIndex()
        self.decisions: dict[str, dict] = {}  # tier -> reason -> count

    # -- replica set -------------------------------------------------------------------------

    def set_replicas(self, names: list[str]) -> None:
        for name in names:
            self.loads.setdefault(name, ReplicaLoad(name))
        for name in list(self.loads):
            if name not in names:
                del self.loads[name]
                self.prefixes.forget(name)

    def mark_down(self, name: str) -> None:
        """A call to it failed: route around it until a report says it is back."""
        if name in self.loads:
            self.loads[name].healthy = False
            self.prefixes.forget(name)  # a restarted replica's cache is empty

    def report(self, name: str, stats: dict) -> None:
        """A replica's routing stats (EngineReplica.routing_stats)."""
        load = self.loads.get(name)
        if load is None:
            return
        load.healthy = bool(stats.get("ready", True))
        targets = stats.get("ttft_target_s")
        if isinstance(targets, dict):  # the replicas' resolved targets (auto: measured)
            self.config.ttft_target_s.update({t: float(v) for t, v in targets.items()})
        for attr in ("base_s", "per_token_s", "per_seq_s"):
            if stats.get(attr) is not None:
                setattr(load, attr, float(stats[attr]))
        load.num_running = int(stats.get("num_running", 0))
        load.num_slots = int(stats.get("num_slots", load.num_slots))
        pending = stats.get("pending_tokens") or {}
        load.pending_tokens = {t: int(pending.get(t, 0)) for t in TIERS}
        # the replica's report now counts what the ingress had dispatched and is still queued
        load.dispatched_tokens = dict.fromkeys(TIERS, 0)

    # -- one request -------------------------------------------------------------------------

    def choose(self, req: RouteRequest) -> Decision:
        decision = self._choose(req)
        by_reason = self.decisions.setdefault(req.tier, dict.fromkeys(REASONS, 0))
        by_reason[decision.reason] += 1
        return decision

    def _choose(self, req: RouteRequest) -> Decision:
        live = [n for n, load in self.loads.items() if load.healthy]
        if not live:
            return Decision(None, "unavailable", retry_after_s=1)
        hashes = block_hashes(req.prompt_text)
        tokens = req.prompt_tokens
        predicted = {}
        for name in live:
            cached = self.prefixes.matched_blocks(name, hashes) * PREFIX_BLOCK_CHARS
            uncached = max(1, tokens - int(cached / CHARS_PER_TOKEN))
            predicted[name] = (
                self.loads[name].predict_ttft_s(req.tier, uncached),
                tokens - uncached,
            )
        target = self.config.ttft_target_s.get(req.tier, math.inf)
        enforce = req.tier == "priority"

        def fits(name: str) -> bool:
            return not enforce or predicted[name][0] <= target

        def decide(name: str, reason: str) -> Decision:
            rest = sorted((n for n in live if n != name), key=lambda n: predicted[n][0])
            return Decision(name, reason, predicted[name][0], fallbacks=tuple(rest))

        if req.home in predicted and fits(req.home):
            return decide(req.home, "affinity")
        if req.affinity_key:
            home = rendezvous(req.affinity_key, live)[0]
            if fits(home):
                return decide(home, "affinity")
        best = min(live, key=lambda n: predicted[n][0])
        if not fits(best):
            over_s = predicted[best][0] - target
            return Decision(None, "refused", predicted[best][0], max(1, math.ceil(over_s)))
        if req.cache_hint and not req.affinity_key:
            hinted = rendezvous(req.cache_hint, live)[0]
            slack = predicted[hinted][0] - predicted[best][0]
            if fits(hinted) and slack <= self.config.hint_slack_s:
                return decide(hinted, "prefix")
        # `best` counts each replica's cached prefix as work saved: it is the prefix replica
        # only when that prefix is long enough to have been the reason
        cached = predicted[best][1] >= self.config.min_prefix_tokens
        return decide(best, "prefix" if cached else "load")

    def dispatched(self, name: str, req: RouteRequest) -> int:
        """The ingress sent `req` to `name`: count its prefill until the first token, and index
        its prompt as cached there. Returns the tokens counted (pass them to `first_token`)."""
        load = self.loads.get(name)
        if load is None:
            return 0
        tokens = req.prompt_tokens
        load.dispatched_tokens[req.tier] = load.dispatched_tokens.get(req.tier, 0) + tokens
        load.in_flight += 1
        self.prefixes.record(name, block_hashes(req.prompt_text))
        return tokens

    def first_token(self, name: str, tier: str, tokens: int) -> None:
        load = self.loads.get(name)
        if load is not None:
            load.dispatched_tokens[tier] = max(0, load.dispatched_tokens.get(tier, 0) - tokens)

    def finished(self, name: str) -> None:
        load = self.loads.get(name)
        if load is not None:
            load.in_flight = max(0, load.in_flight - 1)
