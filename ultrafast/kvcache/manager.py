"""The tiered KV cache under the slot pool: L1 slots -> L2 host memory -> L3 disk and/or Redis.

Keys are the slot pool's tenant-salted block-hash chain: a saved slot of n tokens is stored
under the hash of its last full block, so a prompt finds the longest saved prefix by walking
its own chain backwards. The blob (or host entry) also carries the exact token ids and the
tenant, compared before any import: a hash collision or a foreign blob recomputes instead.

- write-back: a cached slot about to be overwritten is exported first (KVSlotPool.on_evict)
- write-through: with a persistent tier, every released slot is saved after its turn, so a
  crash or `kill -9` loses at most the turn in flight
- restore: before a schedule, a waiting request whose prompt has a longer prefix in L2 than
  any slot holds gets it imported into an idle slot; the scheduler then reuses it in place
- L3 fetch: a request whose prefix is only in L3 is held out of the queue while a worker
  thread reads it into L2 (the engine never waits on disk or Redis)

A blob read from L3 must carry the HMAC of this server's secret (blob.py, secret.py); a blob
refused for any reason (forged, foreign, another tenant's, tokens that differ from the prompt,
an import the executor rejects) is deleted from every tier, so no later turn reads it again.

The executor calls (export/import) run on the engine thread between steps; framing, MACs
and all disk/Redis I/O run on the worker threads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ultrafast.core.kv_pool import block_hashes
from ultrafast.kvcache import blob, secret
from ultrafast.kvcache.host import HostEntry, HostTier
from ultrafast.kvcache.tiers import KVTier

if TYPE_CHECKING:
    from ultrafast.core.kv_pool import KVSlotPool, Slot
    from ultrafast.core.scheduler import Scheduler
    from ultrafast.request import Request

log = logging.getLogger(__name__)

STAGING_HOST_BYTES = 256 << 20  # L2 used as the landing area of L3 reads when no budget is set
RESTORE_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class KVCacheConfig:
    host_bytes: int = 0  # L2 budget; 0 = no L2 of its own (a staging area if L3 is set)
    disk_dir: str | None = None  # L3 on disk
    disk_bytes: int = 10 << 30
    redis_url: str | None = None  # L3 in Redis (redis://127.0.0.1:PORT)
    redis_ttl_s: int = 86400
    redis_ca_file: str | None = None  # verifies a rediss:// server (redis_conn.py)
    secret_file: str | None = None  # the KV secret (secret.py); None = kv-secret in the data dir
    fetch_timeout_s: float = 5.0  # a request waits at most this long for its L3 read
    skip_slower_restores: bool = True  # False: restore even when recomputing looks faster

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_dir or self.redis_url)


@dataclass
class KVCacheStats:
    """Cumulative counters for server/metrics.py (read from the event loop: may be a step old)."""

    hit_tokens: Counter = field(default_factory=Counter)  # tier -> prompt tokens restored
    num_restores: int = 0
    num_saves: int = 0  # exports (write-back + write-through)
    num_write_backs: int = 0  # evictions that needed an export (not saved already)
    num_slot_evictions: int = 0  # cached slots overwritten by another prefix (L1 evictions)
    bytes_saved: int = 0  # exported payload bytes
    bytes_restored: int = 0
    restore_latency_buckets: list[int] = field(
        default_factory=lambda: [0] * (len(RESTORE_LATENCY_BUCKETS_S) + 1)
    )
    restore_latency_sum_s: float = 0.0
    refusals: Counter = field(default_factory=Counter)  # reason -> blobs refused
    num_skipped_slower: int = 0  # restores skipped: predicted slower than recompute
    num_fetch_waits: int = 0  # requests held for an L3 read
    num_fetch_timeouts: int = 0

    def observe_restore(self, seconds: float) -> None:
        self.restore_latency_sum_s += seconds
        index = next(
            (i for i, b in enumerate(RESTORE_LATENCY_BUCKETS_S) if seconds <= b),
            len(RESTORE_LATENCY_BUCKETS_S),
        )
        self.restore_latency_buckets[index] += 1


REFUSAL_LABELS = (
    "signature",
    "checksum",
    "truncated",
    "fingerprint",
    "tenant",
    "version",
    "executor",
    "tokens",
)


def refusal_label(reason: str) -> str:
    """A bounded metrics label for a refusal reason."""
    for label in REFUSAL_LABELS:
        if label in reason:
            return label
    return "other"


@dataclass(frozen=True)
class KVCacheSnapshot:
    """Copies of the counters, for a scrape on another thread."""

    hit_tokens: dict[str, int]  # "L1", "L2", "L3_disk", "L3_redis"
    evictions: dict[str, int]  # same tiers: L1 = cached slots written back
    bytes_held: dict[str, int]  # "L2", "L3_disk"
    budget_bytes: dict[str, int]
    errors: dict[str, int]
    degraded: dict[str, bool]
    bytes_saved: int
    bytes_restored: int
    restore_latency_buckets: list[int]
    restore_latency_sum_s: float
    refusals: dict[str, int]
    num_skipped_slower: int
    num_fetch_waits: int
    num_fetch_timeouts: int


def build_tiers(config: KVCacheConfig) -> tuple[HostTier, list[KVTier]]:
    persistent: list[KVTier] = []
    if config.disk_dir:
        from ultrafast.kvcache.disk import DiskTier

        try:
            persistent.append(DiskTier(config.disk_dir, config.disk_bytes))
        except OSError as exc:  # a clear start-up error, not a traceback
            raise ValueError(f"KV disk directory {config.disk_dir}: {exc}") from None
    if config.redis_url:
        from ultrafast.kvcache.redis_tier import RedisTier

        persistent.append(RedisTier(config.redis_url, config.redis_ttl_s, config.redis_ca_file))
    host_bytes = config.host_bytes or (STAGING_HOST_BYTES if persistent else 0)
    return HostTier(host_bytes), persistent


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, executor: Any, pool: KVSlotPool):
        self.config = config
        self.executor = executor
        self.pool = pool
        self.fingerprint: str = executor.kv_fingerprint()
        self.host, self.persistent = build_tiers(config)
        # signs and checks every L3 blob; ValueError (a start-up error) if it cannot be read
        self.secret = secret.load_or_create(config.secret_file) if self.persistent else b""
        self.stats = KVCacheStats()
        self._io = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-io")
        self._writes: set[concurrent.futures.Future] = set()
        self._writes_lock = threading.Lock()
        self._held: dict[str, tuple[Request, concurrent.futures.Future, float]] = {}
        # waiting request -> L2 puts when it was looked up: it is looked up again only after
        # L2 got something new
        self._tried: dict[str, int] = {}
        self._saved: dict[int, tuple[str, int]] = {}  # slot -> (key, tokens) last saved
        self._restore_bytes_per_s = 500e6  # learnt from imports; sizes the skip test
        pool.on_evict = self._write_back

    # ---- keys ----------------------------------------------------------------------------

    def key(self, chain_hash: bytes) -> str:
        return f"{self.fingerprint}-{chain_hash.hex()}"

    def _host_best(self, wanted: list[bytes], above: int) -> int:
        """Most blocks of `wanted` (> above) whose key L2 holds, else 0."""
        for n in range(len(wanted), above, -1):
            if self.host.contains(self.key(wanted[n - 1])):
                return n
        return 0

    def host_prefix_tokens(self, wanted: list[bytes]) -> int:
        """Tokens (block-aligned) of the longest prefix L2 holds: admission's estimate (any
        thread; the entry may still be evicted or refused before the restore)."""
        return self._host_best(wanted, 0) * self.pool.block_size

    # ---- saving (engine thread) ------------------------------------------------------------

    def _save(self, slot: Slot) -> None:
        """Export the slot's cached tokens into L2 now and into L3 on a worker."""
        n = slot.num_computed
        if not slot.hashes or slot.tenant is None or n < 1:
            return
        key = self.key(slot.hashes[-1])
        if self._saved.get(slot.slot_id) == (key, n) and self.host.contains(key):
            return
        try:
            payload = self.executor.export_slot(slot.slot_id, n)
        except Exception:  # a failed save costs a recompute later, never the step
            log.exception("KV export of slot %d failed", slot.slot_id)
            return
        entry = HostEntry(blob.tenant_digest(slot.tenant), list(slot.token_ids[:n]), payload)
        self.host.put(key, entry, [self.key(h) for h in slot.hashes[:-1]])
        self._saved[slot.slot_id] = (key, n)
        self.stats.num_saves += 1
        self.stats.bytes_saved += len(payload)
        if self.persistent:
            self._submit_write(self._write_l3, key, slot.tenant, entry)

    def _submit_write(self, fn: Any, *args: Any) -> None:
        """An L3 write or delete on a worker (flush() waits for it)."""
        future = self._io.submit(fn, *args)
        with self._writes_lock:
            self._writes.add(future)
        future.add_done_callback(self._write_done)

    def _write_done(self, future: concurrent.futures.Future) -> None:
        with self._writes_lock:
            self._writes.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.error("KV write failed unexpectedly", exc_info=future.exception())

    def _write_l3(self, key: str, tenant: str, entry: HostEntry) -> None:
        framed = blob.pack(self.fingerprint, tenant, entry.token_ids, entry.payload, self.secret)
        for tier in self.persistent:
            tier.put(key, framed)  # a failure is counted and logged by the tier

    def _write_back(self, slot: Slot) -> None:
        """KVSlotPool.on_evict: the slot's tokens are about to be overwritten."""
        before = self.stats.num_saves
        self.stats.num_slot_evictions += 1
        self._save(slot)
        self.stats.num_write_backs += self.stats.num_saves - before

    def after_update(self, released_since_clock: int) -> None:
        """Write-through: save every slot released in this step (a persistent tier only)."""
        if not self.persistent:
            return
        for slot in self.pool.slots:
            if slot.owner is None and slot.last_used > released_since_clock:
                self._save(slot)

    # ---- L3 fetch (request arrival, engine thread; I/O on a worker) ---------------------------

    def hold_for_fetch(self, request: Request, scheduler: Scheduler) -> None:
        """Take a just-queued request out of the queue while L3 is read for its prefix."""
        if not self.persistent:
            return
        tokens, tenant = request.all_token_ids, request.tenant
        wanted = self.pool.prefix_hashes(tokens, tenant)
        have = self.pool.num_cached_prefix_tokens(tokens, tenant, wanted) // self.pool.block_size
        have = max(have, self._host_best(wanted, have))
        if have >= len(wanted):
            return
        keys = [self.key(h) for h in wanted[have:]]
        if not any(tier.name == "redis" for tier in self.persistent):
            if all(tier.longest(keys) is None for tier in self.persistent):
                return  # the disk index answers without I/O
        future = self._io.submit(self._fetch, keys, tenant)
        queue = scheduler.waiting[request.tier]
        queue.remove(request)
        deadline = time.monotonic() + self.config.fetch_timeout_s
        self._held[request.request_id] = (request, future, deadline)
        self.stats.num_fetch_waits += 1

    def _fetch(self, keys: list[str], tenant: str) -> None:
        """Worker: the longest of `keys` any L3 tier holds, checked, into L2."""
        found = [(tier, tier.longest(keys)) for tier in self.persistent]
        for tier, key in sorted(
            ((t, k) for t, k in found if k is not None), key=lambda tk: -keys.index(tk[1])
        ):
            framed = tier.get(key)
            if framed is None:
                continue
            try:
                token_ids, payload = blob.unpack(framed, self.fingerprint, tenant, self.secret)
            except blob.BlobRefused as exc:
                self._refuse(str(exc), key, tier)
                continue
            entry = HostEntry(blob.tenant_digest(tenant), token_ids, payload, origin=tier.name)
            hashes = block_hashes(token_ids, tenant, self.pool.block_size)
            self.host.put(key, entry, [self.key(h) for h in hashes[:-1]])
            return

    def _refuse(self, reason: str, key: str, tier: Any) -> None:
        """Count and log a refused blob and delete it from every tier (L2 now, L3 on a worker:
        this may be the engine thread), so no later fetch reads it again."""
        log.warning("KV blob %s in %s refused: %s; the turn recomputes", key, tier.name, reason)
        self.stats.refusals[refusal_label(reason)] += 1
        key = self.host.resolve(key)  # an alias names the entry's own key
        self.host.delete(key)
        if self.persistent:
            self._submit_write(self._delete_l3, key)

    def _delete_l3(self, key: str) -> None:
        for tier in self.persistent:
            tier.delete(key)  # a failure is counted and logged by the tier

    def has_held(self) -> bool:
        return bool(self._held)

    def before_schedule(self, scheduler: Scheduler, per_token_s: float | None) -> None:
        """The engine's one call before a schedule (pool lock held): requests whose read
        finished go back in line, then the next in line get their host-memory prefixes."""
        self.release_held(scheduler)
        self.restore_waiting(scheduler, per_token_s)

    def release_held(self, scheduler: Scheduler) -> None:
        """Requeue held requests whose read finished (or timed out); drop aborted ones."""
        if not self._held:
            return
        if not scheduler.has_work():  # nothing else to run: wait a moment instead of spinning
            futures = [f for _, f, _ in self._held.values()]
            concurrent.futures.wait(futures, 0.005, concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        for request_id, (request, future, deadline) in list(self._held.items()):
            if not future.done() and now < deadline:
                continue
            del self._held[request_id]
            if scheduler.requests.get(request_id) is not request:
                continue  # aborted while it waited
            if not future.done():
                self.stats.num_fetch_timeouts += 1
                log.warning("KV read for %s timed out; it recomputes", request_id)
            scheduler.enqueue(request)

    # ---- restore (engine thread, before a schedule) ----------------------------------------

    def restore_waiting(self, scheduler: Scheduler, per_token_s: float | None) -> None:
        """Import L2 prefixes for the requests next in line, while idle slots exist."""
        budget = self.pool.num_available
        if budget == 0:
            return
        for queue in scheduler.waiting.values():
            for request in list(queue)[:budget]:
                generation = self.host.stats.num_puts
                if self._tried.get(request.request_id) == generation:
                    continue
                if len(self._tried) > 10_000:
                    self._tried.clear()
                self._tried[request.request_id] = generation
                self._restore(request, per_token_s)

    def _restore(self, request: Request, per_token_s: float | None) -> None:
        tokens, tenant = request.all_token_ids, request.tenant
        wanted = self.pool.prefix_hashes(tokens, tenant)
        have = self.pool.num_cached_prefix_tokens(tokens, tenant, wanted)
        num_blocks = self._host_best(wanted, have // self.pool.block_size)
        if not num_blocks:
            return
        key = self.key(wanted[num_blocks - 1])
        entry = self.host.get(key)
        if entry is None:
            return
        if entry.tenant != blob.tenant_digest(tenant):
            self._refuse("blob belongs to another tenant", key, self.host)
            return
        n = 0  # positions the entry shares with the prompt (at least one token is left)
        for cached, wanted_id in zip(entry.token_ids, tokens[: len(tokens) - 1]):
            if cached != wanted_id:
                break
            n += 1
        if n < num_blocks * self.pool.block_size:
            self._refuse("blob tokens differ from the prompt", key, self.host)
            return
        if n <= have:
            return
        restore_s = len(entry.payload) / self._restore_bytes_per_s
        slower = per_token_s is not None and restore_s > (n - have) * per_token_s
        if slower and self.config.skip_slower_restores:
            self.stats.num_skipped_slower += 1
            return
        victim = self.pool.restore_target()
        if victim is None:
            return
        started = time.perf_counter()
        try:
            self.executor.import_slot(victim.slot_id, entry.payload, n)
        except ValueError as exc:
            self.pool.install(victim.slot_id, [], tenant, [])
            self._saved.pop(victim.slot_id, None)
            self._refuse(f"executor refused the KV: {exc}", key, self.host)
            return
        seconds = time.perf_counter() - started
        self.pool.install(victim.slot_id, tokens[:n], tenant, wanted[: n // self.pool.block_size])
        full = n == len(entry.token_ids) and n % self.pool.block_size == 0
        self._saved[victim.slot_id] = (key, n) if full else ("", 0)
        if seconds > 0:
            rate = len(entry.payload) / seconds
            self._restore_bytes_per_s = 0.8 * self._restore_bytes_per_s + 0.2 * rate
        self.stats.num_restores += 1
        self.stats.hit_tokens[entry.origin] += n
        entry.origin = "host"
        self.stats.bytes_restored += len(entry.payload)
        self.stats.observe_restore(seconds)

    def snapshot(self) -> KVCacheSnapshot:
        stats = self.stats
        restored = sum(stats.hit_tokens.values())
        hits = {"L1": max(0, self.pool.num_prefix_hit_tokens - restored), "L2": 0}
        tiers: list[Any] = [self.host, *self.persistent]
        names = {"host": "L2", "disk": "L3_disk", "redis": "L3_redis"}
        for tier in self.persistent:
            hits[names[tier.name]] = 0
        for origin, n in list(stats.hit_tokens.items()):
            hits[names.get(origin, "L2")] += n
        return KVCacheSnapshot(
            hit_tokens=hits,
            evictions={"L1": stats.num_slot_evictions}
            | {names[t.name]: t.stats.num_evictions for t in tiers},
            bytes_held={names[t.name]: t.stats.bytes_held for t in tiers if t.name != "redis"},
            budget_bytes={
                names[t.name]: t.budget_bytes for t in tiers if hasattr(t, "budget_bytes")
            },
            errors={names[t.name]: t.stats.num_errors for t in tiers},
            degraded={names[t.name]: t.stats.degraded for t in tiers},
            bytes_saved=stats.bytes_saved,
            bytes_restored=stats.bytes_restored,
            restore_latency_buckets=list(stats.restore_latency_buckets),
            restore_latency_sum_s=stats.restore_latency_sum_s,
            refusals=dict(stats.refusals),
            num_skipped_slower=stats.num_skipped_slower,
            num_fetch_waits=stats.num_fetch_waits,
            num_fetch_timeouts=stats.num_fetch_timeouts,
        )

    # ---- shutdown ------------------------------------------------------------------------

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for queued L3 writes (a graceful stop keeps its conversations' KV)."""
        with self._writes_lock:
            pending = list(self._writes)
        concurrent.futures.wait(pending, timeout_s)

    def close(self) -> None:
        self.flush()
        self._io.shutdown(wait=False, cancel_futures=True)
        for tier in self.persistent:
            close = getattr(tier, "close", None)
            if close is not None:
                close()
