"""Compiled decode vs its eager twin: one scenario both the CPU and the GPU tests run.

Two TorchExecutors on the same weights get identical plans: mixed prefill + decode steps over
several slots, decode-only batches of 1 to 4 sequences (3 is padded to 4), contexts that cross
key-length buckets, and a step with drafts (eager in both). The compiled one drives the greedy
tokens; every step's sampled tokens must be identical and the logits within `atol`.
"""

from __future__ import annotations

import torch

from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def _seq(rid: str, slot: int, tokens: list[int], start: int, num_logits: int) -> ScheduledSeq:
    return ScheduledSeq(rid, slot, tokens, start, num_logits, GREEDY, 0, 0)


def _step(fast: TorchExecutor, slow: TorchExecutor, plan: StepPlan, atol: float) -> dict:
    got, want = fast.execute(plan), slow.execute(plan)
    assert not got.errors and not want.errors, (got.errors, want.errors)
    assert got.sampled_token_ids == want.sampled_token_ids
    torch.testing.assert_close(fast.last_logits, slow.last_logits, atol=atol, rtol=0)
    return got.sampled_token_ids


def run_twin(fast: TorchExecutor, slow: TorchExecutor, atol: float, seed: int = 0) -> int:
    """Drive both through the scenario; returns how many decode-only steps it had."""
    vocab = fast.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = {
        r: torch.randint(0, vocab, (n,), generator=gen).tolist()
        for r, n in (("a", 9), ("b", 4), ("c", 13), ("d", 2))
    }
    slots = {"a": 0, "b": 1, "c": 3, "d": 2}
    length = {r: len(p) for r, p in prompts.items()}
    last: dict[str, int] = {}
    num_decode_steps = 0

    def decode(rids: list[str]) -> None:
        nonlocal num_decode_steps
        plan = StepPlan([_seq(r, slots[r], [last[r]], length[r], 1) for r in rids])
        out = _step(fast, slow, plan, atol)
        for r in rids:
            length[r] += 1
            last[r] = out[r][0]
        num_decode_steps += 1

    out = _step(fast, slow, StepPlan([_seq("a", 0, prompts["a"], 0, 1)]), atol)
    last["a"] = out["a"][0]
    for _ in range(3):
        decode(["a"])  # batch 1
    # mixed: b's whole prompt, c's first chunk (no logits) and a decode: eager in both
    plan = StepPlan(
        [
            _seq("b", 1, prompts["b"], 0, 1),
            _seq("c", 3, prompts["c"][:6], 0, 0),
            _seq("a", 0, [last["a"]], length["a"], 1),
        ]
    )
    out = _step(fast, slow, plan, atol)
    last["b"], last["a"] = out["b"][0], out["a"][0]
    length["a"] += 1
    decode(["b", "a"])  # batch 2, plan order differs from slot order
    out = _step(fast, slow, StepPlan([_seq("c", 3, prompts["c"][6:], 6, 1)]), atol)
    last["c"] = out["c"][0]
    for _ in range(6):
        decode(["a", "b", "c"])  # batch 3, padded to 4; a crosses 16 keys
    out = _step(fast, slow, StepPlan([_seq("d", 2, prompts["d"], 0, 1)]), atol)
    last["d"] = out["d"][0]
    for _ in range(14):
        decode(["d", "c", "b", "a"])  # batch 4; c and a cross 32 keys
    # a decode with two drafts: not a decode-only step, eager in both
    plan = StepPlan([_seq("b", 1, [last["b"], 5, 6], length["b"], 3)])
    out = _step(fast, slow, plan, atol)
    length["b"] += 1  # accept the first token only: positions beyond are stale, never read
    last["b"] = out["b"][0]
    for _ in range(2):
        decode(["b", "c"])
    return num_decode_steps
