"""Our Llama-family module vs transformers on tiny random models of every supported arch (fp32).

Each checkpoint is saved by transformers and loaded by our loader. Two sequences of different
lengths run together through TorchExecutor (chunked prefill, then 32 batched decode steps over
the slot KV cache); every logit row must be within 1e-4 of HF's full forward, and the greedy
tokens must equal HF `generate(do_sample=False)`.
"""

import pytest
import torch
import transformers

from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.request import SamplingParams

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

NUM_NEW_TOKENS = 32
TOLERANCE = 1e-4
# eos None: HF generates all 32 tokens, as our greedy loop does; a wide init keeps argmax clear
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    initializer_range=0.1,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-gqa-untied": ("Llama", {}),
    "llama-mha-tied": ("Llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-attention-and-mlp-bias": ("Llama", dict(attention_bias=True, mlp_bias=True)),
    "llama3-rope-scaling": ("Llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "mistral": ("Mistral", dict(sliding_window=None)),
    "mistral-sliding-window": ("Mistral", dict(sliding_window=8)),
    "qwen2-bias-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen2-sliding-upper-layer": (
        "Qwen2",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "qwen3-qknorm": ("Qwen3", dict(head_dim=32)),  # head_dim != hidden / heads
    "qwen3-mha-tied": ("Qwen3", dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True)),
}
PROMPTS = {
    "a": [5, 17, 33, 2, 99, 100, 7, 8, 250, 31, 64, 65, 66, 3, 200, 201, 11, 12, 13, 14],
    "b": [9, 8, 7, 6, 5, 4, 3, 120, 121, 122, 123, 90, 91],
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)


def build_hf(case: str, path):
    family, extra = CASES[case]
    config = getattr(transformers, f"{family}Config")(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_reference(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF greedy tokens, and HF logits at every position of prompt + those tokens."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
        tokens = out[0, len(prompt) :].tolist()
        logits = hf(torch.tensor([prompt + tokens])).logits[0]
    assert len(tokens) == NUM_NEW_TOKENS
    return tokens, logits


def run_ours(ex: TorchExecutor) -> tuple[dict, dict]:
    """Both prompts together: a, b prefill in two chunks (long + short path), then decode."""
    state = {rid: dict(slot=i, pos=0, out=[], rows=[]) for i, rid in enumerate(PROMPTS)}
    chunks = {
        "a": [PROMPTS["a"][:12], PROMPTS["a"][12:]],
        "b": [PROMPTS["b"][:4], PROMPTS["b"][4:]],
    }
    for step in range(2 + NUM_NEW_TOKENS):
        seqs = []
        for rid, s in state.items():
            feed = chunks[rid][step] if step < 2 else [s["out"][-1]]
            num_logits = len(feed) if step < 2 else 1  # every prompt row, to check them all
            seqs.append(
                ScheduledSeq(rid, s["slot"], feed, s["pos"], num_logits, GREEDY, 0, len(s["out"]))
            )
            s["pos"] += len(feed)
        result = ex.execute(StepPlan(seqs))
        assert not result.errors
        row = 0
        for seq in seqs:
            s = state[seq.request_id]
            s["rows"].append(ex.last_logits[row : row + seq.num_logits])
            row += seq.num_logits
            if step >= 1 and len(s["out"]) < NUM_NEW_TOKENS:
                s["out"].append(result.sampled_token_ids[seq.request_id][-1])
    return (
        {rid: s["out"] for rid, s in state.items()},
        {rid: torch.cat(s["rows"]) for rid, s in state.items()},
    )


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_tokens_match_transformers(case, tmp_path):
    hf = build_hf(case, tmp_path)
    ex = TorchExecutor(tmp_path, num_slots=2, max_model_len=64, device="cpu", dtype="float32")
    tokens, logits = run_ours(ex)
    for rid, prompt in PROMPTS.items():
        ref_tokens, ref_logits = hf_reference(hf, prompt)
        # our rows: every prompt position, then one per decode step; the last decode's input
        # is the 32nd token, whose successor HF's full forward also scores
        ours = logits[rid][: len(prompt) + NUM_NEW_TOKENS]
        diff = (ours - ref_logits[: len(ours)]).abs().max().item()
        assert diff <= TOLERANCE, f"{case}/{rid}: max abs logit difference {diff}"
        assert tokens[rid] == ref_tokens, f"{case}/{rid}: greedy tokens differ"


def test_loaded_config_matches_the_checkpoint(tmp_path):
    build_hf("qwen2-sliding-upper-layer", tmp_path)
    ex = TorchExecutor(tmp_path, num_slots=1, max_model_len=16, device="cpu")
    config = ex.config
    assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
    assert config.layer_sliding_windows == (None, 8)
    assert ex.vocab_size == 256 and ex.num_slots == 1 and ex.max_model_len == 16
