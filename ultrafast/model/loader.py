"""Build a LlamaForCausalLM from an HF directory (config.json + safetensors, single file or
sharded with an index), or with random weights from a config alone (benchmarks at real sizes).

Owns every way a model directory can be wrong, each reported as a ModelLoadError that names the
file or tensor and what was expected. safetensors only: torch.load unpickles arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ultrafast.model.config import ModelConfig, ModelLoadError
from ultrafast.model.dtypes import resolve_dtype
from ultrafast.model.llama import LlamaForCausalLM

# buffers some older checkpoints carry that we compute ourselves
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    try:
        return ModelConfig.from_hf(hf)
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks the required key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc!r}") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} is missing weight shards: {', '.join(missing)}")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    # never glob *.safetensors: Mistral repos also ship consolidated.safetensors (other names)
    files = sorted(model_dir.glob("model-*-of-*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{model_dir} has no model.safetensors (nor sharded "
            "model-*-of-*.safetensors with model.safetensors.index.json)"
        )
    return files


def _skip(name: str, config: ModelConfig) -> bool:
    # tied checkpoints sometimes store lm_head.weight anyway; it must equal embed_tokens
    return name.endswith(_IGNORED_SUFFIXES) or (
        name == "lm_head.weight" and config.tie_word_embeddings
    )


def _read_tensors(
    files: list[Path],
    expected: dict[str, torch.Size],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Every expected tensor, cast and placed one at a time (host memory stays at one tensor)."""
    from safetensors import safe_open  # here: dummy-weight models (GPU checks) need no files

    loaded: dict[str, torch.Tensor] = {}
    read_device = "cpu" if device.type == "meta" else str(device)
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device=read_device)
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from None
        with handle as f:
            for name in f.keys():
                if _skip(name, config):
                    continue
                if name not in expected:
                    raise ModelLoadError(
                        f"unexpected tensor {name!r} in {path.name}: "
                        f"{config.architecture} with this config.json has "
                        "no such parameter"
                    )
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    raise ModelLoadError(
                        f"tensor {name!r} in {path.name} has shape {shape}, expected "
                        f"{tuple(expected[name])} from config.json"
                    )
                loaded[name] = f.get_tensor(name).to(dtype=dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"the checkpoint is missing {len(missing)} tensors: {shown}{more}")
    return loaded


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model in eval mode on `device`; dtype None = float32 on CPU, bfloat16 elsewhere.
    `model_dir` may also be a .gguf file: its tensors are dequantized (model/gguf_weights.py)."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf" and model_dir.is_file():
        from ultrafast.model.gguf_weights import load_gguf_model

        return load_gguf_model(model_dir, dtype, device)
    config = read_config(model_dir)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device, config.torch_dtype)
    if (model_dir / "quantization.json").is_file():  # written by `ultrafast quantize`
        from ultrafast.quant.saved import load_quantized_model

        return load_quantized_model(model_dir, config, torch_dtype, device), config
    files = weight_files(model_dir)
    with torch.device("meta"):  # no memory and no random init for weights we overwrite
        model = LlamaForCausalLM(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    loaded = _read_tensors(files, expected, config, torch_dtype, device)
    model.load_state_dict(loaded, strict=False, assign=True)
    model.tie_weights()
    model.requires_grad_(False)
    model.set_max_positions(model.max_positions)  # the meta-built tables, now real
    return model.eval(), config


def build_dummy_model(
    config: ModelConfig | dict,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> LlamaForCausalLM:
    """Random weights (normal with `std`; norms 1, biases 0) for any config; no files read.

    Allocated empty on `device` and filled there with an explicit generator, so an 8B-shaped
    model on a GPU takes seconds and touches no global RNG.
    """
    if isinstance(config, dict):
        config = ModelConfig.from_hf(config)
    device = torch.device(device)
    torch_dtype = resolve_dtype(dtype, device, config.torch_dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch_dtype).to_empty(device=device)  # allocate once, in the final dtype
    model.tie_weights()  # to_empty gives each module its own tensor
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
    model.requires_grad_(False)
    model.set_max_positions(model.max_positions)
    return model.eval()
