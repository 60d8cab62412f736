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
    # two full blocks, then token by token: 9 of the 10 (one is left to compute)
    assert again.slot_id == first.slot_id and again.num_cached_tokens == 9 and again.copy is None
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
    assert pool.allocate("b", tokens, "").num_cached_tokens == 7


def test_busy_slot_prefix_is_copied_and_full_pool_returns_none():
    pool = KVSlotPool(2, block_size=4)
    tokens = list(range(12))
    busy = pool.allocate("a", tokens, "")
    pool.commit(busy.slot_id, tokens, 12, "")
    alloc = pool.allocate("b", tokens + [1], "")
    assert alloc.copy is not None and alloc.copy.src_slot_id == busy.slot_id
    assert alloc.copy.num_tokens == 12 and alloc.num_cached_tokens == 12
    assert pool.allocate("c", [1, 2], "") is None


def _computed_and_released(
    pool: KVSlotPool, request_id: str, tokens: list[int], tenant: str
) -> int:
    """A request that computed all of `tokens` and finished: its slot id (now cached)."""
    alloc = pool.allocate(request_id, tokens, tenant)
    pool.commit(alloc.slot_id, tokens, len(tokens), tenant)
    pool.release(alloc.slot_id)
    return alloc.slot_id


def test_in_place_reuse_extends_the_block_match_to_the_exact_token():
    """A conversation's next turn: its prompt repeats the slot's computed tokens, then parts
    inside a block. Reuse stops at the first differing token, not at the block boundary."""
    pool = KVSlotPool(2, block_size=4)
    turn1 = list(range(10))  # two full blocks + 2 tokens, all computed
    slot_id = _computed_and_released(pool, "a", turn1, "t")
    turn2 = turn1 + [90, 91, 92, 93]
    again = pool.allocate("b", turn2, "t")
    assert again.slot_id == slot_id and again.num_cached_tokens == 10
    assert pool.slots[again.slot_id].hashes == block_hashes(turn1[:8], "t", 4)
    pool.commit(again.slot_id, turn2, 14, "t")
    pool.release(again.slot_id)
    parted = turn2[:9] + [55, 56, 57]  # differs at token 9, inside the third block
    assert pool.num_cached_prefix_tokens(parted, "t") == 9
    assert pool.allocate("c", parted, "t").num_cached_tokens == 9


def test_token_level_reuse_is_per_tenant():
    pool = KVSlotPool(1, block_size=4)
    tokens = list(range(10))
    _computed_and_released(pool, "a", tokens, "t1")
    assert pool.num_cached_prefix_tokens(tokens + [1], "t2") == 0
    assert pool.allocate("b", tokens + [1], "t2").num_cached_tokens == 0
    # and a slot whose first block differs is never compared token by token
    pool.release(0)
    assert pool.allocate("c", [99] + tokens[1:] + [1], "t2").num_cached_tokens == 0


def test_a_request_sharing_only_a_short_prefix_copies_it_and_keeps_the_long_slot():
    """Conversation A's history sits in slot 0; a new conversation shares only its first block
    (a system prompt). It gets the empty slot with that block copied there, so A's next turn
    still finds all of its history."""
    pool = KVSlotPool(2, block_size=4)
    history = list(range(30))
    slot_id = _computed_and_released(pool, "a", history, "t")
    other = pool.allocate("b", history[:4] + [77] * 10, "t")
    assert other.slot_id != slot_id and other.num_cached_tokens == 4
    assert other.copy is not None and other.copy.src_slot_id == slot_id
    assert other.copy.dst_slot_id == other.slot_id and other.copy.num_tokens == 4
    pool.release(other.slot_id)
    nxt = pool.allocate("a2", history + [5, 6], "t")
    assert nxt.slot_id == slot_id and nxt.num_cached_tokens == 30 and nxt.copy is None


def test_a_continuation_or_a_small_edit_reuses_the_slot_in_place():
    pool = KVSlotPool(2, block_size=4)
    history = list(range(30))
    slot_id = _computed_and_released(pool, "a", history, "t")
    edited = history[:26] + [90, 91]  # the last answer regenerated: loses 4, shares 26
    again = pool.allocate("b", edited, "t")
    assert again.slot_id == slot_id and again.copy is None
    assert again.num_cached_tokens == 26


def _fill(pool: KVSlotPool, request_id: str, first_token: int) -> int:
    tokens = list(range(first_token, first_token + 8))
    alloc = pool.allocate(request_id, tokens, "")
    pool.commit(alloc.slot_id, tokens, 8, "")
    return alloc.slot_id


def test_new_requests_land_next_to_running_ones():
    """The ggml executor runs consecutive slots in one forward pass: a fresh request takes the
    hole between two running slots, then a slot beside the run, before a distant empty one."""
    pool = KVSlotPool(8, block_size=4)
    slots = [_fill(pool, f"r{i}", 100 * i) for i in range(4)]
    assert slots == [0, 1, 2, 3]  # an empty pool fills in order
    pool.release(1)  # slot 1 now holds a cached prefix between two running slots
    assert pool.allocate("hole", [7] * 9, "").slot_id == 1
    pool.release(3)  # the run is now 0-2; slot 3 cached beside it, 4-7 empty
    assert pool.allocate("beside", [8] * 9, "").slot_id == 3


def test_locality_never_takes_a_running_slot_and_falls_back_to_lru():
    pool = KVSlotPool(4, block_size=4)
    for i in range(4):
        _fill(pool, f"r{i}", 100 * i)
    for slot in (3, 0):  # 3 released first: least recently used
        pool.release(slot)
    pool.release(1)
    pool.release(2)
    # nothing runs: no neighbour counts, so plain LRU among cached slots
    assert pool.allocate("x", [9] * 9, "").slot_id == 3
    assert pool.allocate("y", [9, 8] * 5, "").slot_id == 2  # beside x, although 0 is older
    assert pool.allocate("z", [6] * 9, "").slot_id == 1
    assert pool.allocate("w", [5] * 9, "").slot_id == 0
    assert pool.allocate("none left", [4] * 9, "") is None


def test_requests_that_barely_decode_stay_away_from_the_lasting_run():
    """A burst of one-token calls among long generations: the short ones take slots away from
    the long ones, so the long ones stay consecutive (one forward pass) after the short ones
    leave, instead of being split by the holes they leave."""
    pool = KVSlotPool(8, block_size=4)
    first = pool.allocate("long-0", [1] * 9, "").slot_id
    short = pool.allocate("short-0", [2] * 9, "", lasting=False).slot_id
    second = pool.allocate("long-1", [3] * 9, "").slot_id
    short_again = pool.allocate("short-1", [4] * 9, "", lasting=False).slot_id
    third = pool.allocate("long-2", [5] * 9, "").slot_id
    assert [first, second, third] == [0, 1, 2]  # one run of lasting slots
    assert [short, short_again] == [7, 6]  # from the other end of the pool
    # the short ones never count as neighbours for a lasting request
    pool.release(second)
    pool.release(short)
    assert pool.allocate("long-3", [6] * 9, "").slot_id == second  # the hole in the run


def test_a_cached_prefix_apart_from_the_run_is_copied_beside_it():
    """A lasting request whose prefix is cached in a slot away from the running ones gets a
    slot beside them and a copy of the prefix (one run: one ggml pass, a view of torch's KV
    mirror), and the cached slot keeps its prefix; beside the run, or for a request that
    barely decodes, the prefix is reused in place."""
    pool = KVSlotPool(8, block_size=4)
    shared = list(range(40, 52))
    cached = _computed_and_released(pool, "warm", shared, "")  # slot 0
    for i in range(5):  # move the run away: slots 1-5 running
        _fill(pool, f"r{i}", 100 * (i + 1))
    pool.release(1)  # the run is 2-5 now: slot 0 is apart from it
    alloc = pool.allocate("new", shared + [7, 8], "")
    assert alloc.slot_id in (1, 6) and alloc.copy is not None  # beside the run
    assert alloc.copy.src_slot_id == cached and alloc.copy.dst_slot_id == alloc.slot_id
    assert alloc.num_cached_tokens == 12 and alloc.copy.num_tokens == 12
    assert pool.slots[cached].hashes  # the cached prefix is still there for the next request
    short = pool.allocate("short", shared + [9], "", lasting=False)
    assert short.slot_id == cached and short.copy is None  # barely decodes: in place


def test_a_cached_prefix_beside_the_run_is_reused_in_place():
    pool = KVSlotPool(8, block_size=4)
    shared = list(range(40, 52))
    cached = _computed_and_released(pool, "warm", shared, "")  # slot 0
    _fill(pool, "r0", 100)  # slot 1 runs, beside slot 0
    alloc = pool.allocate("new", shared + [7], "")
    assert alloc.slot_id == cached and alloc.copy is None
