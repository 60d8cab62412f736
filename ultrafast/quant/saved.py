"""The saved format of a quantized torch model, and its loader (called by `load_model`).

A directory like an HF checkpoint, so every tool that finds config.json + tokenizer works:
  config.json, tokenizer files, generation_config.json   copied from the source model
  model.safetensors                                      see below
  quantization.json                                      {"format": FORMAT, "version": 1,
      "group_size", "zero_point", "tensors": {hf weight name: "f16" | "int8" | "int4"}, ...}

In model.safetensors a 16-bit weight keeps its HF name (stored in the source checkpoint's
dtype); a quantized weight `X.weight` becomes `X.qweight` (int8 codes [N, K], or int4 codes
two per byte [N, K_padded / 2], low nibble first), `X.scales` and, for int4 with a zero point,
`X.mins`. Biases and norms keep their names. A tied lm_head is stored only when its type
differs from the embedding's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ultrafast.model.config import ModelLoadError
from ultrafast.model.llama import LlamaForCausalLM
from ultrafast.quant.plan import EMBED, KEEP, LM_HEAD, apply_quantized
from ultrafast.quant.tensors import INT4, INT8, QuantizedWeight, pack_nibbles, unpack_nibbles

FORMAT = "ultrafast-weight-only"
QUANT_CONFIG = "quantization.json"
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0]


def save_quantized(
    model: LlamaForCausalLM,
    plan: dict[str, str],
    quantized: dict[str, QuantizedWeight],
    source_dir: str | Path,
    out_dir: str | Path,
    meta: dict,
) -> Path:
    """Write the quantized model; `model` must hold the 16-bit weights of the plan's KEEP ones."""
    out_dir, source_dir = Path(out_dir), Path(source_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        model.config.torch_dtype, torch.float16
    )
    tensors: dict[str, torch.Tensor] = {}
    quantized_stems = {_stem(n) for n in quantized}
    for name, tensor in model.state_dict().items():
        if _stem(name) in quantized_stems and not name.endswith(".bias"):
            continue  # the weight, or the buffers of a swapped-in module: codes go below
        if (
            name == LM_HEAD
            and model.config.tie_word_embeddings
            and plan.get(LM_HEAD) == plan.get(EMBED) == KEEP
        ):
            continue  # tied and both 16-bit: the loader ties them again
        tensors[name] = tensor.detach().to(store_dtype).contiguous().clone()
    for name, qw in quantized.items():
        stem = _stem(name)
        codes = pack_nibbles(qw.codes) if qw.qtype == INT4 else qw.codes
        tensors[f"{stem}.qweight"] = codes.contiguous()
        tensors[f"{stem}.scales"] = qw.scales.contiguous()
        if qw.mins is not None:
            tensors[f"{stem}.mins"] = qw.mins.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    copy_model_files(source_dir, out_dir)
    config = {"format": FORMAT, "version": 1, **meta, "tensors": plan}
    (out_dir / QUANT_CONFIG).write_text(json.dumps(config, indent=1))
    return out_dir


def copy_model_files(source_dir: Path, out_dir: Path) -> None:
    """config, tokenizer and generation settings: everything but the weights."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in _COPIED:
        if (source_dir / file).is_file() and source_dir.resolve() != out_dir.resolve():
            shutil.copyfile(source_dir / file, out_dir / file)


def read_quant_config(model_dir: Path) -> dict:
    path = model_dir / QUANT_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if config.get("format") != FORMAT or config.get("version") != 1:
        raise ModelLoadError(
            f"{path}: unknown quantization format {config.get('format')!r} "
            f"version {config.get('version')!r} (expected {FORMAT!r} v1)"
        )
    return config


def _quantized_weight(
    f, stem: str, qtype: str, in_features: int, group_size: int
) -> QuantizedWeight:
    keys = set(f.keys())
    mins = f.get_tensor(f"{stem}.mins") if f"{stem}.mins" in keys else None
    codes = f.get_tensor(f"{stem}.qweight")
    if qtype == INT4:
        codes = unpack_nibbles(codes)
    return QuantizedWeight(
        qtype,
        codes,
        f.get_tensor(f"{stem}.scales"),
        mins,
        in_features,
        group_size if qtype == INT4 else 0,
    )


def load_quantized_model(
    model_dir: Path, config, torch_dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model with Int8Linear/Int4Linear modules; kernels only on the CPU (see linear.py)."""
    qconfig = read_quant_config(model_dir)
    plan, group_size = qconfig["tensors"], int(qconfig.get("group_size", 32))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no model.safetensors")
    quantized, plain = {}, {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        try:
            for name, qtype in plan.items():
                if qtype in (INT8, INT4):
                    weight = model.get_submodule(_stem(name)).weight
                    if not isinstance(weight, torch.Tensor):
                        raise TypeError(f"{_stem(name)} has no weight tensor")
                    in_features = weight.shape[1]
                    quantized[name] = _quantized_weight(
                        f, _stem(name), qtype, in_features, group_size
                    )
        except Exception as exc:  # a missing key or a corrupt tensor
            raise ModelLoadError(f"{path}: cannot read the quantized tensors: {exc}") from None
        skip = {f"{_stem(n)}.{s}" for n in quantized for s in ("qweight", "scales", "mins")}
        for name in f.keys():
            if name not in skip:
                plain[name] = f.get_tensor(name).to(torch_dtype)
    untied = LM_HEAD in plain or LM_HEAD in quantized
    expected = {n for n in model.state_dict() if not (n == LM_HEAD and not untied)}
    expected -= set(quantized)
    missing = sorted(expected - set(plain))
    if missing:
        raise ModelLoadError(f"{path} is missing {len(missing)} tensors: {missing[:5]}")
    # bias of quantized modules travel into the new module, so load the plain tensors first
    model.load_state_dict(plain, strict=False, assign=True)
    if not untied:
        model.tie_weights()
    apply_quantized(model, quantized, torch_dtype)
    model.requires_grad_(False)
    if device.type != "cpu":  # the *_for_cpu kernels: run the dequantize path elsewhere
        from ultrafast.quant.linear import set_use_kernel

        set_use_kernel(model, False)
        model = model.to(device)
    model.set_max_positions(model.max_positions)
    return model.eval()
