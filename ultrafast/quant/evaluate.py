"""Perplexity on held-out text, for a torch model and for a GGUF file (llama.cpp's logits).

The held-out text is what the demo models were evaluated on (models/README.md): the Python
standard library of this interpreter, files split by a hash of their relative path, about 2%
held out; each file is encoded and followed by <|endoftext|>. Calibration text for the hybrid
policy comes from the training side of the same split, so it never overlaps the held-out set.
Perplexity is computed as the training script does: non-overlapping windows of `seq_len`
tokens, each predicted from a fresh context, every position scored.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ultrafast.corpus import stdlib_split
from ultrafast.model.attention import SeqSpan, SlotKVCache


def _read_texts(paths: list[Path], max_chars: int | None = None) -> list[str]:
    texts, total = [], 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return texts


def _encode(tokenizer_dir: Path, texts: list[str]) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        if eos is not None:
            ids.append(eos)
    return ids


def text_file_ids(tokenizer_dir: Path, path: str | Path) -> list[int]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {path} does not exist")
    return _encode(tokenizer_dir, [path.read_text(encoding="utf-8", errors="replace")])


def heldout_ids(tokenizer_dir: Path, text_file: str | Path | None = None) -> list[int]:
    if text_file is not None:
        return text_file_ids(tokenizer_dir, text_file)
    return _encode(tokenizer_dir, _read_texts(stdlib_split()[1]))


def model_heldout_ids(model: str | Path, text_file: str | Path | None = None) -> list[int]:
    """Held-out ids for any model path. With a tokenizer.json, as `heldout_ids`; a GGUF alone
    is encoded by its own metadata's tokenizer (llama.cpp's ids), each text followed by the
    model's end-of-sequence token."""
    from ultrafast.model_files import load_tokenizer, resolve_model

    files = resolve_model(model)
    if files.tokenizer_gguf is None:
        return heldout_ids(files.tokenizer_dir, text_file)
    if text_file is not None and not Path(text_file).is_file():
        raise FileNotFoundError(f"text file {text_file} does not exist")
    if text_file is not None:
        texts = [Path(text_file).read_text(encoding="utf-8", errors="replace")]
    else:
        texts = _read_texts(stdlib_split()[1])
    tokenizer = load_tokenizer(files)
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False) + end)
    return ids


def calibration_ids(
    tokenizer_dir: Path, num_tokens: int, text_file: str | Path | None = None
) -> list[int]:
    """`num_tokens` of calibration text: the given file, else training-side stdlib files."""
    if text_file is not None:
        ids = text_file_ids(tokenizer_dir, text_file)
    else:
        train = stdlib_split()[0]
        # every 7th file: a spread of modules instead of the alphabetically first few
        ids = _encode(tokenizer_dir, _read_texts(train[::7], max_chars=8 * num_tokens))
    if len(ids) < 2:
        raise ValueError("calibration text is empty")
    return ids[: num_tokens + 1]


def windows(ids: list[int], seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and their next tokens)."""
    limit = len(ids) if not max_tokens else min(len(ids), max_tokens + 1)
    out = [ids[b : b + seq_len + 1] for b in range(0, limit - seq_len, seq_len)]
    if not out and limit >= 2:  # shorter than one window: score what there is
        out = [ids[:limit]]
    return out


@torch.inference_mode()
def torch_nll(model, token_windows: list[list[int]]) -> tuple[float, int]:
    """(summed negative log-likelihood, number of scored tokens) of our torch model."""
    config = model.config
    weight = model.model.embed_tokens.weight
    max_len = max(len(w) for w in token_windows)
    if model.max_positions < max_len:
        model.set_max_positions(max_len)
    kv = SlotKVCache(
        config.num_hidden_layers,
        1,
        max_len,
        config.num_key_value_heads,
        config.head_dim,
        weight.dtype,
        weight.device,
        config.layer_sliding_windows,
    )
    total_nll, total = 0.0, 0
    for window in token_windows:
        x = torch.tensor(window, dtype=torch.long, device=weight.device)
        n = x.numel() - 1
        attn = kv.begin_step([SeqSpan(0, 0, n)])
        hidden = model(x[:-1], torch.arange(n, device=weight.device), attn)
        logits = model.compute_logits(hidden)
        total_nll += torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum").item()
        total += n
    return total_nll, total


def torch_perplexity(
    model, ids: list[int], seq_len: int = 256, max_tokens: int | None = None
) -> tuple[float, int]:
    nll, count = torch_nll(model, windows(ids, seq_len, max_tokens))
    return math.exp(nll / count), count


def gguf_perplexity(
    gguf_path: str | Path,
    ids: list[int],
    seq_len: int = 256,
    max_tokens: int | None = None,
    n_threads: int | None = None,
    flash_attn: bool = False,
) -> tuple[float, int]:
    """Perplexity from llama.cpp's logits (llama-cpp-python's `Llama`, every position scored;
    `flash_attn` as our engine runs it, for a parity of the same computation)."""
    from ultrafast.executors.llama_cpp_params import open_llama

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    token_windows = windows(ids, seq_len, max_tokens)
    n_ctx = max(len(w) for w in token_windows)
    llm = open_llama(
        str(gguf_path),
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        verbose=False,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        flash_attn=flash_attn,
    )
    total_nll, total = 0.0, 0
    try:
        for window in token_windows:
            n = len(window) - 1
            llm.reset()
            llm.eval(window[:-1])
            logits = np.asarray(llm.scores[:n], dtype=np.float64)
            logits -= logits.max(axis=1, keepdims=True)
            log_z = np.log(np.exp(logits).sum(axis=1))
            targets = np.asarray(window[1:])
            total_nll += float((log_z - logits[np.arange(n), targets]).sum())
            total += n
    finally:
        llm.close()
    return math.exp(total_nll / total), total
