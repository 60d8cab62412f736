"""The framing of one exported slot: fingerprint, tenant, token ids, executor payload, MAC.

    b"UFKV" | u16 version | u16 header length | header (JSON) | i32 token ids | payload | mac

The header names the fingerprint, the tenant digest, the token count and the payload length;
the trailing HMAC-SHA256 under the server secret (secret.py) covers everything before it, so
a truncated or flipped blob, and one whose bytes were changed by whoever can write the disk
directory or Redis (a plain checksum they could recompute), or one a server with another
secret wrote, is refused before any byte reaches the executor. `unpack` refuses with a reason
(BlobRefused), never returns a payload it could not check. Version 1 blobs (a bare sha256,
unsigned) are refused like any other unauthenticated blob: those turns recompute once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import numpy as np

MAGIC = b"UFKV"
VERSION = 2
_PREFIX = struct.Struct("<4sHH")
_DIGEST_LEN = 32


class BlobRefused(ValueError):
    """A blob that must not be imported: the reason says why (the turn then recomputes)."""


def tenant_digest(tenant: str) -> str:
    return hashlib.sha256(b"ultrafast-kv-tenant:" + tenant.encode()).hexdigest()[:16]


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


def pack(fingerprint: str, tenant: str, token_ids: list[int], payload: bytes, key: bytes) -> bytes:
    header = json.dumps(
        {
            "fingerprint": fingerprint,
            "tenant": tenant_digest(tenant),
            "num_tokens": len(token_ids),
            "payload_len": len(payload),
        },
        separators=(",", ":"),
    ).encode()
    body = b"".join(
        (
            _PREFIX.pack(MAGIC, VERSION, len(header)),
            header,
            np.asarray(token_ids, dtype=np.int32).tobytes(),
            payload,
        )
    )
    return body + _mac(key, body)


def unpack(blob: bytes, fingerprint: str, tenant: str, key: bytes) -> tuple[list[int], bytes]:
    """(token ids, payload) of a blob signed with `key` under `fingerprint` for `tenant`, else
    BlobRefused."""
    if len(blob) < _PREFIX.size + _DIGEST_LEN:
        raise BlobRefused(f"blob of {len(blob)} bytes is truncated")
    magic, version, header_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise BlobRefused("not an ultrafast KV blob (bad magic)")
    if version != VERSION:
        raise BlobRefused(f"blob layout version {version}, this server reads {VERSION}")
    body, digest = blob[:-_DIGEST_LEN], blob[-_DIGEST_LEN:]
    if not hmac.compare_digest(_mac(key, body), digest):
        raise BlobRefused(
            "blob signature mismatch (corrupt, truncated, altered, or made by a server with "
            "another KV secret)"
        )
    start = _PREFIX.size
    try:
        header = json.loads(body[start : start + header_len])
        num_tokens, payload_len = int(header["num_tokens"]), int(header["payload_len"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BlobRefused(f"blob header unreadable: {exc}") from None
    if header.get("fingerprint") != fingerprint:
        raise BlobRefused("blob was made for another model, KV type or executor (fingerprint)")
    if header.get("tenant") != tenant_digest(tenant):
        raise BlobRefused("blob belongs to another tenant")
    ids_start = start + header_len
    ids_end = ids_start + 4 * num_tokens
    if num_tokens < 0 or payload_len < 0 or ids_end + payload_len != len(body):
        raise BlobRefused("blob lengths do not add up")
    token_ids = np.frombuffer(body[ids_start:ids_end], dtype=np.int32).tolist()
    return token_ids, body[ids_end:]
