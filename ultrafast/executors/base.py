"""The executor interface: the only place tensors meet requests.

An executor owns the model weights and the KV of `num_slots` sequences of up to `max_model_len`
tokens each. `execute(plan)` applies the plan's KV copies, runs one forward pass over every
scheduled sequence, and samples at the requested positions with `sampling.sampler.sample_plan`.
"""

from __future__ import annotations

from typing import Any, Protocol

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult


class Executor(Protocol):
    num_slots: int  # KV slots (concurrent sequences, cached prefixes included)
    max_model_len: int  # positions per slot
    vocab_size: int
    # optional: True when sequences of different token counts in one step run as separate
    # forward passes (the scheduler then keeps other lengths out of priority steps)
    # one_pass_per_length: bool

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Never called concurrently; called from the engine thread only."""
        ...

    def close(self) -> None:
        """Free native resources (llama.cpp context, CUDA memory)."""
        ...


class KeptSampling(Protocol):
    """Optional: sampling a row kept by an earlier step (ScheduledSeq.defer_sample). An
    executor with it sets `keeps_logits = True`; without it, the scheduler holds a compiling
    request's last prompt token back instead, and that token runs as its own pass later."""

    keeps_logits: bool

    def sample_kept(self, seq: ScheduledSeq, kept: Any) -> StepResult:
        """Sample `seq`'s one position (its token_mask applied) from `kept`, the value this
        executor put in StepResult.kept_logits. Called from the engine thread between steps."""
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
