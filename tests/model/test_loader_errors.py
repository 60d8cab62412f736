"""The loader: every way a model directory can be wrong is a ModelLoadError naming the problem;
sharded and tied checkpoints load. Checkpoints are written with safetensors directly (no
transformers), from our own dummy model.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from ultrafast.model.loader import ModelLoadError, build_dummy_model, load_model

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}


def tensors(config=CONFIG) -> dict[str, torch.Tensor]:
    model = build_dummy_model(config, dtype="float32", seed=0)
    return {k: v.clone().contiguous() for k, v in model.state_dict().items()}


def write(path, config=CONFIG, weights=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors() if weights is None else weights, str(path / "model.safetensors"))
    return path


def expect(path, *fragments):
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def test_a_good_checkpoint_loads_and_runs(tmp_path):
    model, config = load_model(write(tmp_path / "ok"))
    assert config.architecture == "LlamaForCausalLM" and config.num_key_value_heads == 2
    expected = tensors()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert issubclass(ModelLoadError, ValueError)


def test_missing_directory_config_and_weights(tmp_path):
    expect(tmp_path / "nope", "does not exist")
    (tmp_path / "empty").mkdir()
    expect(tmp_path / "empty", "config.json")
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps(CONFIG))
    (only_config / "pytorch_model.bin").write_bytes(b"pickles are never loaded")
    expect(only_config, "model.safetensors")


def test_broken_config(tmp_path):
    bad_json = write(tmp_path / "bad-json")
    (bad_json / "config.json").write_text("{not json")
    expect(bad_json, "not valid JSON")
    no_key = write(tmp_path / "no-key", {k: v for k, v in CONFIG.items() if k != "hidden_size"})
    expect(no_key, "hidden_size")
    expect(
        write(tmp_path / "gpt2", {**CONFIG, "architectures": ["GPT2LMHeadModel"]}),
        "unsupported architecture",
        "GPT2LMHeadModel",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    )
    expect(
        write(tmp_path / "yarn", {**CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        "yarn",
    )
    expect(write(tmp_path / "heads", {**CONFIG, "num_key_value_heads": 3}), "multiple")


def test_missing_unexpected_and_misshapen_tensors(tmp_path):
    weights = tensors()
    del weights["model.layers.1.mlp.up_proj.weight"]
    expect(
        write(tmp_path / "missing", weights=weights),
        "missing 1 tensors",
        "model.layers.1.mlp.up_proj.weight",
    )
    weights = {**tensors(), "model.layers.0.mlp.extra.weight": torch.zeros(2)}
    expect(
        write(tmp_path / "unexpected", weights=weights),
        "unexpected tensor",
        "model.layers.0.mlp.extra.weight",
    )
    # config says 2 layers, the file has 3: layer 2 is unexpected
    three = tensors({**CONFIG, "num_hidden_layers": 3})
    expect(write(tmp_path / "extra-layer", weights=three), "unexpected tensor", "layers.2")
    weights = {**tensors(), "model.layers.1.self_attn.k_proj.weight": torch.zeros(12, 32)}
    message = expect(
        write(tmp_path / "shape", weights=weights),
        "model.layers.1.self_attn.k_proj.weight",
        "(12, 32)",
        "(16, 32)",
    )
    assert message.index("(12, 32)") < message.index("(16, 32)")  # found, then expected
    # a config that disagrees with the file names the tensor too
    expect(
        write(tmp_path / "config-shape", {**CONFIG, "intermediate_size": 40}),
        "has shape",
        "model.layers.",
        "from config.json",
    )


def test_corrupt_file_and_missing_shard(tmp_path):
    corrupt = write(tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    expect(corrupt, "not a readable safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(CONFIG))
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    expect(sharded, "missing weight shards", "model-00001-of-00002.safetensors")


def test_sharded_checkpoint_with_index(tmp_path):
    weights = tensors()
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    path = tmp_path / "sharded"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    for file_name, members in shards.items():
        save_file({n: weights[n] for n in members}, str(path / file_name))
    weight_map = {n: f for f, members in shards.items() for n in members}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model, _ = load_model(path)
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])


def test_tied_embeddings_share_one_tensor(tmp_path):
    tied_config = {**CONFIG, "tie_word_embeddings": True}
    weights = tensors()
    del weights["lm_head.weight"]
    model, config = load_model(write(tmp_path / "tied", tied_config, weights))
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # bfloat16 on request, ties kept
    model, _ = load_model(tmp_path / "tied", dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ModelLoadError, match="unsupported dtype"):
        load_model(tmp_path / "tied", dtype="int3")
