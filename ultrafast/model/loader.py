"""Build a LlamaForCausalLM from an HF directory (config.json + safetensors), or with dummy
weights from a config alone (benchmarks at real sizes). safetensors only, never torch.load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ultrafast.model.config import ModelConfig
from ultrafast.model.llama import LlamaForCausalLM

# buffers some older checkpoints carry that we compute ourselves
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded, with a message that says what to fix."""


def _dtype(name: str | None, fallback: torch.dtype) -> torch.dtype:
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if name is None:
        return fallback
    if name not in table:
        raise ModelLoadError(f"unsupported dtype {name!r}; use one of {', '.join(table)}")
    return table[name]


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except (KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing weight shards: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    return files


def load_model(model_dir: str | Path, dtype: str | None = None,
               device: str | torch.device = "cpu") -> tuple[LlamaForCausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    torch_dtype = _dtype(dtype, torch.float32)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    expected = {name: p for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (
                        name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if name not in expected:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {path.name} for "
                                         f"{config.architecture}")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ModelLoadError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(expected[name].shape)} from config.json")
                loaded[name] = tensor.to(torch_dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ModelLoadError(f"{model_dir} is missing {len(missing)} tensors, e.g. {missing[0]!r}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return _finish(model, config, device), config


def _finish(model: LlamaForCausalLM, config: ModelConfig, device) -> LlamaForCausalLM:
    from ultrafast.model.llama import rope_inv_freq

    model.inv_freq = rope_inv_freq(config)
    return model.to(device).eval()


def build_dummy_model(config: ModelConfig | dict, dtype: str = "float32",
                      device: str | torch.device = "cpu", seed: int = 0) -> LlamaForCausalLM:
    """Random weights (std 0.02) for any supported config; nothing is read from disk."""
    if isinstance(config, dict):
        config = ModelConfig.from_hf(config)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(_dtype(dtype, torch.float32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()
