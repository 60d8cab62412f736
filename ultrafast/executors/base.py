"""The executor interface: the only place tensors meet requests.

An executor owns the model weights and the KV of `num_slots` sequences of up to `max_model_len`
tokens each. `execute(plan)` applies the plan's KV copies, runs one forward pass over every
scheduled sequence, and samples at the requested positions with `sampling.sampler.sample_plan`.
What an executor can do beyond that it declares in `caps()` (an `ExecutorCaps`): the engine
and the server read capabilities there, never by probing attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult

if TYPE_CHECKING:
    from ultrafast.executors.ggml_threads import ThreadPlan


@dataclass(frozen=True)
class ExecutorCaps:
    """What one executor can do, fixed once it is built (its `caps()`)."""

    # sequences of different token counts in one step run as separate forward passes (the
    # scheduler then keeps other lengths out of priority steps; a step's cost is one base
    # per pass, which the step-cost line cannot fit)
    one_pass_per_length: bool = False
    # implements KeptSampling: a compiling request's last prompt row is kept and sampled later
    keeps_logits: bool = False
    # implements ThreadCalibration: its threads per pass width can be measured and cached
    thread_calibration: bool = False
    threads_auto: bool = False  # ... and the user asked for them to be measured (--threads auto)
    device_kind: str = "cpu"  # "cpu" or "gpu": what /metrics and admission report
    max_step_tokens: int | None = None  # tokens one step may hold (None: no own limit)
    # the last step's sampled logits rows stay readable as `last_logits` (a draft model's q)
    last_logits: bool = False


class Executor(Protocol):
    num_slots: int  # KV slots (concurrent sequences, cached prefixes included)
    max_model_len: int  # positions per slot
    vocab_size: int

    def caps(self) -> ExecutorCaps:
        """What this executor can do beyond `execute` (read by the engine at start)."""
        ...

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Never called concurrently; called from the engine thread only."""
        ...

    def close(self) -> None:
        """Free native resources (llama.cpp context, CUDA memory)."""
        ...


class KeptSampling(Protocol):
    """Optional: sampling a row kept by an earlier step (ScheduledSeq.defer_sample). An
    executor with it declares `ExecutorCaps.keeps_logits`; without it, the scheduler holds a
    compiling request's last prompt token back instead, and that token runs as its own pass
    later."""

    def sample_kept(self, seq: ScheduledSeq, kept: Any) -> StepResult:
        """Sample `seq`'s one position (its token_mask applied) from `kept`, the value this
        executor put in StepResult.kept_logits. Called from the engine thread between steps."""
        ...


class ThreadCalibration(Protocol):
    """Optional (`ExecutorCaps.thread_calibration`): the ggml executor's start-cost API, which
    engine/start_costs.py measures, caches and checks for drift."""

    n_threads: int
    thread_plan: ThreadPlan | None  # kernel threads per pass width (None: not measured)

    def cost_identity(self) -> dict:
        """The fields the cached costs are keyed by (model file, flags, batch)."""
        ...

    def calibrate_threads(self, *args: Any, **kwargs: Any) -> ThreadPlan:
        """Measure threads per pass width (`should_stop`, `free_slots`, `progress` by
        keyword); sets and returns `thread_plan`."""
        ...


class KVTransfer(Protocol):
    """Optional (kvcache/): one slot's KV out to bytes and back, for the tiered KV cache.

    A payload is opaque outside its executor and only valid under the same `kv_fingerprint()`
    (kvcache/blob.py checks that before `import_slot` is called). Called from the engine
    thread between steps only."""

    def kv_fingerprint(self) -> str:
        """Digest of everything a payload depends on: weights, KV dtype, layout, executor."""
        ...

    def export_slot(self, slot_id: int, num_tokens: int) -> bytes:
        """The slot's KV covering at least positions [0, num_tokens)."""
        ...

    def import_slot(self, slot_id: int, payload: bytes, num_tokens: int) -> None:
        """The slot holds exactly positions [0, num_tokens) of the payload afterwards, or
        ValueError is raised and the slot is left empty."""
        ...
