"""KV slot pool: which slot holds which tokens, and prefix-cache reuse across requests.

A slot is one sequence's worth of static KV in the executor. A finished (or preempted) request
leaves its tokens in the slot as a cached prefix, evicted least-recently-used when slots run out.
Content is identified by chained sha256 hashes of full blocks, salted with the tenant id, so a
prefix can only be reused by the tenant that computed it. A slot also keeps the ids of the
tokens it has computed: a request that takes a slot in place (a conversation's next turn)
extends the block match token by token, so it reuses the KV up to the exact token where the
texts part rather than up to the last block boundary. Tokens are only compared after at least
one salted block matched, and for the same tenant.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from ultrafast.core.types import KVCopy

DEFAULT_BLOCK_SIZE = 16  # tokens per hashed block: the granularity of prefix matches


def block_hashes(
    token_ids: list[int], tenant: str, block_size: int, start: list[bytes] | None = None
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, continuing from `start` if given."""
    hashes = list(start or [])
    prev = hashes[-1] if hashes else hashlib.sha256(b"ultrafast-kv:" + tenant.encode()).digest()
    for begin in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block = token_ids[begin : begin + block_size]
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
    token_ids: list[int] = field(default_factory=list)  # its first num_computed have KV here
    num_computed: int = 0
    tenant: str | None = None  # whose tokens these are
    last_used: int = 0  # pool clock at release, for LRU eviction
    lasting: bool = True  # its running owner will decode for a while (see allocate)


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
        # the tiered KV cache (kvcache/manager.py) saves a cached slot here before its tokens
        # are overwritten (write-back); called while its KV is still intact
        self.on_evict: Callable[[Slot], None] | None = None

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

    def allocate(
        self,
        request_id: str,
        token_ids: list[int],
        tenant: str,
        reuse_prefix: bool = True,
        lasting: bool = True,
    ) -> SlotAllocation | None:
        """A slot for a request about to compute `token_ids`, reusing the longest cached prefix.

        At least one token is always left to compute, so the request gets logits to sample from.
        `reuse_prefix` False computes every token (a cached position has no logits to score the
        prompt with). `lasting` False: the request will decode a few tokens at most, so a slot
        with no cached prefix to reuse is taken away from the requests that will (_pick_victim).
        Returns None when every slot is running.
        """
        if not reuse_prefix:
            slot = self._pick_victim(lasting=lasting)
            if slot is None:
                return None
            self._evicting(slot)
            slot.owner, slot.hashes, slot.token_ids = request_id, [], token_ids
            slot.num_computed, slot.tenant, slot.lasting = 0, tenant, lasting
            return SlotAllocation(slot.slot_id, 0, None)
        wanted = block_hashes(token_ids[: len(token_ids) - 1], tenant, self.block_size)
        best_idle, best_idle_len, best_busy, best_busy_len = None, 0, None, 0
        for slot in self.slots:
            n = _common_prefix(slot.hashes, wanted)
            if slot.owner is None and n > best_idle_len:
                best_idle, best_idle_len = slot, n
            elif slot.owner is not None and n > best_busy_len:
                best_busy, best_busy_len = slot, n
        copy, num_extra = None, 0
        if best_idle is not None and best_idle_len >= best_busy_len:
            slot, num_blocks = best_idle, best_idle_len  # reuse in place, no copy
            num_extra = self._tokens_past_blocks(slot, num_blocks, token_ids, tenant)
            num_matched = num_blocks * self.block_size + num_extra
            # in place, the slot's tokens past the match are overwritten. When that is more
            # than the request shares (a new conversation that only shares a conversation's
            # system prompt) and more than another slot holds, copy the shared prefix there
            # and keep the conversation's KV warm for its next turn
            num_lost = slot.num_computed - num_matched
            victim = (
                self._pick_victim(exclude=slot, lasting=lasting) if num_lost > num_matched else None
            )
            moved = self._slot_beside_run(slot, lasting) if victim is None else None
            if moved is not None:  # copy the prefix next to the run rather than split it
                copy = KVCopy(slot.slot_id, moved.slot_id, num_matched)
                slot = moved
                self._evicting(moved)
            elif victim is not None and victim.num_computed < num_lost:
                copy = KVCopy(slot.slot_id, victim.slot_id, num_matched)
                slot = victim
                self._evicting(victim)
            elif num_lost >= self.block_size:
                self._evicting(slot)
        else:
            slot = best_idle or self._pick_victim(lasting=lasting)
            if slot is None:
                return None
            self._evicting(slot)
            num_blocks = best_busy_len
            if best_busy is not None and num_blocks:
                copy = KVCopy(best_busy.slot_id, slot.slot_id, num_blocks * self.block_size)
        slot.owner, slot.lasting = request_id, lasting
        slot.hashes = wanted[:num_blocks]
        num_cached = num_blocks * self.block_size + num_extra
        slot.token_ids, slot.num_computed, slot.tenant = token_ids, num_cached, tenant
        self.num_prefix_queries += 1
        self.num_prefix_query_tokens += max(len(token_ids) - 1, 0)
        self.num_prefix_hit_tokens += num_cached
        return SlotAllocation(slot.slot_id, num_cached, copy)

    def _tokens_past_blocks(
        self, slot: Slot, num_blocks: int, token_ids: list[int], tenant: str
    ) -> int:
        """How many more tokens of `token_ids`, after `num_blocks` matched blocks, the slot has
        computed (fewer than a block: the next block's hash did not match or is incomplete).
        Leaves at least one token of `token_ids` to compute."""
        if not num_blocks or slot.tenant != tenant:
            return 0
        begin = num_blocks * self.block_size
        n = 0
        for cached, wanted in zip(
            slot.token_ids[begin : slot.num_computed], token_ids[begin : len(token_ids) - 1]
        ):
            if cached != wanted:
                break
            n += 1
        return n

    def prefix_hashes(self, token_ids: list[int], tenant: str) -> list[bytes]:
        """The block hashes a prefix lookup compares (pure: any thread may compute them)."""
        return block_hashes(token_ids[: len(token_ids) - 1], tenant, self.block_size)

    def num_cached_prefix_tokens(
        self, token_ids: list[int], tenant: str, wanted: list[bytes] | None = None
    ) -> int:
        """Read-only, for admission's TTFT estimate: how many leading tokens some slot holds
        now (a conversation's next turn: nearly all). The engine may still evict them first.
        `wanted`: `prefix_hashes(token_ids, tenant)`, if the caller computed them already."""
        if wanted is None:
            wanted = self.prefix_hashes(token_ids, tenant)
        best = 0
        for slot in self.slots:
            n = _common_prefix(slot.hashes, wanted)
            if slot.owner is None:  # a running slot's tokens past its blocks are still moving
                n = n * self.block_size + self._tokens_past_blocks(slot, n, token_ids, tenant)
            else:
                n *= self.block_size
            best = max(best, n)
        return best

    def _slot_beside_run(self, cached: Slot, lasting: bool) -> Slot | None:
        """For a lasting request whose prefix sits in `cached`, away from the running lasting
        slots: an idle slot beside them to copy the prefix into, or None (reuse in place). The
        copy costs the prefix's KV once; a slot apart from the run costs every step of the
        request's life a pass of its own (ggml) or a gather of its KV (torch decode steps), and
        `cached` keeps its prefix for the next request."""
        if not lasting or self._beside_lasting(cached):
            return None
        if not any(s.owner is not None and s.lasting for s in self.slots):
            return None
        near = self._pick_victim(exclude=cached, lasting=True)
        return near if near is not None and self._beside_lasting(near) else None

    def _beside_lasting(self, slot: Slot) -> bool:
        return self._lasting_neighbours(slot) > 0

    def _lasting_neighbours(self, slot: Slot) -> int:
        """How many of the slot's two neighbours run a lasting request."""
        i, slots = slot.slot_id, self.slots
        return sum(
            0 <= j < len(slots) and slots[j].owner is not None and slots[j].lasting
            for j in (i - 1, i + 1)
        )

    def _pick_victim(self, exclude: Slot | None = None, lasting: bool = True) -> Slot | None:
        """A slot next to running lasting ones first (two such neighbours before one), then an
        empty slot before a cached one, then the least recently used, then the lowest slot. For
        a request that will not last (`lasting` False): away from the lasting ones first, and
        from the top of the pool down, so the lasting run has room to grow.

        Neighbours first because the ggml executor runs sequences in one forward pass only
        while their slots are consecutive: a request placed away from the others costs every
        step one more pass for as long as it runs, dearer than a cached prefix it evicts. A
        request that decodes a token or two (a burst of one-token calls) barely shares those
        passes, yet beside the lasting ones it takes the slots that keep them in one run and,
        once gone, leaves holes that split it."""
        slots = self.slots
        idle = [s for s in slots if s.owner is None and s is not exclude]
        if not idle:
            return None
        sign = -1 if lasting else 1

        def key(s: Slot) -> tuple[int, bool, int, int]:
            return (
                sign * self._lasting_neighbours(s),
                bool(s.hashes),
                s.last_used,
                -sign * s.slot_id,
            )

        return min(idle, key=key)

    def _evicting(self, slot: Slot) -> None:
        if self.on_evict is not None and slot.owner is None and slot.hashes:
            self.on_evict(slot)

    @property
    def clock(self) -> int:
        """Advances at every release: a slot with `last_used` above a reading was released
        since (the tiered KV cache's write-through)."""
        return self._clock

    def restore_target(self) -> Slot | None:
        """An idle slot to import a saved prefix into (its own tokens are written back)."""
        slot = self._pick_victim()
        if slot is not None:
            self._evicting(slot)
        return slot

    def install(self, slot_id: int, token_ids: list[int], tenant: str, hashes: list[bytes]) -> None:
        """An idle slot now holds the KV of `token_ids` (restored from a lower tier), or
        nothing (a failed import); it counts as the most recently used cached prefix."""
        slot = self.slots[slot_id]
        slot.hashes, slot.token_ids, slot.num_computed = hashes, token_ids, len(token_ids)
        slot.tenant = tenant
        self._clock += 1
        slot.last_used = self._clock

    def commit(self, slot_id: int, token_ids: list[int], num_computed: int, tenant: str) -> None:
        """Record that the first `num_computed` tokens' KV now lives in the slot."""
        slot = self.slots[slot_id]
        if (len(slot.hashes) + 1) * self.block_size <= num_computed:
            slot.hashes = block_hashes(
                token_ids[:num_computed], tenant, self.block_size, slot.hashes
            )
        slot.token_ids, slot.num_computed, slot.tenant = token_ids, num_computed, tenant

    def release(self, slot_id: int, keep_cached: bool = True) -> None:
        """The owner is done; its computed prefix stays reusable unless `keep_cached` is False."""
        slot = self.slots[slot_id]
        slot.owner = None
        self._clock += 1
        slot.last_used = self._clock
        if not keep_cached:
            slot.hashes, slot.token_ids, slot.num_computed = [], [], 0

    def reset_cache(self) -> None:
        for slot in self.slots:
            if slot.owner is None:
                slot.hashes, slot.token_ids, slot.num_computed = [], [], 0
