"""The wide forward with its fused elementwise ops (executors/fused_ops.py) against the same
forward on torch's ops: greedy tokens of 10 text prompts x 32 tokens (prefilled together in
one torch pass, then 1-token decode steps over the KV mirror) are equal, or diverge only at a
near-tie of the torch path's logits (the margin is printed); the prefill K/V agree to bf16
rounding. On the demo model and SmolLM2's bf16 GGUF. The greedy parity against llama.cpp
(test_wide_pass.py, test_wide_decode.py) runs on whichever path the machine chose."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_wide_pass import (
    DEMO_GGUF,
    NEAR_TIE,
    NEW_TOKENS,
    _bf16_unavailable,
    smollm2_bf16,
    text_prompts,
)
from ultrafast.executors import wide_decode
from ultrafast.executors.wide_forward import SeqChunk, WideForward


def greedy(fw: WideForward, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt's greedy continuation and, per step, its top-2 logit margin."""
    mirror = wide_decode.new_mirror(fw, 256, len(batch))
    ids = [t for p in batch for t in p]
    positions = [i for p in batch for i in range(len(p))]
    starts = [sum(len(p) for p in batch[:j]) for j in range(len(batch))]
    chunks = [SeqChunk(s, len(p), 0) for s, p in zip(starts, batch)]
    slots = list(range(len(batch)))
    logits = wide_decode.step_logits(
        fw, mirror, (ids, positions, chunks, slots), None, logits_of=slots
    )
    tokens: list[list[int]] = [[] for _ in batch]
    margins: list[list[float]] = [[] for _ in batch]
    for step in range(NEW_TOKENS):
        top = logits.topk(2, dim=-1)
        for j in slots:
            tokens[j].append(int(top.indices[j, 0]))
            margins[j].append(float(top.values[j, 0] - top.values[j, 1]))
        if step + 1 < NEW_TOKENS:
            last = [t[-1] for t in tokens]
            at = [len(p) + step for p in batch]
            logits = wide_decode.decode_logits(fw, mirror, last, slots, at)
    return tokens, margins


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_fused_ops_keep_the_greedy_tokens(model):
    if _bf16_unavailable():
        pytest.skip(f"wide pass not available: {_bf16_unavailable()}")
    gguf = DEMO_GGUF if model == "demo" else smollm2_bf16()
    fw = WideForward(gguf, 256)
    if fw.fused is None:
        pytest.skip(f"the fused ops are not used here: {fw.fused_status}")
    batch = text_prompts(gguf)
    fused_tokens, _ = greedy(fw, batch)
    fused = fw.fused
    fw.fused = None
    torch_tokens, margins = greedy(fw, batch)
    for j, (got, want) in enumerate(zip(fused_tokens, torch_tokens)):
        if got != want:
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            print(f"prompt {j}: diverges at token {at}, torch margin {margins[j][at]:.3f}")
            assert margins[j][at] < NEAR_TIE
    assert sum(f == t for f, t in zip(fused_tokens, torch_tokens)) >= len(batch) // 2
    ids = torch.tensor(batch[0])
    want_k, want_v = fw.kv(ids, torch.arange(len(ids)), [SeqChunk(0, len(ids), 0)])
    fw.fused = fused
    got_k, got_v = fw.kv(ids, torch.arange(len(ids)), [SeqChunk(0, len(ids), 0)])
    for got, want in zip(got_k + got_v, want_k + want_v):
        assert torch.allclose(got, want, rtol=0, atol=0.03 * float(want.abs().max()))
