"""The model's speed on an idle engine, timed once at start, after the warm-up.

The server derives its default TTFT targets from it (server/admission.py): a fixed target
that suits an 11M demo model refuses every priority request of a model whose prefill alone
takes longer. The timed passes also seed the engine's step-cost fit, so admission predicts
from measured figures before the first client arrives.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ultrafast.request import Request, SamplingParams, ServiceTier

if TYPE_CHECKING:
    from ultrafast.core.kv_pool import KVSlotPool
    from ultrafast.core.scheduler import Scheduler
    from ultrafast.core.types import RequestOutput
    from ultrafast.engine.step_costs import StepStats
    from ultrafast.executors.base import Executor, ExecutorCaps


class CoreView(Protocol):
    """What the idle-speed and start-cost measurements use of the engine core (a Protocol, so
    neither imports the core that builds them)."""

    executor: Executor
    caps: ExecutorCaps
    pool: KVSlotPool
    scheduler: Scheduler
    idle_speed: IdleSpeed | None
    last_stats: StepStats | None

    def measure_on_idle(self, measure: Callable[[], None]) -> None: ...

    def reset_costs(self) -> None: ...

    def add_request(self, request: Request) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


TYPICAL_PROMPT_TOKENS = 128  # a short chat turn with a system prompt
NUM_TIMED_DECODES = 4
NUM_RUNS = 2  # the faster run counts: a one-off stall (another process, a page fault) does not
SECOND_RUN_UNDER_S = 2.0  # a slow model's single run is long enough to trust


@dataclass(frozen=True)
class IdleSpeed:
    """A typical prompt on the idle engine: its time to first token and its decode step."""

    prompt_tokens: int
    ttft_s: float  # every step from arrival to the first token (chunked prefill included)
    decode_s: float | None  # one single-token step of that lone sequence (median)


def measure_idle_speed(
    core: CoreView,
    num_prompt_tokens: int = TYPICAL_PROMPT_TOKENS,
    num_decodes: int = NUM_TIMED_DECODES,
) -> IdleSpeed | None:
    """Run a typical prompt through the idle engine and time it; None if it could not run
    (a model context too short, a failing step): the server then keeps its fixed floors."""
    num_tokens = min(num_prompt_tokens, core.scheduler.config.max_model_len - num_decodes - 1)
    if num_tokens < 1 or core.has_work():
        return None
    vocab_size = core.executor.vocab_size
    ttfts: list[float] = []
    decodes: list[float] = []
    for run in range(NUM_RUNS):
        if ttfts and ttfts[0] > SECOND_RUN_UNDER_S:
            break
        core.pool.reset_cache()  # each run prefills its whole prompt
        request_id = f"idle-speed-{run}"
        core.add_request(
            Request(
                request_id,
                [(i * 31 + run) % vocab_size for i in range(1, num_tokens + 1)],
                # the default tier: priority may draft, and drafts are not a lone decode
                SamplingParams(temperature=0.0, max_tokens=num_decodes + 1, ignore_eos=True),
                tier=ServiceTier.DEFAULT,
            )
        )
        start_s = time.perf_counter()
        first_s: float | None = None
        failed = False
        while core.has_work():
            step_start_s = time.perf_counter()
            outputs = core.step()
            now_s = time.perf_counter()
            mine = [o for o in outputs if o.request_id == request_id]
            failed = failed or any(o.error for o in mine)
            if first_s is None:
                if any(o.new_token_ids for o in mine):
                    first_s = now_s - start_s
            elif core.last_stats is not None and core.last_stats.num_tokens == 1:
                decodes.append(now_s - step_start_s)
        if failed or first_s is None:
            core.pool.reset_cache()
            return None
        ttfts.append(first_s)
    core.pool.reset_cache()
    return IdleSpeed(
        prompt_tokens=num_tokens,
        ttft_s=min(ttfts),
        decode_s=statistics.median(decodes) if decodes else None,
    )
