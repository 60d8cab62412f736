"""Read a GGUF file's metadata (key/values and tensor table) without loading its weights.

Why our own reader: a GGUF from the internet may be truncated or corrupt, and each such file must
give one clear error naming the file and what is wrong before llama.cpp touches it. This reader
bounds-checks every length against the file size (a corrupt count cannot make it allocate), checks
that every tensor's data lies inside the file, and reads only the header (the vocabulary of a
50k-token model parses in well under a second).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ultrafast.model.config import ModelLoadError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# value type -> (struct format, size); 8 = string, 9 = array
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
_ARRAY_DTYPES = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}


class _Truncated(Exception):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class GgufMetadata:
    path: Path
    version: int
    fields: dict = field(repr=False)
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    data_offset: int = 0  # where the tensor data section starts (TensorInfo.offset counts from it)

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.fields.get("general.architecture", ""))

    def arch_value(self, name: str, default=None):
        """`<arch>.<name>`, e.g. arch_value("context_length")."""
        return self.fields.get(f"{self.architecture}.{name}", default)


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated()
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt: str, n: int):
        return struct.unpack_from(fmt, self.buf, self.take(n))[0]

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        start = self.take(n)
        # llama.cpp keeps raw bytes; a token that is not valid UTF-8 still needs a stable key
        return bytes(self.buf[start : start + n]).decode("utf-8", errors="surrogateescape")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: `string()` with the cursor in locals (a vocabulary's
        100k strings at every start: 0.26 s of the default model's header before)."""
        buf, size, pos = self.buf, self.size, self.pos
        length = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                raise _Truncated()
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > size:
                raise _Truncated()
            append(bytes(buf[pos : pos + n]).decode("utf-8", errors="surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(*_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar("<I", 4)
            count = self.scalar("<Q", 8)
            if etype in _ARRAY_DTYPES:
                width = _SCALARS[etype][1]
                start = self.take(count * width)
                raw = bytes(self.buf[start : start + count * width])
                return list(struct.unpack(f"<{count}{_ARRAY_DTYPES[etype]}", raw))
            if etype == _STRING:
                if count * 8 > self.size - self.pos:
                    raise _Truncated()
                return self.strings(count)
            if etype == _ARRAY:
                if count > self.size - self.pos:
                    raise _Truncated()
                return [self.value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown array element type {etype}")
        raise ValueError(f"unknown value type {vtype}")


def tensor_nbytes(info: TensorInfo) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {info.name!r} has unknown ggml type {info.ggml_type}") from None
    count = 1
    for dim in info.shape:
        count *= dim
    return count // block * type_size


def _parse(path: Path, buf, size: int) -> GgufMetadata:
    cur = _Cursor(buf, size)
    if size < 4 or bytes(buf[0:4]) != _MAGIC:
        raise ValueError("not a GGUF file (it does not start with the GGUF magic bytes)")
    cur.take(4)
    version = cur.scalar("<I", 4)
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q", 8), cur.scalar("<Q", 8)
    if n_tensors > size or n_kv > size:
        raise ValueError(f"corrupt header ({n_tensors} tensors, {n_kv} keys)")
    fields: dict = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I", 4))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I", 4)
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} claims {n_dims} dimensions")
        shape = tuple(cur.scalar("<Q", 8) for _ in range(n_dims))
        tensors.append(TensorInfo(name, shape, cur.scalar("<I", 4), cur.scalar("<Q", 8)))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"bad general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment
    for info in tensors:
        end = data_start + info.offset + tensor_nbytes(info)
        if end > size:
            raise _Truncated()
    return GgufMetadata(path, version, fields, tuple(tensors), data_start)


@lru_cache(maxsize=16)
def _read_cached(path: Path, size: int, mtime_ns: int) -> GgufMetadata:
    with open(path, "rb") as f:
        if size == 0:
            raise ValueError("the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(path, buf, size)


def read_gguf_metadata(path: str | Path) -> GgufMetadata:
    """Parse `path`'s header; any defect is a ModelLoadError that names the file."""
    path = Path(path).expanduser()
    try:
        stat = path.stat()
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc.strerror or exc}") from None
    try:
        return _read_cached(path.resolve(), stat.st_size, stat.st_mtime_ns)
    except _Truncated:
        raise ModelLoadError(
            f"{path} is truncated (the file ends before its header or tensor "
            "data does); download it again"
        ) from None
    except (
        ValueError,
        struct.error,
        OverflowError,
        UnicodeError,
        MemoryError,
        RecursionError,
    ) as exc:
        raise ModelLoadError(f"{path} is not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc.strerror or exc}") from None
