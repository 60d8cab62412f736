"""`num_cached_prefix_tokens`: admission's read-only view of what a new request would reuse."""

from ultrafast.core.kv_pool import KVSlotPool


def test_peek_sees_a_released_conversation_prefix_for_its_tenant_only():
    pool = KVSlotPool(num_slots=2, block_size=4)
    turn1 = list(range(100, 111))  # 11 tokens: 10 computed, 2 full blocks and 2 tokens
    alloc = pool.allocate("r1", turn1, "tenant-a")
    pool.commit(alloc.slot_id, turn1, 10, "tenant-a")
    pool.release(alloc.slot_id)
    turn2 = turn1 + [7, 8, 9, 10, 11]
    assert pool.num_cached_prefix_tokens(turn2, "tenant-a") == 10
    assert pool.num_cached_prefix_tokens(turn2, "tenant-b") == 0  # salted per tenant
    assert pool.num_cached_prefix_tokens([1, 2, 3, 4, 5, 6], "tenant-a") == 0
    # a peek changes nothing: the real allocation then reuses exactly that much
    assert pool.allocate("r2", turn2, "tenant-a").num_cached_tokens == 10
