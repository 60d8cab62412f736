"""The wide forward with its native kernels against the same forward on torch's ops: the fused
elementwise ops (executors/fused_ops.py) and the AMX prefill attention (executors/
prefill_attention.py, against SDPA). Greedy tokens of 10 text prompts x 32 tokens (prefilled
together in torch passes, in two chunks each for the attention kernel so that the second
attends over the first in the mirror, then 1-token decode steps over the KV mirror) are
equal, or diverge only at a near-tie of the torch path's logits (the margin is printed); the
prefill K/V agree to bf16 rounding. On the demo model and SmolLM2's bf16 GGUF. The greedy
parity against llama.cpp (test_wide_pass.py, test_wide_decode.py) runs on whichever path the
machine chose."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_wide_pass import (
    DEMO_GGUF,
    NEAR_TIE,
    NEW_TOKENS,
    _wide_unavailable,
    smollm2_bf16,
    text_prompts,
)
from ultrafast.executors import wide_decode
from ultrafast.executors.wide_forward import SeqChunk, WideForward


def prefill(fw: WideForward, mirror, batch: list[list[int]], begin: list[int], logits: bool):
    """One torch pass over each prompt's tokens [begin[j], end) (slot j holds the rest)."""
    parts = [p[b:] for p, b in zip(batch, begin)]
    ids = [t for p in parts for t in p]
    positions = [b + i for p, b in zip(parts, begin) for i in range(len(p))]
    starts = [sum(len(p) for p in parts[:j]) for j in range(len(parts))]
    chunks = [SeqChunk(s, len(p), b) for s, p, b in zip(starts, parts, begin)]
    slots = list(range(len(batch)))
    return wide_decode.step_logits(
        fw, mirror, (ids, positions, chunks, slots), None, logits_of=slots if logits else []
    )


def greedy(
    fw: WideForward, batch: list[list[int]], split: bool = False
) -> tuple[list[list[int]], list[list[float]]]:
    """Every prompt's greedy continuation and, per step, its top-2 logit margin; `split`:
    each prompt prefilled as two chunks in two passes."""
    mirror = wide_decode.new_mirror(fw, 256, len(batch))
    slots = list(range(len(batch)))
    if split:
        halves = [p[: len(p) // 2] for p in batch]
        prefill(fw, mirror, halves, [0] * len(batch), logits=False)
        logits = prefill(fw, mirror, batch, [len(h) for h in halves], logits=True)
    else:
        logits = prefill(fw, mirror, batch, [0] * len(batch), logits=True)
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


def assert_equal_or_near_ties(got_tokens, want_tokens, margins, reference: str) -> None:
    """Each prompt's tokens equal the reference's, or part where the reference's top-2 logits
    were within NEAR_TIE (printed); at least half the prompts equal throughout."""
    for j, (got, want) in enumerate(zip(got_tokens, want_tokens)):
        if got != want:
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            print(f"prompt {j}: diverges at token {at}, {reference} margin {margins[j][at]:.3f}")
            assert margins[j][at] < NEAR_TIE
    assert sum(g == w for g, w in zip(got_tokens, want_tokens)) >= len(want_tokens) // 2


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_fused_ops_keep_the_greedy_tokens(model):
    if _wide_unavailable():
        pytest.skip(f"wide pass not available: {_wide_unavailable()}")
    gguf = DEMO_GGUF if model == "demo" else smollm2_bf16()
    fw = WideForward(gguf, 256)
    if fw.fused is None:
        pytest.skip(f"the fused ops are not used here: {fw.fused_status}")
    batch = text_prompts(gguf)
    fused_tokens, _ = greedy(fw, batch)
    fused = fw.fused
    fw.fused = None
    torch_tokens, margins = greedy(fw, batch)
    assert_equal_or_near_ties(fused_tokens, torch_tokens, margins, "torch")
    ids = torch.tensor(batch[0])
    want_k, want_v = fw.kv(ids, torch.arange(len(ids)), [SeqChunk(0, len(ids), 0)])
    fw.fused = fused
    got_k, got_v = fw.kv(ids, torch.arange(len(ids)), [SeqChunk(0, len(ids), 0)])
    for got, want in zip(got_k + got_v, want_k + want_v):
        assert torch.allclose(got, want, rtol=0, atol=0.03 * float(want.abs().max()))


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_the_amx_prefill_attention_keeps_the_greedy_tokens(model):
    if _wide_unavailable():
        pytest.skip(f"wide pass not available: {_wide_unavailable()}")
    gguf = DEMO_GGUF if model == "demo" else smollm2_bf16()
    fw = WideForward(gguf, 256)
    if fw.prefill_kernel is None:
        pytest.skip(f"the prefill attention kernel is not used here: {fw.prefill_status}")
    batch = text_prompts(gguf)
    kernel_tokens, _ = greedy(fw, batch, split=True)
    kernel = fw.prefill_kernel
    fw.prefill_kernel = None
    sdpa_tokens, margins = greedy(fw, batch, split=True)
    fw.prefill_kernel = kernel
    assert_equal_or_near_ties(kernel_tokens, sdpa_tokens, margins, "SDPA")
    # and one pass over whole prompts agrees with the two-chunk passes
    whole_tokens, margins = greedy(fw, batch)
    assert_equal_or_near_ties(kernel_tokens, whole_tokens, margins, "one-pass")
