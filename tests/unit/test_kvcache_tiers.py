"""The tiered KV cache on the fake executor (its "KV" is the slot's token list, so a wrong
import changes the output tokens): blob framing, L2/L3 tiers, write-back, write-through,
restore after a restart, and refusal of corrupt, truncated and foreign blobs."""

from __future__ import annotations

import errno
import os

import pytest

from tests.unit.engine_driver import prompt, run_all
from ultrafast.core.scheduler import SchedulerConfig
from ultrafast.engine.core import EngineCore
from ultrafast.executors.fake_exec import FakeExecutor, reference_tokens
from ultrafast.kvcache import blob
from ultrafast.kvcache.disk import DiskTier
from ultrafast.kvcache.host import HostEntry, HostTier
from ultrafast.kvcache.manager import KVCacheConfig
from ultrafast.request import Request, SamplingParams

FP = "f" * 32
KEY = b"k" * 32


def test_blob_round_trip_and_refusals():
    framed = blob.pack(FP, "alice", [1, 2, 3], b"payload", KEY)
    assert blob.unpack(framed, FP, "alice", KEY) == ([1, 2, 3], b"payload")
    cases = {
        "truncated": framed[:-5],
        "checksum": framed[:20] + bytes([framed[20] ^ 1]) + framed[21:],
        "magic": b"XXXX" + framed[4:],
        "tiny": framed[:10],
    }
    for name, bad in cases.items():
        with pytest.raises(blob.BlobRefused):
            blob.unpack(bad, FP, "alice", KEY)
        assert name
    with pytest.raises(blob.BlobRefused, match="fingerprint"):
        blob.unpack(framed, "0" * 32, "alice", KEY)
    with pytest.raises(blob.BlobRefused, match="tenant"):
        blob.unpack(framed, FP, "bob", KEY)
    with pytest.raises(blob.BlobRefused, match="signature"):
        blob.unpack(framed, FP, "alice", b"another secret")


def test_host_tier_keeps_the_byte_budget_lru():
    host = HostTier(budget_bytes=100)
    for i in range(5):
        assert host.put(f"k{i}", HostEntry("t", [], b"x" * 30))
        host.get("k0")  # k0 stays recently used
    assert host.stats.bytes_held <= 100
    assert host.contains("k0") and host.contains("k4") and not host.contains("k1")
    assert not host.put("big", HostEntry("t", [], b"x" * 101))


def test_host_tier_finds_an_entry_by_an_earlier_block_until_it_goes():
    host = HostTier(budget_bytes=100)
    old = HostEntry("t", [1], b"o" * 30)
    new = HostEntry("t", [1, 2], b"n" * 30)
    host.put("b1", old)
    host.put("b2", new, aliases=["b1x", "b0"])
    assert host.get("b0") is new and host.contains("b1x") and host.get("b1") is old
    newest = HostEntry("t", [1, 2, 3], b"z" * 30)
    host.put("b3", newest, aliases=["b0"])  # the newest entry takes the shared block over
    assert host.get("b0") is newest
    host.delete("b2")
    assert not host.contains("b1x") and host.get("b0") is newest
    host.delete("b0")  # through the alias: the entry it names
    assert not host.contains("b3") and not host.contains("b0")
    assert host.stats.bytes_held == old.nbytes
    for i in range(4):  # LRU evictions take their aliases along
        host.put(f"e{i}", HostEntry("t", [], b"x" * 40), aliases=[f"e{i}-a"])
    assert not host.contains("e0-a") and host.contains("e3-a")


def test_disk_tier_survives_a_restart_and_keeps_its_budget(tmp_path):
    disk = DiskTier(tmp_path, budget_bytes=250)
    keys = [f"{i:032x}" for i in range(4)]
    for key in keys:
        assert disk.put(key, b"y" * 100)
    assert disk.stats.bytes_held <= 250 and disk.stats.num_evictions == 2
    (tmp_path / "leftover.kv.123.tmp").write_bytes(b"half")
    again = DiskTier(tmp_path, budget_bytes=250)  # a restarted server
    assert again.get(keys[3]) == b"y" * 100 and again.longest(keys) == keys[3]
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError):
        again.put("../escape", b"z")


def test_disk_tier_full_disk_degrades_and_recovers(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, budget_bytes=1 << 20)
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert not disk.put("a" * 32, b"data")
    assert disk.stats.degraded and disk.stats.num_errors == 1
    assert not list(tmp_path.iterdir())  # no half-written file
    monkeypatch.setattr(os, "fsync", real_fsync)
    disk._failures._down_until = 0.0  # the retry pause is over
    assert disk.put("a" * 32, b"data") and not disk.stats.degraded


def _engine(num_slots=2, **kv) -> EngineCore:
    """The fake executor recomputes in microseconds: restores are never skipped as slower
    unless a test asks (they would be, by the measured costs)."""
    executor = FakeExecutor(num_slots=num_slots, max_model_len=512, keep_plans=False)
    config = SchedulerConfig(max_num_seqs=num_slots, max_model_len=512)
    kv.setdefault("skip_slower_restores", False)
    return EngineCore(executor, config, kv_cache=KVCacheConfig(**kv))


def _turn(engine, rid, tokens, n=6):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    cached = {}

    def run():
        engine.add_request(Request(rid, list(tokens), params))
        out, finish = [], None
        while engine.has_work():
            for o in engine.step():
                out.extend(o.new_token_ids)
                if o.finished:
                    finish, cached[rid] = o.finish_reason, o.num_cached_tokens
        return out, finish

    out, finish = run()
    assert finish == "length"
    assert out == reference_tokens(list(tokens), n), "a restored slot changed the output"
    return out, cached[rid]


def _conversations(engine, num_convs, num_turns, first_len=40):
    history = {c: prompt(c + 1, first_len) for c in range(num_convs)}
    cached_by_turn = []
    for turn in range(num_turns):
        for c in range(num_convs):
            out, cached = _turn(engine, f"c{c}t{turn}", history[c])
            if turn:
                cached_by_turn.append(cached)
            history[c] = history[c] + out + prompt(100 + c * 10 + turn, 5)
    return history, cached_by_turn


def test_host_tier_keeps_more_conversations_warm_than_slots():
    engine = _engine(num_slots=2, host_bytes=1 << 20)
    _, cached = _conversations(engine, num_convs=5, num_turns=3)
    stats = engine.kv_cache.stats
    assert stats.num_write_backs > 0 and stats.num_restores > 0
    assert all(c >= 40 for c in cached)  # every later turn reused its history
    assert stats.hit_tokens["host"] > 0


def test_a_restore_reuses_a_saved_slot_up_to_where_the_next_prompt_parts():
    """The next prompt re-tokenizes the answer differently in the saved slot's last block:
    the blocks before it still come from L2 (not from scratch, not an older entry)."""
    engine = _engine(num_slots=1, host_bytes=1 << 20)
    first = prompt(1, 60)
    out, _ = _turn(engine, "a1", first)  # the slot holds 65 tokens: 4 full blocks
    _turn(engine, "b1", prompt(2, 40))  # a's KV goes to L2
    parted = (first + out)[:50] + prompt(3, 30)  # parts inside the 4th block
    assert parted[50] != (first + out)[50]
    _, cached = _turn(engine, "a2", parted)
    assert cached == 50
    assert engine.kv_cache.stats.num_restores == 1


def test_admission_estimate_counts_a_prefix_in_host_memory():
    engine = _engine(num_slots=1, host_bytes=1 << 20)
    history, _ = _conversations(engine, num_convs=2, num_turns=1)
    # conversation 0's slot went to conversation 1: its KV is in L2 only now
    assert engine.pool.num_cached_prefix_tokens(history[0], "") == 0
    assert engine.cached_prefix_tokens(history[0], "") >= 32
    assert engine.cached_prefix_tokens(history[0], "other-tenant") == 0


def test_a_restore_slower_than_recompute_is_skipped():
    engine = _engine(num_slots=2, host_bytes=1 << 20, skip_slower_restores=True)
    engine.kv_cache._restore_bytes_per_s = 1.0  # as if imports crawled
    engine.costs.observe(1, 10, 0.010)  # a measured recompute rate, whatever this machine's
    engine.costs.observe(1, 100, 0.100)  # timing of the fake steps lets the fit say
    _conversations(engine, num_convs=5, num_turns=2)  # outputs still checked per turn
    assert engine.kv_cache.stats.num_skipped_slower > 0


def test_without_tiers_the_same_load_recomputes():
    engine = _engine(num_slots=2)
    assert engine.kv_cache is None
    _, cached = _conversations(engine, num_convs=5, num_turns=2)
    assert min(cached) == 0


def test_disk_tier_restores_after_a_restart(tmp_path):
    first = _engine(disk_dir=str(tmp_path))
    history, _ = _conversations(first, num_convs=3, num_turns=1)
    first.close()  # as a kill -9 after the turn: the write-through already happened
    second = _engine(disk_dir=str(tmp_path))
    for c in range(3):
        _, cached = _turn(second, f"after{c}", history[c])
        assert cached >= 40
    assert second.kv_cache.stats.hit_tokens["disk"] > 0
    assert second.kv_cache.stats.num_fetch_waits == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other_tenant"])
def test_a_damaged_disk_blob_recomputes(tmp_path, damage):
    first = _engine(disk_dir=str(tmp_path))
    history, _ = _conversations(first, num_convs=1, num_turns=1)
    first.close()
    for path in tmp_path.glob("*.kv"):
        data = path.read_bytes()
        if damage == "flip":
            data = data[:60] + bytes([data[60] ^ 0xFF]) + data[61:]
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:
            key = first.kv_cache.secret
            token_ids, payload = blob.unpack(data, first.kv_cache.fingerprint, "", key)
            if damage == "foreign":
                data = blob.pack("0" * 32, "", token_ids, payload, key)
            else:
                data = blob.pack(first.kv_cache.fingerprint, "eve", token_ids, payload, key)
        path.write_bytes(data)
    second = _engine(disk_dir=str(tmp_path))
    _, cached = _turn(second, "after", history[0])  # asserts the output is still right
    assert cached == 0
    assert sum(second.kv_cache.stats.refusals.values()) >= 1
    second.close()  # the new turn's write-through (a worker thread) has landed by now
    for path in tmp_path.glob("*.kv"):  # the refused blob is gone: what is left is sound
        blob.unpack(path.read_bytes(), second.kv_cache.fingerprint, "", second.kv_cache.secret)


def test_abort_while_waiting_for_an_l3_read(tmp_path):
    first = _engine(disk_dir=str(tmp_path))
    history, _ = _conversations(first, num_convs=1, num_turns=1)
    first.close()
    second = _engine(disk_dir=str(tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs, finish = run_all(second, [Request("r", list(history[0]), params)], abort_at={0: "r"})
    assert finish == {"r": "abort"} and not second.has_work()


def test_bad_kv_flags_are_clear_errors(tmp_path):
    from ultrafast.config import EngineConfig

    with pytest.raises(ValueError, match="redis://"):
        EngineConfig(model="m", kv_store="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="kv_host_cache_gb"):
        EngineConfig(model="m", kv_host_cache_gb=-1)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="KV disk directory"):
        _engine(disk_dir=str(blocker / "kv"))


def test_metrics_snapshot_names_every_tier(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from ultrafast.server.kv_metrics import KVCacheCollector

    engine = _engine(num_slots=2, host_bytes=1 << 20, disk_dir=str(tmp_path))
    _conversations(engine, num_convs=4, num_turns=2)
    snap = engine.kv_cache.snapshot()
    assert snap.hit_tokens["L2"] > 0 and snap.hit_tokens["L1"] >= 0
    assert set(snap.evictions) == {"L1", "L2", "L3_disk"} and snap.evictions["L1"] > 0
    assert snap.bytes_saved > 0 and snap.bytes_restored > 0
    registry = CollectorRegistry()
    registry.register(KVCacheCollector(engine.kv_cache.snapshot))
    text = generate_latest(registry).decode()
    assert 'ultrafast_kv_tier_hit_tokens_total{tier="L2"}' in text
    assert "ultrafast_kv_restore_seconds_count" in text
    engine.close()


def test_disk_tier_whose_directory_is_replaced_by_a_file(tmp_path):
    disk = DiskTier(tmp_path / "kv", budget_bytes=1 << 20)
    assert disk.put("b" * 32, b"data")
    (tmp_path / "kv").rename(tmp_path / "gone")
    (tmp_path / "kv").write_text("not a directory")
    assert not disk.put("c" * 32, b"more")  # refused, counted, never raised
    assert disk.get("b" * 32) is None
    assert disk.stats.degraded and disk.stats.num_errors >= 1
