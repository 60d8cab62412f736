"""The server secret that signs KV blobs (blob.py: HMAC-SHA256), so a blob is imported only
when a server holding the same secret wrote it.

The secret is 32 random bytes, kept hex-encoded in a file created 0600 in a 0700 directory
(by default `kv-secret` in the data dir). The first start creates it; replicas of a cluster
that share KV through Redis (or a shared disk) must read the same file (`--kv-secret-file`),
else each refuses the others' blobs (and deletes them: they recompute). Creation is atomic
(written under a temporary name, then hard-linked into place), so replicas starting together
agree on one secret.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from ultrafast.config import data_dir

log = logging.getLogger(__name__)

SECRET_BYTES = 32
DEFAULT_NAME = "kv-secret"


def default_secret_path() -> Path:
    return data_dir() / DEFAULT_NAME


def private_dir(path: Path) -> None:
    """Create `path` (and parents) 0700 when missing; an existing directory keeps its mode."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)


def load_or_create(path: str | Path | None = None) -> bytes:
    """The secret in `path` (default: the data dir's), created on first use.
    ValueError with a clear message when it cannot be read or is not a secret."""
    path = Path(path) if path is not None else default_secret_path()
    try:
        if not path.exists():
            _create(path)
        text = path.read_text(encoding="ascii").strip()
        mode = stat.S_IMODE(path.stat().st_mode)
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"KV secret file {path}: {exc}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(
            f"KV secret file {path} does not hold a secret (at least 32 hex digits expected)"
        )
    if mode & 0o077:
        log.warning("KV secret file %s is readable by others (mode %o): chmod 600 it", path, mode)
    return key


def _create(path: Path) -> None:
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process created it first: theirs stands
        log.info("created the KV secret %s", path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
