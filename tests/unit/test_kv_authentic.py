"""KV blobs must be authentic, not only intact (issue 29 item 7): every L3 blob carries an
HMAC-SHA256 under the server secret; a forged blob (payload changed, checksum recomputed as
the old writer did), one from a server with another secret, and one refused later through
the host tier are deleted from every tier, and the turn recomputes the right answer."""

from __future__ import annotations

import hashlib
import stat

from tests.unit.test_kvcache_tiers import _conversations, _engine, _turn
from ultrafast.kvcache import blob, secret
from ultrafast.kvcache.redis_tier import KEY_PREFIX


def _forge(data: bytes) -> bytes:
    """The findings note's method: change bytes in the back half of the KV payload, then
    recompute the sha256 trailer the way the version-1 writer did."""
    body = bytearray(data[:-32])
    back = len(body) - 40  # the fake executor's payload is the held token ids (int32)
    for k in range(back, len(body), 4):
        body[k] ^= 0x01  # another token id
    return bytes(body) + hashlib.sha256(bytes(body)).digest()


def test_a_forged_disk_blob_is_refused_deleted_and_recomputed(tmp_path):
    first = _engine(disk_dir=str(tmp_path))
    history, _ = _conversations(first, num_convs=1, num_turns=1)
    first.close()
    (path,) = tmp_path.glob("*.kv")
    path.write_bytes(_forge(path.read_bytes()))
    second = _engine(disk_dir=str(tmp_path))
    _, cached = _turn(second, "after", history[0])  # asserts the output is still right
    assert cached == 0
    assert second.kv_cache.stats.refusals["signature"] == 1
    second.close()
    assert not path.exists()  # deleted, not read again by every later turn


def test_a_blob_from_a_server_with_another_secret_is_refused(tmp_path):
    first = _engine(disk_dir=str(tmp_path / "kv"), secret_file=str(tmp_path / "a"))
    history, _ = _conversations(first, num_convs=1, num_turns=1)
    first.close()
    (path,) = (tmp_path / "kv").glob("*.kv")
    second = _engine(disk_dir=str(tmp_path / "kv"), secret_file=str(tmp_path / "b"))
    _, cached = _turn(second, "after", history[0])
    assert cached == 0 and second.kv_cache.stats.refusals["signature"] == 1
    second.close()
    assert not path.exists()


def test_replicas_sharing_the_secret_file_restore_each_others_blobs(tmp_path):
    shared = str(tmp_path / "secret")
    first = _engine(disk_dir=str(tmp_path / "kv"), secret_file=shared)
    history, _ = _conversations(first, num_convs=1, num_turns=1)
    first.close()
    second = _engine(disk_dir=str(tmp_path / "kv"), secret_file=shared)
    _, cached = _turn(second, "after", history[0])
    assert cached >= 40 and not second.kv_cache.stats.refusals
    second.close()


def test_a_blob_refused_through_the_host_tier_is_deleted_everywhere(tmp_path):
    """Another conversation's (genuinely signed) blob copied under this conversation's key
    passes the MAC, lands in L2 and is refused there (its tokens differ from the prompt): it
    must leave the disk too, or every later turn fetches it again."""
    first = _engine(disk_dir=str(tmp_path))
    history, _ = _conversations(first, num_convs=2, num_turns=1)
    first.close()
    key, fp = first.kv_cache.secret, first.kv_cache.fingerprint

    def holds_mine(path) -> bool:
        token_ids, _ = blob.unpack(path.read_bytes(), fp, "", key)
        return history[0][: len(token_ids)] == token_ids

    mine, other = sorted(tmp_path.glob("*.kv"), key=lambda p: not holds_mine(p))
    assert holds_mine(mine) and not holds_mine(other)
    mine.write_bytes(other.read_bytes())
    second = _engine(disk_dir=str(tmp_path))
    _, cached = _turn(second, "after", history[0])
    assert cached == 0 and second.kv_cache.stats.refusals["tokens"] == 1
    second.close()
    assert not mine.exists()
    assert other.exists()  # the other conversation's own blob stays


def test_a_forged_redis_blob_is_refused_and_deleted(redis_server, tmp_path):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    first = _engine(redis_url=redis_server.url)
    history, _ = _conversations(first, num_convs=1, num_turns=1)
    first.close()
    (key,) = client.keys(KEY_PREFIX + "*")
    client.set(key, _forge(client.get(key)))
    second = _engine(redis_url=redis_server.url)
    _, cached = _turn(second, "after", history[0])
    assert cached == 0 and second.kv_cache.stats.refusals["signature"] == 1
    second.close()
    assert not client.exists(key)
    client.close()


def test_the_secret_is_created_private_and_kept(tmp_path):
    path = tmp_path / "state" / "kv-secret"
    key = secret.load_or_create(path)
    assert len(key) == secret.SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert secret.load_or_create(path) == key  # a restart reads the same secret
    framed = blob.pack("f" * 32, "t", [1], b"\0\0\0\1", key)
    assert blob.unpack(framed, "f" * 32, "t", key) == ([1], b"\0\0\0\1")


def test_a_secret_file_that_holds_no_secret_is_a_clear_error(tmp_path):
    import pytest

    bad = tmp_path / "kv-secret"
    bad.write_text("not hex")
    with pytest.raises(ValueError, match="does not hold a secret"):
        secret.load_or_create(bad)


def test_disk_blobs_are_created_private(tmp_path):
    engine = _engine(disk_dir=str(tmp_path / "kv"))
    _conversations(engine, num_convs=1, num_turns=1)
    engine.close()
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    files = list((tmp_path / "kv").glob("*.kv"))
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
