"""TorchExecutor: batched steps, prefix copies, stale slots and bad requests behave like
each sequence recomputed alone from scratch.

The reference for every logit row is a second executor that runs the sequence's whole token
list in one fresh prefill, so chunking, batching, KV copies and slot reuse must all be
invisible in the logits (within float32 noise) and in the greedy tokens.
"""

import pytest
import torch

from ultrafast.core.types import KVCopy, ScheduledSeq, StepPlan
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.model.loader import build_dummy_model
from ultrafast.request import SamplingParams

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
ATOL = 1e-5
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def model():
    return build_dummy_model(CONFIG, dtype="float32", seed=3, std=0.2)  # wide: no argmax ties


@pytest.fixture(scope="module")
def ref(model):
    return TorchExecutor(model, num_slots=1, max_model_len=128, device="cpu")


def recompute(ref: TorchExecutor, tokens: list[int], num_logits: int) -> torch.Tensor:
    """Logits of the last num_logits positions of `tokens`, from one fresh prefill."""
    ref.execute(StepPlan([ScheduledSeq("ref", 0, tokens, 0, num_logits, GREEDY, 0, 0)]))
    return ref.last_logits


def seq(rid, slot, tokens, start, num_logits, num_out=0):
    return ScheduledSeq(rid, slot, tokens, start, num_logits, GREEDY, 0, num_out)


def rows_of(ex: TorchExecutor, plan: StepPlan) -> dict[str, torch.Tensor]:
    row, out = 0, {}
    for s in plan.seqs:
        out[s.request_id] = ex.last_logits[row : row + s.num_logits]
        row += s.num_logits
    return out


def test_mixed_step_equals_each_sequence_alone(model, ref):
    ex = TorchExecutor(model, num_slots=4, max_model_len=128, device="cpu")
    gen = torch.Generator().manual_seed(0)
    full = {
        r: torch.randint(0, 128, (n,), generator=gen).tolist()
        for r, n in (("a", 20), ("b", 25), ("c", 6), ("d", 9))
    }
    ex.execute(
        StepPlan(
            [
                seq("b", 1, full["b"][:10], 0, 0),
                seq("c", 2, full["c"][:5], 0, 1),
                seq("d", 3, full["d"][:6], 0, 1),
            ]
        )
    )
    # one step: a's first prefill chunk, b's last chunk, c decodes, d decodes with 2 drafts
    mixed = StepPlan(
        [
            seq("a", 0, full["a"][:12], 0, 0),
            seq("b", 1, full["b"][10:], 10, 1),
            seq("c", 2, full["c"][5:], 5, 1),
            seq("d", 3, full["d"][6:], 6, 3),
        ]
    )
    result = ex.execute(mixed)
    assert not result.errors and "a" not in result.sampled_token_ids
    got = rows_of(ex, mixed)
    for rid, n in (("b", 1), ("c", 1), ("d", 3)):
        torch.testing.assert_close(got[rid], recompute(ref, full[rid], n), atol=ATOL, rtol=0)
    step = StepPlan([seq("a", 0, full["a"][12:], 12, 8)])  # an 8-token chunk at an offset
    ex.execute(step)
    torch.testing.assert_close(ex.last_logits, recompute(ref, full["a"], 8), atol=ATOL, rtol=0)
    # then all four decode together, lengths all different, for 8 greedy tokens each
    history = {r: list(t) for r, t in full.items()}
    slots = {"a": 0, "b": 1, "c": 2, "d": 3}
    nxt = {r: int(recompute(ref, t, 1).argmax()) for r, t in history.items()}
    for i in range(8):
        plan = StepPlan([seq(r, slots[r], [nxt[r]], len(history[r]), 1, i) for r in history])
        for r in history:
            history[r].append(nxt[r])
        result = ex.execute(plan)
        for r in history:
            expected = recompute(ref, history[r], 1)
            torch.testing.assert_close(rows_of(ex, plan)[r], expected, atol=ATOL, rtol=0)
            assert result.sampled_token_ids[r] == [int(expected.argmax())]
            nxt[r] = result.sampled_token_ids[r][0]


def test_prefix_copy_equals_recompute(model, ref):
    ex = TorchExecutor(model, num_slots=3, max_model_len=128, device="cpu")
    shared = list(range(30, 46))  # 16 tokens
    ex.execute(StepPlan([seq("src", 0, shared + [1, 2, 3], 0, 0)]))
    ex.execute(StepPlan([seq("old", 1, list(range(60)), 0, 0)]))  # dst holds longer stale KV
    suffix = [7, 8, 9, 10, 11]
    plan = StepPlan(
        [seq("dst", 1, suffix, 16, len(suffix)), seq("src", 0, [4], 19, 1)],
        kv_copies=[KVCopy(src_slot_id=0, dst_slot_id=1, num_tokens=16)],
    )
    ex.execute(plan)
    got = rows_of(ex, plan)
    torch.testing.assert_close(
        got["dst"], recompute(ref, shared + suffix, len(suffix)), atol=ATOL, rtol=0
    )
    # the source slot is untouched by the copy and keeps decoding correctly
    torch.testing.assert_close(
        got["src"], recompute(ref, shared + [1, 2, 3, 4], 1), atol=ATOL, rtol=0
    )


def test_reused_slot_and_rejected_drafts_leave_no_trace(model, ref):
    ex = TorchExecutor(model, num_slots=1, max_model_len=128, device="cpu")
    ex.execute(StepPlan([seq("old", 0, list(range(1, 90)), 0, 1)]))  # a former owner
    prompt = [9, 8, 7, 6, 5]
    ex.execute(StepPlan([seq("new", 0, prompt, 0, 1)]))
    torch.testing.assert_close(ex.last_logits, recompute(ref, prompt, 1), atol=ATOL, rtol=0)
    # a decode with 3 drafts, of which only the first is accepted: the next step restarts at
    # position 7 and must not see the rejected drafts' KV at 7 and 8
    ex.execute(StepPlan([seq("new", 0, [4, 100, 101, 102], 5, 4)]))
    ex.execute(StepPlan([seq("new", 0, [50, 51], 7, 2)]))
    torch.testing.assert_close(
        ex.last_logits, recompute(ref, prompt + [4, 100, 50, 51], 2), atol=ATOL, rtol=0
    )


def test_bad_request_fails_alone(model, ref):
    ex = TorchExecutor(model, num_slots=3, max_model_len=32, device="cpu")
    plan = StepPlan(
        [
            seq("big-id", 0, [1, 128], 0, 1),
            seq("ok", 1, [1, 2, 3], 0, 1),
            seq("negative", 2, [-1], 0, 1),
            seq("no-slot", 7, [1], 0, 1),
            seq("too-long", 2, list(range(33)), 0, 1),
            seq("twice", 1, [5], 3, 1),
        ]
    )
    result = ex.execute(plan)
    assert "vocabulary" in result.errors["big-id"] and "128" in result.errors["big-id"]
    assert "vocabulary" in result.errors["negative"]
    assert "slot 7" in result.errors["no-slot"]
    assert "32" in result.errors["too-long"]
    assert "twice" in result.errors["twice"]
    assert set(result.sampled_token_ids) == {"ok"}
    torch.testing.assert_close(ex.last_logits, recompute(ref, [1, 2, 3], 1), atol=ATOL, rtol=0)
    # an invalid prefix copy fails the request that depends on it, and nothing else
    result = ex.execute(
        StepPlan(
            [seq("dst", 0, [1, 2], 10, 1), seq("fine", 1, [4], 3, 1)], kv_copies=[KVCopy(2, 0, 40)]
        )
    )
    assert "prefix copy" in result.errors["dst"] and set(result.sampled_token_ids) == {"fine"}
    # nothing valid left: an empty result with errors, no forward pass
    result = ex.execute(StepPlan([seq("only", 0, [999], 0, 1)]))
    assert result.sampled_token_ids == {} and "only" in result.errors


def test_protocol_fields_and_dummy_models_of_every_arch():
    for arch, extra in (
        ("MistralForCausalLM", {"sliding_window": 4}),
        ("Qwen2ForCausalLM", {}),
        ("Qwen3ForCausalLM", {"head_dim": 8}),
    ):
        model = build_dummy_model({**CONFIG, "architectures": [arch], **extra}, seed=1)
        ex = TorchExecutor(model, num_slots=2, max_model_len=16, device="cpu")
        assert (ex.num_slots, ex.max_model_len, ex.vocab_size) == (2, 16, 128)
        result = ex.execute(StepPlan([seq("x", 0, list(range(10)), 0, 2)]))
        assert len(result.sampled_token_ids["x"]) == 2 and result.execute_time_s > 0
        assert torch.isfinite(ex.last_logits).all()
        ex.close()
    tied = build_dummy_model({**CONFIG, "tie_word_embeddings": True})
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_model_interface_flattened_tokens(model):
    """model(ids[T], positions[T], attn) -> hidden[T, hidden]; compute_logits -> float32."""
    from ultrafast.model.attention import SlotKVCache

    cache = SlotKVCache(2, 2, 32, 2, 16, torch.float32, "cpu")
    attn = cache.begin_step([(0, 0, 3), (1, 0, 2)])
    with torch.inference_mode():
        hidden = model(torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 1, 2, 0, 1]), attn)
        logits = model.compute_logits(hidden[[2, 4]])
    assert hidden.shape == (5, 64) and logits.shape == (2, 128)
    assert logits.dtype == torch.float32
    assert cache.num_bytes == 2 * 2 * (2 * 2 * 32 * 16) * 4


def test_n_threads_sets_torch_threads_on_cpu(model):
    """`--threads` reaches torch on CPU (serve leaves a core to the event loop), and a
    nonsense count is refused instead of reaching torch."""
    before = torch.get_num_threads()
    try:
        TorchExecutor(model, num_slots=1, max_model_len=32, device="cpu", n_threads=2)
        assert torch.get_num_threads() == 2
        TorchExecutor(model, num_slots=1, max_model_len=32, device="cpu", n_threads=1)
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="n_threads"):
            TorchExecutor(model, num_slots=1, max_model_len=32, device="cpu", n_threads=0)
    finally:
        torch.set_num_threads(before)
