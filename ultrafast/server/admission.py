"""SLO-aware admission: per-tier capacity, and a time-to-first-token prediction for each arrival.

Runs on the event loop only (single-threaded, so counts are exact under races). Step costs
come from the engine's own online fit, read as the frozen `StepCostSnapshot` the engine thread
publishes (server/bridge.py), never the live model.

A priority request is refused at once with 429 only for the wait the server's load adds: the
prefill queued ahead of it and the running sequences that share its steps, at the measured
cost. Its own prefill is never a reason: an idle server runs whatever arrives, however long
its prompt. The queue may add up to the TTFT target minus the request's own prefill, that
prefill counted at most as a typical prompt's (so a long prompt may wait as long as a typical
one may). `auto` requests fall back to the default tier instead. Capacity checks come before
any tokenizing. Auto TTFT targets are resolved here from the engine's measured idle speed
(TierTargets.resolved).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ultrafast.config import ServerConfig, TierTargets
from ultrafast.request import ServiceTier
from ultrafast.server.bridge import StepCostSnapshot
from ultrafast.server.errors import APIError


@dataclass
class Ticket:
    """One admitted API call, holding its tier's capacity until released."""

    tier: ServiceTier
    tenant: str = ""
    num_prompt_tokens: int = 0
    prefill_pending: bool = False
    predicted_ttft_s: float = 0.0
    released: bool = False


def _num_nothing_running() -> int:
    return 0


DEFAULT_AUTO_IN_FLIGHT = 1024  # when the memory is not known
# what one call in flight may hold: its prompt's token ids and text, and a stream buffer
_BYTES_PER_QUEUED_POSITION = 64
_IN_FLIGHT_MEMORY_FRACTION = 1 / 32


def auto_in_flight(available_bytes: int | None, max_model_len: int, max_waiting: int) -> int:
    """Calls in flight a tier with max_in_flight 0 may hold: as many full-context prompts as
    1/32 of free memory keeps, within half the engine's waiting queue (two such tiers share
    it). A count that only protects memory: the predicted wait refuses long before it."""
    cap = max(1, max_waiting // 2)
    if not available_bytes:
        return min(DEFAULT_AUTO_IN_FLIGHT, cap)
    per_call = _BYTES_PER_QUEUED_POSITION * max(1, max_model_len)
    return max(1, min(cap, int(available_bytes * _IN_FLIGHT_MEMORY_FRACTION) // per_call))


@dataclass
class Admission:
    config: ServerConfig  # auto TTFT targets are resolved in __post_init__
    # the engine's latest published fit (EngineThread.snapshot().step_costs)
    step_costs: Callable[[], StepCostSnapshot] = StepCostSnapshot
    # sequences the engine runs now (EngineThread.snapshot().num_running)
    num_running: Callable[[], int] = _num_nothing_running
    # the engine's idle speed measured at start (EngineSnapshot.idle_speed): a typical prompt's
    # length and its time to first token; None = not measured (auto targets take their floor)
    typical_prompt_tokens: int = 0
    idle_ttft_s: float | None = None
    in_flight: dict = field(default_factory=lambda: {t: 0 for t in ServiceTier})
    pending_prefill_tokens: dict = field(default_factory=lambda: {t: 0 for t in ServiceTier})
    refused: dict = field(default_factory=dict)  # reason -> count, for metrics
    # committed capacity: tenant -> priority seats that no other tenant may take
    priority_reserved: dict = field(default_factory=dict)
    priority_by_tenant: dict = field(default_factory=dict)  # tenant -> priority calls in flight
    # calls in flight a tier whose max_in_flight is 0 (auto) may hold: auto_in_flight()
    auto_in_flight_limit: int = DEFAULT_AUTO_IN_FLIGHT
    # tiers whose TTFT target was auto (0) as configured: resolved from the measured speed
    auto_ttft_tiers: frozenset = field(init=False, default=frozenset())
    auto_in_flight_tiers: frozenset = field(init=False, default=frozenset())
    configured: ServerConfig | None = field(init=False, default=None)  # before resolution

    def __post_init__(self) -> None:
        config = self.configured = self.config
        self.auto_ttft_tiers = frozenset(
            t for t in ServiceTier if self._configured(config, t).ttft_auto
        )
        self.auto_in_flight_tiers = frozenset(
            t for t in ServiceTier if self._configured(config, t).max_in_flight == 0
        )
        self._resolve()

    def update_idle_speed(self, typical_prompt_tokens: int, idle_ttft_s: float | None) -> None:
        """The idle speed measured after the start (in the background, or again after a
        drift): the auto TTFT targets follow it."""
        self.typical_prompt_tokens, self.idle_ttft_s = typical_prompt_tokens, idle_ttft_s
        self._resolve()

    def _resolve(self) -> None:
        config = self.configured
        assert config is not None

        def resolved(targets: TierTargets) -> TierTargets:
            targets = targets.resolved(self.idle_ttft_s)
            if targets.max_in_flight == 0:
                targets = replace(targets, max_in_flight=self.auto_in_flight_limit)
            return targets

        self.config = replace(
            config,
            priority=resolved(config.priority),
            default=resolved(config.default),
            flex=resolved(config.flex),
        )

    @staticmethod
    def _configured(config: ServerConfig, tier: ServiceTier) -> TierTargets:
        return {
            ServiceTier.PRIORITY: config.priority,
            ServiceTier.DEFAULT: config.default,
            ServiceTier.FLEX: config.flex,
        }[tier]

    def targets(self, tier: ServiceTier) -> TierTargets:
        """The tier's targets, its TTFT resolved (never 0 = auto here)."""
        return self._configured(self.config, tier)

    def describe_targets(self) -> dict:
        """The targets in force and where each TTFT came from, for /ready and the start log."""
        tiers = {}
        for tier in ServiceTier:
            targets = self.targets(tier)
            source = "configured"
            if tier in self.auto_ttft_tiers:  # the floor, or the measured speed past it
                source = "floor" if targets.ttft_ms == targets.ttft_floor_ms else "measured"
            tiers[tier.api_name] = {
                "ttft_ms": round(targets.ttft_ms, 3),
                "ttft_source": source,
                "itl_ms": targets.itl_ms or None,  # None: priority auto (1.2x idle), else no cap
                "max_in_flight": targets.max_in_flight,
                "max_in_flight_source": "memory"
                if tier in self.auto_in_flight_tiers
                else "configured",
            }
        return tiers

    def _refuse(self, reason: str, error: APIError) -> APIError:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        return error

    def _has_seat(self, tier: ServiceTier, tenant: str) -> bool:
        if tier != ServiceTier.PRIORITY or not self.priority_reserved:
            return self.in_flight[tier] < self.targets(tier).max_in_flight
        reserved = self.priority_reserved
        if self.priority_by_tenant.get(tenant, 0) < reserved.get(tenant, 0):
            return True  # within its own committed seats
        num_shared = self.config.priority.max_in_flight - sum(reserved.values())
        used_shared = sum(
            max(0, n - reserved.get(t, 0)) for t, n in self.priority_by_tenant.items()
        )
        return used_shared < num_shared

    def reserve(self, tier: ServiceTier, auto: bool = False, tenant: str = "") -> Ticket:
        """Take a seat in the tier's queue, or 503 queue_full. Called before tokenizing."""
        if auto:
            tier = (
                ServiceTier.PRIORITY
                if self._has_seat(ServiceTier.PRIORITY, tenant)
                else ServiceTier.DEFAULT
            )
        if not self._has_seat(tier, tenant):
            limit = self.targets(tier).max_in_flight
            why = (
                "the limit this machine's memory allows"
                if tier in self.auto_in_flight_tiers
                else "the configured limit"
            )
            retry_s = max(1, math.ceil(self.queue_wait_s(tier)))
            raise self._refuse(
                "queue_full",
                APIError(
                    503,
                    f"the {tier.api_name} queue is full: {limit} calls in flight, {why}; "
                    f"retry in {retry_s} s",
                    "overloaded_error",
                    "queue_full",
                    None,
                    headers={"Retry-After": str(retry_s)},
                ),
            )
        ticket = Ticket(tier, tenant)
        self._count(ticket, +1)
        return ticket

    def _count(self, ticket: Ticket, delta: int) -> None:
        self.in_flight[ticket.tier] += delta
        if ticket.tier == ServiceTier.PRIORITY:
            by_tenant = self.priority_by_tenant
            by_tenant[ticket.tenant] = by_tenant.get(ticket.tenant, 0) + delta

    def queue_wait_s(self, tier: ServiceTier) -> float:
        """The wait the server's load adds before a new request of `tier` has its first token:
        prefill queued at or above its precedence, and one token of each running sequence in
        the steps it shares with them, at the measured costs. 0 on an idle server."""
        costs = self.step_costs()
        ahead = sum(n for t, n in self.pending_prefill_tokens.items() if t <= tier)
        running = max(0, self.num_running())
        # the step's base is paid once whatever it holds: only the added tokens and sequences
        return costs.predict_s(ahead + running) - costs.predict_s(0) + costs.per_seq_s * running

    def own_prefill_s(self, num_prompt_tokens: int) -> float:
        """The request's own prefill on an idle engine (one step at the measured rates; before
        the engine has measured anything, the snapshot's fixed figures)."""
        return self.step_costs().predict_s(num_prompt_tokens)

    def predict_ttft_s(self, tier: ServiceTier, num_prompt_tokens: int) -> float:
        """The wait the load adds, plus the request's own prefill."""
        return self.queue_wait_s(tier) + self.own_prefill_s(num_prompt_tokens)

    def allowed_wait_s(self, tier: ServiceTier, own_s: float) -> float:
        """How long the queue may make a request wait: the target less its own prefill, that
        counted at most as a typical prompt's (a long prompt may wait what a typical one may)."""
        if self.typical_prompt_tokens > 0:
            own_s = min(own_s, self.own_prefill_s(self.typical_prompt_tokens))
        return max(0.0, self.targets(tier).ttft_ms / 1000 - own_s)

    def admit(self, ticket: Ticket, num_prompt_tokens: int, auto: bool) -> Ticket:
        """After tokenizing: may the queue's wait let it meet its TTFT target? Priority
        misses give 429 (auto: default). An idle server admits every request."""
        own_s = self.own_prefill_s(num_prompt_tokens)
        wait_s = self.queue_wait_s(ticket.tier)
        predicted = wait_s + own_s
        if ticket.tier == ServiceTier.PRIORITY:
            over_s = wait_s - self.allowed_wait_s(ticket.tier, own_s)
            if over_s > 0:
                if auto and self.in_flight[ServiceTier.DEFAULT] < self.config.default.max_in_flight:
                    self._move(ticket, ServiceTier.DEFAULT)
                    predicted = self.predict_ttft_s(ticket.tier, num_prompt_tokens)
                else:
                    self.release(ticket)
                    raise self._refuse("slo_unattainable", self._slo_error(own_s, wait_s, over_s))
        else:  # default and flex queue whatever they can start within their (looser) target
            over_s = wait_s - self.allowed_wait_s(ticket.tier, own_s)
            if over_s > 0:
                self.release(ticket)
                allowed_s = self.allowed_wait_s(ticket.tier, own_s)
                raise self._refuse(
                    "wait_over_target", self._wait_error(ticket.tier, wait_s, allowed_s, over_s)
                )
        ticket.num_prompt_tokens = num_prompt_tokens
        ticket.prefill_pending = True
        ticket.predicted_ttft_s = predicted
        self.pending_prefill_tokens[ticket.tier] += num_prompt_tokens
        return ticket

    def _slo_error(self, own_s: float, wait_s: float, over_s: float) -> APIError:
        target_ms = self.config.priority.ttft_ms
        return APIError(
            429,
            f"the priority tier cannot start this request within its {target_ms:.0f} ms "
            f"target: the work queued ahead of it adds ~{wait_s * 1000:.0f} ms (its own "
            f"prefill ~{own_s * 1000:.0f} ms); retry later or use the default tier",
            "rate_limit_error",
            "priority_slo_unattainable",
            "service_tier",
            headers={"Retry-After": str(max(1, math.ceil(over_s)))},
            extra={  # to the microsecond: a small model's wait is a few tens of them, and a
                # refusal must not report the wait that caused it as 0.0 ms
                "predicted_ttft_ms": round((wait_s + own_s) * 1000, 3),
                "queue_wait_ms": round(wait_s * 1000, 3),
                "target_ttft_ms": round(target_ms, 3),
            },
        )

    def _wait_error(
        self, tier: ServiceTier, wait_s: float, allowed_s: float, over_s: float
    ) -> APIError:
        target_ms = self.targets(tier).ttft_ms
        # the wait is compared with what the target leaves after the request's own prefill,
        # so say both: a short queue can be too long for a long prompt
        return APIError(
            429,
            f"the {tier.api_name} tier's predicted wait for a first token, "
            f"~{_seconds(wait_s)} of work queued ahead, is more than the "
            f"~{_seconds(allowed_s)} its {_seconds(target_ms / 1000)} target leaves after this "
            f"request's own prefill; retry later",
            "rate_limit_error",
            "wait_over_target",
            "service_tier",
            headers={"Retry-After": str(max(1, math.ceil(over_s)))},
            extra={"queue_wait_ms": round(wait_s * 1000, 3), "target_ttft_ms": round(target_ms, 3)},
        )

    def _move(self, ticket: Ticket, tier: ServiceTier) -> None:
        self._count(ticket, -1)
        ticket.tier = tier
        self._count(ticket, +1)

    def first_token(self, ticket: Ticket) -> None:
        if ticket.prefill_pending:
            ticket.prefill_pending = False
            self.pending_prefill_tokens[ticket.tier] -= ticket.num_prompt_tokens

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        self.first_token(ticket)
        ticket.released = True
        self._count(ticket, -1)


def _seconds(s: float) -> str:
    """A duration as people read it: milliseconds under a second, else seconds."""
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.3g} s"
