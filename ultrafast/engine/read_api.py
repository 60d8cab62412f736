"""The engine's read API for the server (reached through server/bridge.py only).

The server never touches EngineCore, its scheduler or its KV pool: it reads an immutable
snapshot the engine thread publishes, asks for cached prefixes under a lock, and changes
settings through the inbox. Moving the engine to its own process then changes bridge.py only.
The inbox's items are the small frozen dataclasses below (`InboxItem`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ultrafast.core.types import RequestOutput
from ultrafast.engine.core import EngineCore
from ultrafast.engine.idle_speed import IdleSpeed
from ultrafast.engine.step_costs import StepCostModel
from ultrafast.request import Request

OutputCallback = Callable[[RequestOutput], None]
SNAPSHOT_MAX_AGE_S = 0.02  # a busy engine republishes at most this stale; idle: at once


@dataclass(frozen=True)
class StepCostSnapshot:
    """The step-cost fit's coefficients at one moment (None: not measured yet)."""

    base_s: float | None = None
    per_token_s: float | None = None
    per_seq_s: float = 0.0
    single_decode_s: float | None = None  # one sequence, one token: the idle inter-token time

    @property
    def measured(self) -> bool:
        return self.base_s is not None and self.per_token_s is not None

    def predict_s(self, num_tokens: int, fallback: tuple[float, float] = (0.01, 0.002)) -> float:
        """One step holding `num_tokens` tokens of one sequence; before any measurement, the
        `fallback` (base_s, per_token_s) stands in."""
        base_s, per_token_s = fallback
        if self.base_s is not None and self.per_token_s is not None:  # measured
            base_s, per_token_s = self.base_s, self.per_token_s
        return base_s + num_tokens * per_token_s

    @classmethod
    def of(cls, costs: StepCostModel) -> StepCostSnapshot:
        return cls(costs.base_s, costs.per_token_s, costs.per_seq_s, costs.single_decode_s)


@dataclass(frozen=True)
class EngineSnapshot:
    """What the server may know of the engine, as of one step. Field names match
    EngineOccupancy's, so metrics reads either."""

    step_id: int = -1  # the last step run (-1: none yet)
    num_waiting_by_tier: tuple[int, ...] = (0, 0, 0)  # indexed by ServiceTier value
    num_running_by_tier: tuple[int, ...] = (0, 0, 0)
    num_kv_slots_running: int = 0
    num_kv_slots_total: int = 0
    num_prefix_queries: int = 0  # cumulative counters from here down
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    step_costs: StepCostSnapshot = StepCostSnapshot()
    # speculative decoding, per draft source (empty without speculation)
    speculation_draft_tokens: tuple[tuple[str, int], ...] = ()
    speculation_accepted_tokens: tuple[tuple[str, int], ...] = ()
    device_kind: str = "cpu"  # "cpu" or "gpu"
    max_model_len: int = 0  # the scheduler's limits, fixed at start
    max_num_seqs: int = 0
    max_waiting: int = 0
    idle_speed: IdleSpeed | None = None  # a typical prompt timed at start (None: not measured)
    start_costs: str = "not measured"  # cached | measuring ... | measured | contended
    wide_pass: str | None = None  # the wide path's state (executors/wide_lazy.py); None: none
    llama_weights: str | None = None  # the file llama.cpp runs (executors/f16_twin.py)

    @property
    def num_running(self) -> int:
        return sum(self.num_running_by_tier)

    @property
    def num_waiting(self) -> int:
        return sum(self.num_waiting_by_tier)

    @property
    def num_draft_tokens(self) -> dict[str, int]:  # SpeculationStats' names, for metrics
        return dict(self.speculation_draft_tokens)

    @property
    def num_accepted_tokens(self) -> dict[str, int]:
        return dict(self.speculation_accepted_tokens)


@dataclass(frozen=True)
class EngineSettings:
    """Settings the server may change while serving; None leaves a setting as it is."""

    reserved_priority_seats: dict[str, int] | None = None  # tenant -> committed KV seats


def build_snapshot(core: EngineCore, device_kind: str) -> EngineSnapshot:
    """On the engine thread: copy every figure out, so readers share nothing mutable."""
    occ = core.occupancy()
    drafts = core.speculation_stats
    return EngineSnapshot(
        step_id=core.last_stats.step_id if core.last_stats is not None else -1,
        num_waiting_by_tier=occ.num_waiting_by_tier,
        num_running_by_tier=occ.num_running_by_tier,
        num_kv_slots_running=occ.num_kv_slots_running,
        num_kv_slots_total=occ.num_kv_slots_total,
        num_prefix_queries=occ.num_prefix_queries,
        num_prefix_query_tokens=occ.num_prefix_query_tokens,
        num_prefix_hit_tokens=occ.num_prefix_hit_tokens,
        num_preemptions=occ.num_preemptions,
        step_costs=StepCostSnapshot.of(core.costs),
        speculation_draft_tokens=tuple(sorted(drafts.num_draft_tokens.items())) if drafts else (),
        speculation_accepted_tokens=tuple(sorted(drafts.num_accepted_tokens.items()))
        if drafts
        else (),
        device_kind=device_kind,
        max_model_len=core.scheduler.config.max_model_len,
        max_num_seqs=core.scheduler.config.max_num_seqs,
        max_waiting=core.scheduler.config.max_waiting,
        idle_speed=core.idle_speed,
        start_costs=core.start_costs.status,
        wide_pass=core.start_costs.wide_status,
        llama_weights=llama_weights(core.executor),
    )


def llama_weights(executor) -> str | None:
    """The file llama.cpp loaded, saying when it is a bf16 file's float16 copy; None for
    executors without llama.cpp."""
    weights, source = getattr(executor, "weights_path", None), getattr(executor, "gguf_path", None)
    if weights is None or source is None:
        return None
    if weights == source:
        return f"{source.name} as stored"
    return f"{weights.name}: the exact float16 copy of {source.name}"


@dataclass(frozen=True)
class AddRequest:
    """Inbox: admit `request`; its outputs go to `on_output` (on the engine thread)."""

    request: Request
    on_output: OutputCallback


@dataclass(frozen=True)
class AbortRequest:
    """Inbox: abort the request (a no-op if it has finished)."""

    request_id: str


@dataclass(frozen=True)
class Configure:
    """Inbox: apply settings before the next step."""

    settings: EngineSettings


@dataclass(frozen=True)
class Wake:
    """Inbox: nothing to do; wakes a blocked engine thread (to stop)."""


InboxItem = AddRequest | AbortRequest | Configure | Wake


class EngineReadAPI:
    """EngineThread's member `read`: the snapshot, the cached-prefix lookup and `configure`.

    The prefix lookup is EngineCore.cached_prefix_tokens: it hashes the prompt on the
    caller's thread and compares under the core's pool lock, which the engine holds only
    while the KV pool changes (scheduling, the update after a step, aborts), never while the
    kernels run. A lookup waits microseconds, not a step (holding the lock around whole
    steps doubled a priority request's TTFT under load: the lookup missed one step and its
    submission the next). A published copy of every slot's block hashes would instead cost
    each step a copy of the whole pool index for a lookup made once per API call."""

    def __init__(self, core: EngineCore, post: Callable[[InboxItem], None]):
        """`post`: puts an item in the engine thread's inbox."""
        self.core = core
        self._post = post
        self.device_kind = core.caps.device_kind
        self._snapshot = build_snapshot(core, self.device_kind)
        self._snapshot_s = time.monotonic()

    def snapshot(self) -> EngineSnapshot:
        """The latest published snapshot (any thread; a plain attribute read)."""
        return self._snapshot

    def cached_prefix_tokens(self, token_ids: list[int], tenant: str) -> int:
        """Leading tokens of `token_ids` some KV slot holds for `tenant` now (any thread)."""
        return self.core.cached_prefix_tokens(token_ids, tenant)

    def configure(self, settings: EngineSettings) -> None:
        """Applied on the engine thread before its next step (any thread)."""
        self._post(Configure(settings))

    def publish(self, force: bool) -> None:
        """Engine thread, after a step: a fresh snapshot when the engine went idle, when
        forced, or when the last one is older than SNAPSHOT_MAX_AGE_S (a busy engine's
        per-step cost stays one clock read)."""
        now = time.monotonic()
        if force or now - self._snapshot_s >= SNAPSHOT_MAX_AGE_S:
            self._snapshot = build_snapshot(self.core, self.device_kind)
            self._snapshot_s = now
