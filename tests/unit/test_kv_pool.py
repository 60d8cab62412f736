"""KV slot pool: prefix matching by salted block hashes, LRU eviction, copies from busy slots."""

from ultrafast.core.kv_pool import KVSlotPool, block_hashes


def test_hashes_are_chained_and_salted_by_tenant():
    a = block_hashes(list(range(40)), "t1", 16)
    assert len(a) == 2
    assert block_hashes(list(range(40)), "t2", 16) != a
    assert block_hashes([99] + list(range(1, 40)), "t1", 16)[1] != a[1]  # chained
    assert block_hashes(list(range(40)), "t1", 16, start=a[:1]) == a


def test_reuse_in_place_then_lru_eviction():
    pool = KVSlotPool(2, block_size=4)
    tokens = list(range(10))
    first = pool.allocate("a", tokens, "")
    pool.commit(first.slot_id, tokens, 10, "")
    pool.release(first.slot_id)
    again = pool.allocate("b", tokens, "")
    assert again.slot_id == first.slot_id and again.num_cached_tokens == 8 and again.copy is None
    pool.release(again.slot_id)
    other = pool.allocate("c", [50, 51, 52, 53, 54], "")
    assert other.slot_id != first.slot_id  # the empty slot goes before the cached one
    pool.commit(other.slot_id, [50, 51, 52, 53, 54], 5, "")
    pool.release(other.slot_id)
    third = pool.allocate("d", [70] * 9, "")
    assert third.slot_id == first.slot_id  # least recently used cached slot is evicted
    assert third.num_cached_tokens == 0


def test_at_least_one_token_is_left_to_compute():
    pool = KVSlotPool(1, block_size=4)
    tokens = list(range(8))
    alloc = pool.allocate("a", tokens, "")
    pool.commit(alloc.slot_id, tokens, 8, "")
    pool.release(alloc.slot_id)
    assert pool.allocate("b", tokens, "").num_cached_tokens == 4


def test_busy_slot_prefix_is_copied_and_full_pool_returns_none():
    pool = KVSlotPool(2, block_size=4)
    tokens = list(range(12))
    busy = pool.allocate("a", tokens, "")
    pool.commit(busy.slot_id, tokens, 12, "")
    alloc = pool.allocate("b", tokens + [1], "")
    assert alloc.copy is not None and alloc.copy.src_slot_id == busy.slot_id
    assert alloc.copy.num_tokens == 12 and alloc.num_cached_tokens == 12
    assert pool.allocate("c", [1, 2], "") is None
