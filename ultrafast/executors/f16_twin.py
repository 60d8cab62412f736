"""A bf16 GGUF served by llama.cpp from an exact float16 copy of it, where that is faster.

Why: llama.cpp multiplies a bf16 matrix by converting its input to bf16 and running its bf16
dot products; on a CPU without bf16 instructions (AVX2, AVX-512 without BF16) those are
emulated, while its f16 kernels convert with F16C and run tiled. On the AVX2 EPYC the f16 file
ran a 16-wide decode step in ~61 ms against ~76 and a 102-token prefill in 217 against 290
(BENCHMARKS.md). A bf16 value is a float16 value whenever its magnitude sits in float16's
range with its 8 significant bits on float16's grid, which trained weights usually do: then
the copy holds the same weights, only stored another way. It is used only when all three hold:

1. **exact**: the copy, read back, holds every tensor's values unchanged (float32 compare);
2. **no overflow**: llama.cpp rounds each matmul's input to the weight's type, and float16
   overflows at 65,504 where bf16 does not. In the llama block (RMSNorm, then q/k/v or the
   SwiGLU gate/up; attention's output into o; silu(gate) * up into down) every such input is
   bounded by the weights alone, whatever the prompt: a normed vector has norm at most
   sqrt(d), so `|γ_i n_i| <= sqrt(d) max|γ|`, a projection `|w.(γ n)| <= sqrt(d) |w γ|`, an
   attention output is a convex mix of V rows, and `|(a.n)(b.n)| <= d (|a||b| + |a.b|) / 2`.
   Files of other architectures, or whose bound passes 99% of 65,504, keep bf16;
3. **faster here**: both files are timed side by side (a prefill chunk and wide decode
   steps, interleaved), once per (CPU, file, llama.cpp), cached with the start costs.

The copy lives in the cache directory (`gguf/`); the executor keeps the original path as
its identity (the wide path's torch weights, the KV fingerprint, the tokenizer read it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ultrafast.config import cache_dir
from ultrafast.cpu_info import cpu_identity
from ultrafast.executors.cost_cache import read_cache, write_cache
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model.gguf_weights import gguf_tensor

log = logging.getLogger("ultrafast")

F16_MAX = 65504.0
BOUND_SHARE = 0.99  # of F16_MAX: float32 rounding in the norms and products is far smaller
SILU_MIN = 0.2785  # |silu(g)| <= 0.2785 for g <= 0
LLAMA_BLOCK_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
_LAYER_TENSOR = re.compile(
    r"blk\.\d+\.(attn_norm|attn_q|attn_k|attn_v|attn_output|attn_q_norm|attn_k_norm|"
    r"ffn_norm|ffn_gate|ffn_up|ffn_down)\.weight|blk\.\d+\.attn_[qkv]\.bias"
)
_MODEL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
MIN_GAIN = 0.05  # the copy must be this much faster in all, and no part this much slower
TWIN_REVISION = 1  # bump when the measurement or the checks change


@dataclass(frozen=True)
class TwinChoice:
    """The file llama.cpp loads, and the one line a start logs about it."""

    weights: Path
    why: str


GGML_F16, GGML_BF16 = 1, 30  # ggml_type ids


class _File:
    """A GGUF's tensor table (our header reader) and its tensors as float32
    (model/gguf_weights.py's reader, numpy's shape: a matrix is (output rows, input columns))."""

    def __init__(self, path: Path):
        self.meta = read_gguf_metadata(path)
        self.tensors = {t.name: t for t in self.meta.tensors}

    def matrix(self, name: str) -> np.ndarray:
        return gguf_tensor(self.meta, name)

    def vector(self, name: str) -> np.ndarray | None:
        return gguf_tensor(self.meta, name).reshape(-1) if name in self.tensors else None


def has_bf16_matrices(path: Path) -> bool:
    return any(
        t.ggml_type == GGML_BF16 and len(t.shape) > 1 for t in read_gguf_metadata(path).tensors
    )


def matmul_input_bound(file: _File) -> float | None:
    """The largest value any matmul's input can reach in llama.cpp's forward over this file,
    for every prompt (module docstring), or None where the file is not the llama block."""
    if file.meta.architecture not in LLAMA_BLOCK_ARCHS:
        return None
    if any(n not in _MODEL_TENSORS and not _LAYER_TENSOR.fullmatch(n) for n in file.tensors):
        return None  # something this bound does not model (MoE, post-norms, ffn biases)
    gamma = file.vector("output_norm.weight")
    if gamma is None:
        return None
    root_d = float(np.sqrt(gamma.size))
    bound = root_d * float(np.abs(gamma).max())  # the head's input
    layer = 0
    while f"blk.{layer}.attn_norm.weight" in file.tensors:
        bound = max(bound, _layer_bound(file, f"blk.{layer}.", root_d))
        layer += 1
    return bound


def _layer_bound(file: _File, prefix: str, root_d: float) -> float:
    g_attn = file.vector(prefix + "attn_norm.weight")
    g_ffn = file.vector(prefix + "ffn_norm.weight")
    if g_attn is None or g_ffn is None:
        raise ValueError(f"{prefix} lacks a norm")
    normed = root_d * float(max(np.abs(g_attn).max(), np.abs(g_ffn).max()))
    v_rows = root_d * np.linalg.norm(file.matrix(prefix + "attn_v.weight") * g_attn, axis=1)
    v_bias = file.vector(prefix + "attn_v.bias")
    if v_bias is not None:
        v_rows = v_rows + np.abs(v_bias)
    a = file.matrix(prefix + "ffn_gate.weight") * g_ffn
    b = file.matrix(prefix + "ffn_up.weight") * g_ffn
    a_norm, b_norm = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dot = np.abs(np.einsum("ij,ij->i", a, b))
    product = root_d**2 * (a_norm * b_norm + dot) / 2  # silu(g) * u with g > 0
    negative = SILU_MIN * root_d * b_norm  # g <= 0
    return float(max(normed, v_rows.max(), np.maximum(product, negative).max()))


def first_difference(source: Path, twin: Path) -> str | None:
    """The first tensor `twin` does not hold exactly as `source` does (name, shape, float32
    values), or None when it holds them all."""
    a, b = _File(source), _File(twin)
    if set(a.tensors) != set(b.tensors):
        return "the tensor table"
    for name in a.tensors:
        if not np.array_equal(a.matrix(name), b.matrix(name)):  # shapes too
            return name
    return None


def twin_path(source: Path) -> Path:
    stat = source.stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    stamp = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_dir() / "gguf" / f"{source.stem}-{stamp}-f16-twin.gguf"


def write_twin(source: Path, out: Path, threads: int) -> Path:
    """llama.cpp's own converter stores every bf16 matrix as float16 (1-D tensors stay)."""
    import ctypes

    import llama_cpp

    from ultrafast.executors.ggml_open import _init_native

    _init_native(False)  # llama.cpp's progress lines go to our silent log sink
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = 1, threads  # LLAMA_FTYPE_MOSTLY_F16
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.partial")  # two servers starting at once
    rc = llama_cpp.llama_model_quantize(
        str(source).encode(), str(tmp).encode(), ctypes.byref(params)
    )
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's converter failed ({rc})")
    tmp.replace(out)
    return out


def checked_twin(source: Path, threads: int) -> tuple[Path | None, str]:
    """The exact float16 copy of `source` (made if absent), or None and why not."""
    file = _File(source)
    bound = matmul_input_bound(file)
    if bound is None:
        return None, f"{file.meta.architecture or 'this'} architecture: no overflow bound"
    if bound > BOUND_SHARE * F16_MAX:
        return None, f"a matmul input may reach {bound:,.0f}, past float16's range"
    out = twin_path(source)
    if not out.is_file():
        write_twin(source, out, threads)
    differs = first_difference(source, out)
    if differs is not None:
        out.unlink(missing_ok=True)
        return None, f"the float16 copy's {differs} differs from the file's"
    return out, f"exact, matmul inputs bounded by {bound:,.0f}"


PREFILL_TOKENS = 128
DECODE_STEPS = 6


def time_files(
    source: Path, twin: Path, width: int, threads: int, flash_attn: bool, rounds: int = 3
) -> dict[str, dict[str, float]]:
    """{"source"|"twin": {"prefill_ms", "decode_ms"}}: medians of a 128-token prefill and of
    `width`-wide decode steps on each file, the files interleaved round by round."""
    from ultrafast.executors.ggml_exec import GgmlExecutor

    files = {"source": source, "twin": twin}
    times: dict[str, dict[str, list[float]]] = {
        k: {"prefill_ms": [], "decode_ms": []} for k in files
    }
    executors: dict[str, GgmlExecutor] = {}
    try:
        for name, path in files.items():
            executors[name] = GgmlExecutor(
                source,
                num_slots=width,
                max_model_len=PREFILL_TOKENS + DECODE_STEPS + 8,
                n_threads=threads,
                max_num_batched_tokens=PREFILL_TOKENS,
                flash_attn=flash_attn,
                weights_path=path,
            )
        for r in range(rounds):
            for name, ex in executors.items():
                prefill_ms, decode_ms = _time_round(ex, width, r)
                times[name]["prefill_ms"].append(prefill_ms)
                times[name]["decode_ms"].extend(decode_ms)
    finally:
        for ex in executors.values():
            ex.close()
    return {k: {m: float(np.median(v)) for m, v in t.items()} for k, t in times.items()}


def _time_round(ex, width: int, r: int) -> tuple[float, list[float]]:
    """A prefill of slot 0, a token in every other slot, then decode steps over all."""
    from ultrafast.core.types import ScheduledSeq, StepPlan
    from ultrafast.request import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    vocab = ex.vocab_size

    def run(seqs: list) -> None:
        result = ex.execute(StepPlan(seqs))
        if result.errors:  # a timing of nothing would decide wrongly
            raise RuntimeError(f"timing the float16 copy failed: {result.errors}")

    prompt = [(i * 31 + 7 + r) % vocab for i in range(PREFILL_TOKENS)]
    start = time.perf_counter()
    run([ScheduledSeq(f"r{r}s0", 0, prompt, 0, 1, greedy, 0, 0)])
    prefill_ms = (time.perf_counter() - start) * 1e3
    if width > 1:
        run(
            [ScheduledSeq(f"r{r}s{s}", s, [s % vocab], 0, 1, greedy, 0, 0) for s in range(1, width)]
        )
    decode_ms = []
    for step in range(DECODE_STEPS):
        seqs = [
            ScheduledSeq(
                f"r{r}s{s}",
                s,
                [(11 + step) % vocab],
                (PREFILL_TOKENS if s == 0 else 1) + step,
                1,
                greedy,
                0,
                0,
            )
            for s in range(width)
        ]
        start = time.perf_counter()
        run(seqs)
        decode_ms.append((time.perf_counter() - start) * 1e3)
    return prefill_ms, decode_ms


def twin_wins(timed: dict[str, dict[str, float]]) -> bool:
    """The copy is used when a prefill chunk plus a decode step is MIN_GAIN faster on it and
    neither is MIN_GAIN slower."""
    src, twin = timed["source"], timed["twin"]
    if any(twin[k] > (1 + MIN_GAIN) * src[k] for k in src):
        return False
    return sum(twin.values()) <= (1 - MIN_GAIN) * sum(src.values())


_lock = threading.Lock()  # an early open's thread and the engine's may both ask
_chosen: dict[str, TwinChoice] = {}


def choose_weights(
    source: Path, width: int, threads: int, flash_attn: bool, mode: str = "auto"
) -> TwinChoice:
    """The file llama.cpp should load for `source`: its exact float16 copy where that is
    checked and measured faster (module docstring), else `source` itself."""
    if mode == "off":
        return TwinChoice(source, "bf16 matrices as stored (--f16-twin off)")
    if not has_bf16_matrices(source):
        return TwinChoice(source, "")
    identity = _identity(source, width, threads, flash_attn)
    key = json.dumps(identity, sort_keys=True)
    with _lock:
        if key not in _chosen:
            _chosen[key] = _cached(identity, source) or _decide(
                identity, source, width, threads, flash_attn
            )
            log.info("llama.cpp weights: %s", _chosen[key].why)
        return _chosen[key]


def _identity(source: Path, width: int, threads: int, flash_attn: bool) -> dict:
    import llama_cpp

    stat = source.stat()
    return {
        "kind": "f16-twin",
        "revision": TWIN_REVISION,
        **cpu_identity(),
        "model": str(source.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "width": width,
        "threads": threads,
        "flash_attn": flash_attn,
        "llama_cpp": getattr(llama_cpp, "__version__", "?"),
    }


def _cached(identity: dict, source: Path) -> TwinChoice | None:
    """The cached choice; a cached copy only while it is the file that was checked."""
    record = read_cache(identity)
    if record is None or not isinstance(record.get("why"), str):
        return None
    if not record.get("use_twin"):
        return TwinChoice(source, record["why"])
    twin = twin_path(source)
    if not twin.is_file() or _stamp(twin) != record.get("twin"):
        return None  # lost or changed since: checked and timed again
    return TwinChoice(twin, record["why"])


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _decide(identity: dict, source: Path, width: int, threads: int, flash_attn: bool) -> TwinChoice:
    """Check, time and cache; a failure (disk full, a read-only cache, a copy llama.cpp will
    not load) keeps the file, uncached, so the next start tries again."""
    try:
        twin, checks = checked_twin(source, threads)
        if twin is None:
            why = f"bf16 matrices as stored: {checks}"
            write_cache(identity, {"use_twin": False, "why": why})
            return TwinChoice(source, why)
        timed = time_files(source, twin, width, threads, flash_attn)
    except Exception as exc:  # anything at all: the file as stored still serves
        return TwinChoice(source, f"bf16 matrices as stored: no float16 copy ({exc})")
    src, f16 = timed["source"], timed["twin"]
    figures = (
        f"prefill {PREFILL_TOKENS} tokens {f16['prefill_ms']:.0f} vs {src['prefill_ms']:.0f} ms, "
        f"{width}-wide decode {f16['decode_ms']:.1f} vs {src['decode_ms']:.1f} ms"
    )
    use = twin_wins(timed)
    why = (
        f"bf16 file served from its exact float16 copy ({checks}; {figures})"
        if use
        else f"bf16 matrices as stored (the float16 copy ran no faster: {figures})"
    )
    write_cache(identity, {"use_twin": use, "why": why, "timed": timed, "twin": _stamp(twin)})
    return TwinChoice(twin if use else source, why)
