"""The scheduler path of embedding requests: prefill-only, so no slots, no decode, no KV.

An embedding job is a list of inputs (token ids). Jobs wait in one FIFO per service tier;
each pass takes inputs in tier order (priority, default, flex) and arrival order within a
tier, as many as fit the pass's token and sequence budget, so inputs of different requests
share a forward pass and a large request is spread over several passes without holding up a
priority one for longer than one pass. Torch-free and engine-free (tests drive it by hand).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ultrafast.request import ServiceTier


@dataclass(frozen=True)
class EmbedError:
    code: str  # "queue_full", "input_too_long", "engine_error"
    message: str


@dataclass(eq=False)
class EmbedJob:
    inputs: list[list[int]]
    tier: ServiceTier = ServiceTier.DEFAULT
    # called once, on the engine thread: (vectors, None) or (None, EmbedError)
    on_done: Callable[[Any, EmbedError | None], None] = lambda vectors, error: None
    results: list[Any] = field(default_factory=list)
    next_input: int = 0  # inputs [0, next_input) are scheduled
    num_done: int = 0
    cancelled: bool = False
    failed: bool = False

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.inputs)


@dataclass(frozen=True)
class EmbedPiece:
    job: EmbedJob
    index: int  # which input of the job


class EmbedQueue:
    """`max_batch_tokens`: the most one pass can hold (a longer input is refused);
    `pass_tokens`: where a pass stops taking more inputs (it always takes one). An encoder's
    attention spans the whole pass, masked per input, so a pass of N tokens pays N^2 in
    attention, and a priority input arriving mid-pass waits for at most one such pass."""

    def __init__(
        self,
        max_batch_tokens: int,
        max_seqs: int,
        max_waiting_inputs: int,
        pass_tokens: int | None = None,
    ):
        self.max_batch_tokens = max_batch_tokens
        self.pass_tokens = min(pass_tokens or max_batch_tokens, max_batch_tokens)
        self.max_seqs = max_seqs
        self.max_waiting_inputs = max_waiting_inputs
        self.waiting: dict[ServiceTier, collections.deque[EmbedJob]] = {
            tier: collections.deque() for tier in ServiceTier
        }
        self.num_waiting_inputs = 0

    def add(self, job: EmbedJob) -> EmbedError | None:
        """Queue the job; why it is refused (queue full, input too long), or None."""
        too_long = next(
            (i for i, ids in enumerate(job.inputs) if len(ids) > self.max_batch_tokens), None
        )
        if too_long is not None:
            return EmbedError(
                "input_too_long",
                f"input {too_long} is longer than a pass ({self.max_batch_tokens} tokens)",
            )
        if self.num_waiting_inputs + len(job.inputs) > self.max_waiting_inputs:
            return EmbedError("queue_full", "the embedding queue is full; retry later")
        self.waiting[job.tier].append(job)
        self.num_waiting_inputs += len(job.inputs)
        return None

    def waiting_by_tier(self) -> tuple[int, ...]:
        return tuple(len(self.waiting[tier]) for tier in ServiceTier)

    def next_batch(self) -> list[EmbedPiece]:
        """The next pass's inputs (empty when nothing waits)."""
        pieces: list[EmbedPiece] = []
        tokens = 0
        for tier in ServiceTier:  # IntEnum order: priority first
            queue = self.waiting[tier]
            while queue and len(pieces) < self.max_seqs:
                job = queue[0]
                if job.cancelled:
                    self._drop(queue.popleft())
                    continue
                size = len(job.inputs[job.next_input])
                if pieces and tokens + size > self.pass_tokens:
                    return pieces
                pieces.append(EmbedPiece(job, job.next_input))
                tokens += size
                job.next_input += 1
                self.num_waiting_inputs -= 1
                if job.next_input == len(job.inputs):
                    queue.popleft()
        return pieces

    def _drop(self, job: EmbedJob) -> None:
        self.num_waiting_inputs -= len(job.inputs) - job.next_input
        job.next_input = len(job.inputs)

    def has_work(self) -> bool:
        return any(self.waiting.values())
