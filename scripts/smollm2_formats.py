"""SmolLM2-135M-Instruct in every weight format the benchmarks compare, all made from the one
Q4_1 file, so every format holds the same weights:

    .venv/bin/python scripts/smollm2_formats.py            # -> runs/models/smollm2/

writes SmolLM2-135M-Instruct.{Q4_1,q8_0,f16,bf16}.gguf and hf/ (config.json, float32
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json,
chat_template.jinja) for the torch executor and `ultrafast quantize`.

How: the Q4_1 file is copied as shipped; q8_0, f16 and bf16 are written by llama.cpp's own
quantizer (`llama_model_quantize` with `allow_requantize`), which dequantizes each Q4_1 (and
the Q8_0 embedding) tensor to float32 and stores that in the target type. They therefore carry
the Q4_1 weights' values, dequantized, then rounded to the target type: f16 and bf16 round each
value to their mantissa, q8_0 requantizes per block of 32 (the Q8_0 embedding comes back
unchanged). The script prints, per file, the largest difference from the dequantized Q4_1
values. The HF directory holds the dequantized values exactly (float32, q/k rows in HF's rope
layout), as model/gguf_weights.py loads them; the tokenizer is the one our server builds from
the GGUF's metadata (llama.cpp's ids), saved as tokenizer.json. Nothing is benchmarked here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

STEM = "SmolLM2-135M-Instruct"
SOURCE_NAME = f"{STEM}.Q4_1.gguf"
# output format -> llama_ftype (llama.h) for llama_model_quantize
FILE_TYPES = {"q8_0": 7, "f16": 1, "bf16": 32}
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
CHECK_TEXTS = [
    "What is the capital of France?",
    "def add(a, b):\n    return a + b  # 12345\n",
    "<|im_start|>user\nÜnïcödé, emoji 🚀 and  two  spaces<|im_end|>\n",
]


def default_source() -> Path:
    from ultrafast.config import cache_dir

    return cache_dir() / "models" / SOURCE_NAME


def llama_requantize(src: Path, dst: Path, ftype: int, threads: int) -> Path:
    """llama.cpp rewrites `src` as file type `ftype`, dequantizing quantized tensors first."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = ftype, True, threads
    tmp = dst.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed ({rc}) writing {dst.name}")
    tmp.rename(dst)
    return dst


def write_formats(src: Path, out_dir: Path, stem: str, threads: int = 0) -> dict[str, Path]:
    """{format: path} of the Q4_1 copy and its q8_0 / f16 / bf16 rewrites."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"Q4_1": out_dir / f"{stem}.Q4_1.gguf"}
    if src.resolve() != paths["Q4_1"].resolve():
        shutil.copyfile(src, paths["Q4_1"])
    for name, ftype in FILE_TYPES.items():
        paths[name] = llama_requantize(src, out_dir / f"{stem}.{name}.gguf", ftype, threads)
    return paths


def _state_dict(path: Path) -> dict:
    from ultrafast.model.gguf_weights import load_gguf_model

    model, _ = load_gguf_model(path)
    return model.state_dict()


def max_differences(reference: Path, paths: dict[str, Path]) -> dict[str, float]:
    """{format: largest |weight - dequantized reference weight|} over every tensor."""
    ref = _state_dict(reference)
    out = {}
    for name, path in paths.items():
        weights = _state_dict(path)
        out[name] = max(float((weights[k] - v).abs().max()) for k, v in ref.items())
    return out


def _hf_config(config) -> dict:
    if config.rope_freq_factors is not None or config.rope_scaling is not None:
        raise ValueError("rope scaling has no config.json spelling here; no HF directory")
    return {
        "architectures": [config.architecture],
        "model_type": _MODEL_TYPES[config.architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) or None,
        "dtype": "float32",
    }


def write_hf_dir(src: Path, out: Path) -> Path:
    """config.json + float32 safetensors of the dequantized weights + the GGUF's tokenizer."""
    from safetensors.torch import save_file

    from ultrafast.model.gguf_meta import read_gguf_metadata
    from ultrafast.model.gguf_tokenizer import gguf_vocab
    from ultrafast.model.gguf_weights import load_gguf_model

    meta = read_gguf_metadata(src)
    vocab = gguf_vocab(meta)
    if vocab.spm is not None:
        raise ValueError("a SentencePiece vocabulary has no tokenizer.json here; no HF directory")
    model, config = load_gguf_model(src)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_hf_config(config), indent=2) + "\n")
    weights = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight")  # shares embed_tokens' storage; HF re-ties it on load
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    vocab.hf_tokenizer.save(str(out / "tokenizer.json"))
    tok_config = {
        "bos_token": vocab.token_text(vocab.bos_id),
        "eos_token": vocab.token_text(vocab.eos_id),
        "add_bos_token": vocab.add_bos,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config.max_position_embeddings,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    generation = {"eos_token_id": list(vocab.eog_ids), **vocab.sampling_defaults}
    if vocab.bos_id is not None:
        generation["bos_token_id"] = vocab.bos_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if vocab.chat_template:
        (out / "chat_template.jinja").write_text(vocab.chat_template, encoding="utf-8")
    return out


def check_hf_dir(src: Path, hf_dir: Path) -> list[str]:
    """What differs between the HF directory and the GGUF it came from (empty: nothing)."""
    import torch

    from ultrafast.model.loader import load_model
    from ultrafast.tokenizer import Tokenizer

    problems = []
    ours, _ = load_model(hf_dir)
    ref = _state_dict(src)
    for name, tensor in ours.state_dict().items():
        if not torch.equal(tensor, ref[name]):
            problems.append(f"tensor {name} differs")
    from_dir, from_gguf = Tokenizer.from_dir(hf_dir), Tokenizer.from_gguf(src)
    for text in CHECK_TEXTS:
        if from_dir.encode(text) != from_gguf.encode(text):
            problems.append(f"tokenizer.json encodes {text!r} differently")
    messages = [{"role": "user", "content": CHECK_TEXTS[0]}]
    if from_dir.apply_chat_template(messages) != from_gguf.apply_chat_template(messages):
        problems.append("the chat template renders differently")
    if set(from_dir.eos_token_ids) != set(from_gguf.eos_token_ids):
        problems.append(f"EOS ids {from_dir.eos_token_ids} != {from_gguf.eos_token_ids}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=None, help=f"the {SOURCE_NAME} file")
    parser.add_argument("--out", type=Path, default=Path("runs/models/smollm2"))
    parser.add_argument("--stem", default=STEM, help="file name stem of the outputs")
    parser.add_argument("--no-hf-dir", action="store_true", help="only the GGUF files")
    parser.add_argument("--threads", type=int, default=0, help="quantizer threads (0: all)")
    args = parser.parse_args(argv)
    src = args.source or default_source()
    if not src.is_file():
        print(
            f"error: {src} not found (fetch it with the setup, or pass --source)", file=sys.stderr
        )
        return 2
    paths = write_formats(src, args.out, args.stem, args.threads)
    for name, diff in max_differences(src, paths).items():
        size = paths[name].stat().st_size / 2**20
        print(f"{paths[name]}  {size:7.1f} MiB  max |w - dequantized Q4_1 w| = {diff:.3g}")
    if not args.no_hf_dir:
        hf_dir = write_hf_dir(src, args.out / "hf")
        problems = check_hf_dir(src, hf_dir)
        print(f"{hf_dir}: " + ("; ".join(problems) if problems else "weights and tokenizer match"))
        if problems:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
