"""A deterministic executor with no tensors: its "KV" is the token list held in each slot.

The next token is a hash of the whole sequence in the slot, so any scheduler mistake (a wrong
position, a stale or missing KV entry, a bad prefix copy) changes the output.
"""

from __future__ import annotations

import collections
import hashlib
import time

from ultrafast.core.types import StepPlan, StepResult


def next_token(context: list[int], vocab_size: int) -> int:
    digest = hashlib.sha256(repr(context).encode()).digest()
    return int.from_bytes(digest[:4], "little") % vocab_size


class FakeExecutor:
    def __init__(self, num_slots: int = 4, max_model_len: int = 256, vocab_size: int = 97,
                 step_delay_s: float = 0.0):
        self.step_delay_s = step_delay_s  # simulated forward time
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.slots: list[list[int]] = [[] for _ in range(num_slots)]
        self.plans: list[StepPlan] = []
        self.fail_request_ids: set[str] = set()

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        result = StepResult()
        for copy in plan.kv_copies:
            assert len(self.slots[copy.src_slot_id]) >= copy.num_tokens, "copy of uncomputed KV"
            self.slots[copy.dst_slot_id] = list(self.slots[copy.src_slot_id][:copy.num_tokens])
        for seq in plan.seqs:
            if seq.request_id in self.fail_request_ids:
                result.errors[seq.request_id] = "injected failure"
                continue
            kv = self.slots[seq.slot_id]
            assert len(kv) >= seq.start_position, "gap in the KV: position skipped"
            del kv[seq.start_position:]  # the contract: drop stale KV at and past start_position
            kv.extend(seq.token_ids)
            assert len(kv) <= self.max_model_len
            if seq.num_logits:
                n = len(kv)
                result.sampled_token_ids[seq.request_id] = [
                    next_token(kv[:n - seq.num_logits + 1 + j], self.vocab_size)
                    for j in range(seq.num_logits)]
        return result

    def close(self) -> None:
        pass


def reference_tokens(prompt: list[int], max_tokens: int, vocab_size: int = 97) -> list[int]:
    """What one request alone must produce (greedy, no eos)."""
    context = list(prompt)
    out = []
    for _ in range(max_tokens):
        token = next_token(context, vocab_size)
        out.append(token)
        context.append(token)
    return out


def run_all(engine, requests, arrivals=None, abort_at=None):
    """Drive `engine` until idle: request i arrives at step `arrivals[i]` (default all at 0),
    `abort_at[step]` is aborted at that step. Returns (tokens by request id, finish reasons)."""
    arrivals = arrivals or [0] * len(requests)
    outputs, finish = collections.defaultdict(list), {}
    pending = list(zip(arrivals, requests))
    step = 0
    while pending or engine.has_work():
        for at, request in [p for p in pending if p[0] <= step]:
            engine.add_request(request)
            pending.remove((at, request))
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        step += 1
        assert step < 10_000
    return outputs, finish


def prompt(seed: int, n: int) -> list[int]:
    """A deterministic prompt of n token ids (vocab 97)."""
    return [(seed * 31 + i * 7) % 97 for i in range(n)]
