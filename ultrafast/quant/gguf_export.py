"""A type plan as a GGUF file for the ggml executor (and any llama.cpp), tensor by tensor.

Plan type -> GGUF type: "f16" -> F16, "int8" -> Q8_0 (blocks of 32, one scale each: llama.cpp
has no per-row int8), "int4" -> Q4_0 (symmetric) or Q4_1 (with a zero point), written from the
very codes and float16 scales of `tensors.quantize_int4`, so llama.cpp dequantizes exactly the
weights the torch Int4Linear holds. A weight whose rows are not a multiple of 32 cannot be a
ggml block type and is written as F16; `export_gguf` returns the types actually written.

With tied embeddings and different types for the lookup and the output projection, an explicit
`output.weight` is written (llama.cpp uses it when present). Metadata, tokenizer and tensor
names come from `ultrafast.convert`, the f16/q8_0 converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

from ultrafast import convert
from ultrafast.quant.plan import EMBED, INT4, INT8, KEEP, LM_HEAD
from ultrafast.quant.tensors import QuantizedWeight, quantize_int4

Q = gguf.GGMLQuantizationType
GGUF_BLOCK = 32  # q4_0 / q4_1 / q8_0 block length


def q4_blocks(qw: QuantizedWeight) -> np.ndarray:
    """ggml q4_0 / q4_1 bytes [N, num_groups * block bytes] from 32-wide int4 groups."""
    if qw.group_size != GGUF_BLOCK or qw.codes.shape[1] != qw.in_features:
        raise ValueError("GGUF q4 blocks need group_size 32 and rows a multiple of 32")
    num_rows, num_groups = qw.scales.shape
    codes = qw.codes.numpy().reshape(num_rows, num_groups, GGUF_BLOCK)
    half = GGUF_BLOCK // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)  # element j low, j + 16 high
    parts = [qw.scales.numpy().astype(np.float16).view(np.uint8).reshape(num_rows, num_groups, 2)]
    if qw.mins is not None:
        parts.append(
            qw.mins.numpy().astype(np.float16).view(np.uint8).reshape(num_rows, num_groups, 2)
        )
    parts.append(packed.astype(np.uint8))
    return np.concatenate(parts, axis=-1).reshape(num_rows, -1)


def gguf_type(plan_type: str, num_cols: int, zero_point: bool) -> Q:
    if plan_type == KEEP or num_cols % GGUF_BLOCK:
        return Q.F16
    if plan_type == INT8:
        return Q.Q8_0
    if plan_type == INT4:
        return Q.Q4_1 if zero_point else Q.Q4_0
    raise ValueError(f"unknown plan type {plan_type!r}")


def _encode(data: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q | None]:
    if qtype == Q.F16:
        return data.astype(np.float16), None
    if qtype == Q.Q8_0:
        return gguf.quants.quantize(data, qtype), qtype
    qw = quantize_int4(torch.from_numpy(data), GGUF_BLOCK, zero_point=qtype == Q.Q4_1)
    return q4_blocks(qw), qtype


def _file_type(plan: dict[str, str], zero_point: bool) -> gguf.LlamaFileType:
    types = set(plan.values())
    if INT4 in types:
        return gguf.LlamaFileType.MOSTLY_Q4_1 if zero_point else gguf.LlamaFileType.MOSTLY_Q4_0
    return gguf.LlamaFileType.MOSTLY_Q8_0 if INT8 in types else gguf.LlamaFileType.MOSTLY_F16


def gguf_tensor_name(hf_name: str) -> str:
    name = "output.weight" if hf_name == LM_HEAD else convert.checkpoint_gguf_name(hf_name)
    if name is None:
        raise ValueError(f"{hf_name} has no GGUF tensor")
    return name


def export_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    plan: dict[str, str],
    zero_point: bool = False,
    untie: bool = False,
) -> dict[str, str]:
    """Write the full-precision HF checkpoint at `model_dir` as a GGUF typed by `plan`.

    Returns {gguf tensor name: ggml type name} of the 2-D weights as written. `untie` writes
    an explicit output.weight for a tied checkpoint even when both types agree.
    """
    model_dir, out_path = Path(model_dir), Path(out_path)
    config = json.loads((model_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    untie = tied and (untie or plan.get(LM_HEAD, KEEP) != plan.get(EMBED, KEEP))
    writer = convert.gguf_writer(model_dir, config, out_path, _file_type(plan, zero_point))
    written: dict[str, str] = {}
    for name, hf_name, data in convert.gguf_layout_tensors(model_dir, config):
        outputs = [(name, hf_name)]
        if untie and hf_name == EMBED:
            outputs.append(("output.weight", LM_HEAD))
        for out_name, plan_name in outputs:
            if data.ndim == 1:
                writer.add_tensor(out_name, data.astype(np.float32))
                continue
            qtype = gguf_type(plan.get(plan_name, KEEP), data.shape[1], zero_point)
            array, raw_dtype = _encode(data, qtype)
            writer.add_tensor(out_name, array, raw_dtype=raw_dtype)
            written[out_name] = qtype.name
    convert.finish_gguf(writer)
    return written
