"""TorchExecutor: batching, prefix copies, stale slots and bad ids behave like single runs."""

import json

import pytest
import torch
import transformers

from ultrafast.core.types import KVCopy, ScheduledSeq, StepPlan
from ultrafast.executors.torch_exec import TorchExecutor
from ultrafast.model.loader import ModelLoadError, build_dummy_model, load_model
from ultrafast.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def greedy_alone(ex, prompt, n, slot=0):
    out, feed, pos = [], prompt, 0
    for i in range(n):
        r = ex.execute(StepPlan([ScheduledSeq("x", slot, feed, pos, 1, GREEDY, 0, i)]))
        pos += len(feed)
        feed = [r.sampled_token_ids["x"][0]]
        out.append(feed[0])
    return out


def test_mixed_batch_equals_each_alone(model_dir):
    ex = TorchExecutor(model_dir, num_slots=3, max_model_len=128, device="cpu")
    prompts = [[1, 2, 3], list(range(10, 40)), [7] * 12]
    alone = [greedy_alone(ex, p, 10, slot=i) for i, p in enumerate(prompts)]
    # batched: prompt 1 prefills in two chunks while prompt 0 already decodes
    state = [dict(feed=p, pos=0, out=[]) for p in prompts]
    state[1]["chunks"] = [prompts[1][:16], prompts[1][16:]]
    for step in range(12):
        seqs = []
        for i, s in enumerate(state):
            if len(s["out"]) >= 10:
                continue
            feed = s["chunks"].pop(0) if s.get("chunks") else s["feed"]
            last = not s.get("chunks")
            seqs.append(ScheduledSeq(f"r{i}", i, feed, s["pos"], 1 if last else 0, GREEDY, 0,
                                     len(s["out"])))
            s["pos"] += len(feed)
        if not seqs:
            break
        result = ex.execute(StepPlan(seqs))
        for seq in seqs:
            if seq.num_logits:
                s = state[int(seq.request_id[1:])]
                s["out"].append(result.sampled_token_ids[seq.request_id][0])
                s["feed"] = [s["out"][-1]]
    assert [s["out"] for s in state] == alone


def test_prefix_copy_equals_recompute(model_dir):
    ex = TorchExecutor(model_dir, num_slots=2, max_model_len=128, device="cpu")
    prompt = list(range(20, 52))
    expected = greedy_alone(ex, prompt + [5, 6], 6, slot=1)
    ex.execute(StepPlan([ScheduledSeq("a", 0, prompt, 0, 0, GREEDY, 0, 0)]))  # slot 0 holds it
    plan = StepPlan([ScheduledSeq("b", 1, [5, 6], 32, 1, GREEDY, 0, 0)],
                    kv_copies=[KVCopy(0, 1, 32)])
    first = ex.execute(plan).sampled_token_ids["b"][0]
    out, feed, pos = [first], [first], 34
    for i in range(1, 6):
        r = ex.execute(StepPlan([ScheduledSeq("b", 1, feed, pos, 1, GREEDY, 0, i)]))
        pos += 1
        feed = [r.sampled_token_ids["b"][0]]
        out.append(feed[0])
    assert out == expected


def test_reused_slot_ignores_stale_kv(model_dir):
    ex = TorchExecutor(model_dir, num_slots=1, max_model_len=128, device="cpu")
    fresh = greedy_alone(ex, [9, 8, 7], 5)
    greedy_alone(ex, list(range(60)), 3)  # fills the slot far past position 3
    assert greedy_alone(ex, [9, 8, 7], 5) == fresh


def test_bad_token_fails_only_that_request(model_dir):
    ex = TorchExecutor(model_dir, num_slots=2, max_model_len=64, device="cpu")
    result = ex.execute(StepPlan([ScheduledSeq("bad", 0, [1, 999], 0, 1, GREEDY, 0, 0),
                                  ScheduledSeq("ok", 1, [1, 2], 0, 1, GREEDY, 0, 0)]))
    assert "bad" in result.errors and "vocabulary" in result.errors["bad"]
    assert len(result.sampled_token_ids["ok"]) == 1


def test_loader_errors_name_the_problem(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    bad = tmp_path / "bad-arch"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model(bad)
    noweights = tmp_path / "no-weights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(noweights)
    wrong = tmp_path / "wrong-shape"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    (wrong / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="has shape"):
        load_model(wrong)
    missing = tmp_path / "missing-tensor"
    missing.mkdir()
    (missing / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (missing / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(missing)
    extra = tmp_path / "extra-tensor"
    extra.mkdir()
    (extra / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    (extra / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_model(extra)


def test_dummy_model_at_any_shape_runs():
    model = build_dummy_model({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64,
                               "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "head_dim": 16})
    ex = TorchExecutor(model, num_slots=1, max_model_len=16, device="cpu")
    assert len(greedy_alone(ex, [1, 2], 3)) == 3
