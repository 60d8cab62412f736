"""K-quants (q4_K and friends) through llama.cpp's own quantizer, with per-tensor overrides.

The gguf Python package cannot produce k-quants, so a full-precision GGUF is handed to
`llama_model_quantize` (llama-cpp-python's low-level binding) with a base file type and
`tt_overrides`: a NULL-terminated array of (regex on the tensor name, ggml type) that llama.cpp
applies before its own per-tensor rules. A hybrid plan's 16-bit tensors become overrides, so
the result keeps exactly those tensors in f16 and lets llama.cpp pick the k-quant for the rest.

K-quant blocks hold 256 weights; llama.cpp writes a row length that is not a multiple of 256
(a hidden size of 384, as in demo-code) in its fallback type (q5_0 for q4_K), and its q4_K_M
mix also promotes some tensors to q6_K. `tensor_types()` reads back what was written.
Unlike q4_0/q4_1 (gguf_export.py) these are not bit-identical to the torch int4 weights.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import gguf

FILE_TYPES = {"q4_K_M": 15, "q4_K_S": 14, "q4_0": 2, "q8_0": 7}  # llama_ftype values
_GGML_TYPES = {
    "f16": int(gguf.GGMLQuantizationType.F16),
    "q8_0": int(gguf.GGMLQuantizationType.Q8_0),
}


def quantize_gguf(
    src_path: str | Path,
    dst_path: str | Path,
    file_type: str = "q4_K_M",
    overrides: dict[str, str] | None = None,
    n_threads: int = 0,
) -> Path:
    """Quantize a full-precision GGUF; overrides: {exact gguf tensor name: "f16" | "q8_0"}."""
    import llama_cpp

    src_path, dst_path = Path(src_path), Path(dst_path)
    if file_type not in FILE_TYPES:
        raise ValueError(f"unknown file type {file_type!r}; choose from {sorted(FILE_TYPES)}")
    if not src_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src_path}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[file_type]
    params.nthread = n_threads
    items = sorted((overrides or {}).items())
    array = (llama_cpp.llama_model_tensor_override * (len(items) + 1))()
    patterns = [f"^{re.escape(name)}$".encode() for name, _ in items]  # kept alive below
    for slot, (pattern, (_, type_name)) in zip(array, zip(patterns, items)):
        if type_name not in _GGML_TYPES:
            raise ValueError(f"override type must be one of {sorted(_GGML_TYPES)}")
        slot.pattern, slot.type = pattern, _GGML_TYPES[type_name]
    array[len(items)].pattern = None  # the terminator
    if items:
        params.tt_overrides = ctypes.cast(
            array, ctypes.POINTER(llama_cpp.llama_model_tensor_override)
        )
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(
        str(src_path).encode(), str(dst_path).encode(), ctypes.byref(params)
    )
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) on {src_path}")
    return dst_path


def tensor_types(path: str | Path) -> dict[str, str]:
    """{tensor name: ggml type name} of the 2-D tensors of a GGUF file."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
