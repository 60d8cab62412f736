"""Make a model of a real model's shape, with random weights and the demo tokenizer.

For benchmarks whose outcome depends on the model's size rather than on what it says: how time
to first token grows with a conversation's history depends on how attention over the history
compares with the pass through the weights, and on the 11M-parameter demo model (hidden 384)
attention dominates far sooner than on a production-sized one. The weights are random (normal,
std 0.02), so the text is noise; lengths are held with `ignore_eos`.

    .venv/bin/python scripts/make_shaped_model.py --shape llama-1b --outtype q8_0 \\
        --out runs/models/llama-1b-shaped

writes an HF directory (config.json, fp16 model.safetensors, the demo tokenizer) and
`<name>-<outtype>.gguf` in it, which `ultrafast serve` / `bench --model` accept.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo-code"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# Layer shapes of public models; the vocabulary is the demo tokenizer's (4,096), so the
# embedding is small and the layers carry nearly all of the weights, as in the originals.
SHAPES = {
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    "qwen-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
}


def shaped_config(shape: str, max_positions: int) -> dict:
    demo = json.loads((DEMO / "config.json").read_text())
    config = {**demo, **SHAPES[shape], "max_position_embeddings": max_positions}
    config["dtype"] = "float16"
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-1b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--outtype", default="q8_0", help="GGUF type (f16, q8_0, ...)")
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from safetensors.torch import save_file

    from ultrafast.convert import convert_hf_to_gguf
    from ultrafast.model.loader import build_dummy_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = shaped_config(args.shape, args.max_positions)
    model = build_dummy_model(config, dtype=torch.float16, seed=args.seed)
    tensors = {
        name: t.contiguous() for name, t in model.state_dict().items() if name != "lm_head.weight"
    }  # tied: the embedding is the output layer
    num_params = sum(t.numel() for t in tensors.values())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del model, tensors
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / name, out / name)
    gguf_path = convert_hf_to_gguf(out, out / f"{out.name}-{args.outtype}.gguf", args.outtype)
    print(f"{args.shape}: {num_params / 1e6:.0f}M parameters -> {out} and {gguf_path.name}")


if __name__ == "__main__":
    main()
