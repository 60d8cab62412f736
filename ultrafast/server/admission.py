"""SLO-aware admission: per-tier capacity, and a time-to-first-token prediction for each arrival.

Runs on the event loop only (single-threaded, so counts are exact under races). Step costs
come from the engine's own online fit, read as the frozen `StepCostSnapshot` the engine thread
publishes (server/bridge.py), never the live model: a priority request is refused at once with
429 when the prefill work ahead of it, at that measured cost, would miss its target; `auto`
requests fall back to the default tier instead. Capacity checks come before any tokenizing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class Admission:
    config: ServerConfig
    # the engine's latest published fit (EngineThread.snapshot().step_costs)
    step_costs: Callable[[], StepCostSnapshot] = StepCostSnapshot
    in_flight: dict = field(default_factory=lambda: {t: 0 for t in ServiceTier})
    pending_prefill_tokens: dict = field(default_factory=lambda: {t: 0 for t in ServiceTier})
    refused: dict = field(default_factory=dict)  # reason -> count, for metrics
    # committed capacity: tenant -> priority seats that no other tenant may take
    priority_reserved: dict = field(default_factory=dict)
    priority_by_tenant: dict = field(default_factory=dict)  # tenant -> priority calls in flight

    def targets(self, tier: ServiceTier) -> TierTargets:
        return {
            ServiceTier.PRIORITY: self.config.priority,
            ServiceTier.DEFAULT: self.config.default,
            ServiceTier.FLEX: self.config.flex,
        }[tier]

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
            raise self._refuse(
                "queue_full",
                APIError(
                    503,
                    f"the {tier.api_name} queue is full; retry shortly",
                    "overloaded_error",
                    "queue_full",
                    None,
                    headers={"Retry-After": "1"},
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

    def predict_ttft_s(self, tier: ServiceTier, num_prompt_tokens: int) -> float:
        """Prefill work at or above this tier's precedence, plus one step, at measured rates."""
        ahead = sum(n for t, n in self.pending_prefill_tokens.items() if t <= tier)
        # before the engine has measured anything, the snapshot falls back to fixed figures
        return self.step_costs().predict_s(ahead + num_prompt_tokens)

    def admit(self, ticket: Ticket, num_prompt_tokens: int, auto: bool) -> Ticket:
        """After tokenizing: check the TTFT target; priority misses give 429 (auto: default)."""
        predicted = self.predict_ttft_s(ticket.tier, num_prompt_tokens)
        target_s = self.targets(ticket.tier).ttft_ms / 1000
        if ticket.tier == ServiceTier.PRIORITY and predicted > target_s:
            if auto and self.in_flight[ServiceTier.DEFAULT] < self.config.default.max_in_flight:
                self._move(ticket, ServiceTier.DEFAULT)
                predicted = self.predict_ttft_s(ticket.tier, num_prompt_tokens)
            else:
                self.release(ticket)
                wait_s = max(1, int(predicted - target_s + 0.999))
                raise self._refuse(
                    "slo_unattainable",
                    APIError(
                        429,
                        f"the priority tier cannot start this request within its "
                        f"{self.config.priority.ttft_ms:.0f} ms target (predicted "
                        f"{predicted * 1000:.0f} ms); retry later or use the default tier",
                        "rate_limit_error",
                        "priority_slo_unattainable",
                        "service_tier",
                        headers={"Retry-After": str(wait_s)},
                        extra={"predicted_ttft_ms": round(predicted * 1000, 1)},
                    ),
                )
        ticket.num_prompt_tokens = num_prompt_tokens
        ticket.prefill_pending = True
        ticket.predicted_ttft_s = predicted
        self.pending_prefill_tokens[ticket.tier] += num_prompt_tokens
        return ticket

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
