"""KV slot pool: which slot holds which tokens, and prefix-cache reuse across requests.

A slot is one sequence's worth of static KV in the executor. A finished (or preempted) request
leaves its tokens in the slot as a cached prefix, evicted least-recently-used when slots run out.
Content is identified by chained sha256 hashes of full blocks, salted with the tenant id, so a
prefix can only be reused by the tenant that computed it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from ultrafast.core.types import KVCopy

DEFAULT_BLOCK_SIZE = 16  # tokens per hashed block: the granularity of prefix matches


def block_hashes(token_ids: list[int], tenant: str, block_size: int,
                 start: list[bytes] | None = None) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, continuing from `start` if given."""
    hashes = list(start or [])
    prev = hashes[-1] if hashes else hashlib.sha256(b"ultrafast-kv:" + tenant.encode()).digest()
    for begin in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block = token_ids[begin:begin + block_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_size}q", *block)).digest()
        hashes.append(prev)
    return hashes


def _common_prefix(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Slot:
    slot_id: int
    owner: str | None = None  # request id while running; None when free or cached
    hashes: list[bytes] = field(default_factory=list)  # full blocks whose KV is computed here
    last_used: int = 0  # pool clock at release, for LRU eviction


@dataclass
class SlotAllocation:
    slot_id: int
    num_cached_tokens: int  # KV positions already valid in the slot after `copy`
    copy: KVCopy | None  # a prefix copied from a slot that another request still runs in


class KVSlotPool:
    """Hands out slots; never touches tensors (the executor does, told by StepPlan.kv_copies)."""

    def __init__(self, num_slots: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.block_size = block_size
        self.slots = [Slot(i) for i in range(num_slots)]
        self._clock = 0
        self.num_prefix_queries = 0  # requests looked up
        self.num_prefix_hit_tokens = 0  # prompt tokens served from cache
        self.num_prefix_query_tokens = 0  # tokens looked up (the hit rate's denominator)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_running(self) -> int:
        return sum(s.owner is not None for s in self.slots)

    @property
    def num_available(self) -> int:
        """Slots a new request could take (empty or holding an evictable cached prefix)."""
        return self.num_slots - self.num_running

    def allocate(self, request_id: str, token_ids: list[int], tenant: str) -> SlotAllocation | None:
        """A slot for a request about to compute `token_ids`, reusing the longest cached prefix.

        At least one token is always left to compute, so the request gets logits to sample from.
        Returns None when every slot is running.
        """
        wanted = block_hashes(token_ids[:len(token_ids) - 1], tenant, self.block_size)
        best_idle, best_idle_len, best_busy, best_busy_len = None, 0, None, 0
        for slot in self.slots:
            n = _common_prefix(slot.hashes, wanted)
            if slot.owner is None and n > best_idle_len:
                best_idle, best_idle_len = slot, n
            elif slot.owner is not None and n > best_busy_len:
                best_busy, best_busy_len = slot, n
        copy = None
        if best_idle is not None and best_idle_len >= best_busy_len:
            slot, num_blocks = best_idle, best_idle_len  # reuse in place, no copy
        else:
            slot = best_idle or self._pick_victim()
            if slot is None:
                return None
            num_blocks = best_busy_len
            if best_busy is not None and num_blocks:
                copy = KVCopy(best_busy.slot_id, slot.slot_id, num_blocks * self.block_size)
        slot.owner = request_id
        slot.hashes = wanted[:num_blocks]
        num_cached = num_blocks * self.block_size
        self.num_prefix_queries += 1
        self.num_prefix_query_tokens += max(len(token_ids) - 1, 0)
        self.num_prefix_hit_tokens += num_cached
        return SlotAllocation(slot.slot_id, num_cached, copy)

    def num_cached_prefix_tokens(self, token_ids: list[int], tenant: str) -> int:
        """Read-only, for admission's TTFT estimate: how many leading tokens some slot holds
        now (a conversation's next turn: nearly all). The engine may still evict them first."""
        wanted = block_hashes(token_ids[:len(token_ids) - 1], tenant, self.block_size)
        return max((_common_prefix(s.hashes, wanted) for s in self.slots),
                   default=0) * self.block_size

    def _pick_victim(self) -> Slot | None:
        """An empty slot first, else the least recently used cached one."""
        idle = [s for s in self.slots if s.owner is None]
        if not idle:
            return None
        return min(idle, key=lambda s: (bool(s.hashes), s.last_used))

    def commit(self, slot_id: int, token_ids: list[int], num_computed: int, tenant: str) -> None:
        """Record that the first `num_computed` tokens' KV now lives in the slot."""
        slot = self.slots[slot_id]
        if (len(slot.hashes) + 1) * self.block_size <= num_computed:
            slot.hashes = block_hashes(token_ids[:num_computed], tenant, self.block_size, slot.hashes)

    def release(self, slot_id: int, keep_cached: bool = True) -> None:
        """The owner is done; its computed prefix stays reusable unless `keep_cached` is False."""
        slot = self.slots[slot_id]
        slot.owner = None
        self._clock += 1
        slot.last_used = self._clock
        if not keep_cached:
            slot.hashes = []

    def reset_cache(self) -> None:
        for slot in self.slots:
            if slot.owner is None:
                slot.hashes = []
