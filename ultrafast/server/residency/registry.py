"""Several models in one server, resident by use: the weight-swapping cache (issue 20, part 4).

Each configured model is `unloaded`, `loading`, `loaded` or `unloading`. A call takes a lease
on its model (`acquire`): a loaded model serves at once; an unloaded one is loaded first, on
one worker thread shared by loads and unloads (so an eviction's memory is freed before the
next load starts), and the call waits for it, at most `load_timeout_s`. Loads fit a byte
budget: the least recently used idle model is evicted to make room; a model with a call in
flight, or pinned, never is. `keep_alive` (Ollama's semantics, per request or the server's
default) unloads an idle model after that long; 0 unloads it when its calls are done.
A background tick also preloads a model shortly before the predictor (predictor.py) expects
its next call, when that does not evict a model expected sooner, and never a model whose
latest call said keep_alive 0.

Errors name the model: 404 for an unknown name, 503 for a model larger than the budget, one
that failed to load (e.g. its file disappeared while it was not resident), or a load that
is still running when the wait ends. Everything here runs on the event loop except the
loader and the unloader (the worker thread).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from ultrafast.server.errors import APIError, quote
from ultrafast.server.protocol_models import MAX_MODEL_NAME_CHARS
from ultrafast.server.residency.budget import Candidate, pick_victims
from ultrafast.server.residency.predictor import UsePredictor

log = logging.getLogger("ultrafast.models")

UNLOADED, LOADING, LOADED, UNLOADING = "unloaded", "loading", "loaded", "unloading"
LOAD_REASONS = ("startup", "demand", "preload")
EVICT_REASONS = ("budget", "keep_alive")
LOAD_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RETRY_FAILED_PRELOAD_S = 30.0  # a model whose load failed is not preloaded again for this long


class Resident(Protocol):
    """What the loader returns: the model's runtime (server/runtime.py), and how to free it."""

    runtime: Any

    def close(self) -> None: ...


@dataclass
class ModelEntry:
    name: str
    num_bytes: int  # charged to the budget while loading or loaded
    pinned: bool = False
    status: str = UNLOADED
    resident: Any = None
    in_flight: int = 0
    waiting: int = 0  # calls waiting for this model's load: it is not evicted under them
    last_used_s: float = 0.0
    keep_alive_s: float | None = None  # the latest call's (or the default); None = forever
    expires_s: float | None = None  # an idle model unloads then; None = never
    load_task: asyncio.Task | None = None
    unload_task: asyncio.Task | None = None
    load_s: float | None = None  # the last load's duration
    load_error: str | None = None
    failed_s: float = -1e18
    preloaded_unused: bool = False  # loaded by a preload, no call served yet
    extra: dict = field(default_factory=dict)  # listing fields (max_model_len, ...)


class ModelRegistry:
    def __init__(
        self,
        entries: list[ModelEntry],
        loader: Callable[[str], Resident],
        *,
        budget_bytes: int = 0,
        keep_alive_s: float | None = 300.0,
        load_timeout_s: float = 120.0,
        preload: bool = True,
        tick_s: float = 0.05,
        predictor: UsePredictor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert entries, "at least one model"
        self.entries = {e.name: e for e in entries}
        self.default_name = entries[0].name
        self.loader = loader
        self.budget_bytes = budget_bytes  # 0 = no byte limit (keep_alive still unloads)
        self.keep_alive_s = keep_alive_s
        self.load_timeout_s = load_timeout_s
        self.preload = preload
        self.tick_s = tick_s
        self.predictor = predictor or UsePredictor()
        self.clock = clock
        self.loads = {reason: 0 for reason in LOAD_REASONS}
        self.evictions = {reason: 0 for reason in EVICT_REASONS}
        self.load_failures = 0
        self.cold_calls = 0  # calls that found their model not loaded and waited
        self.warm_calls = 0
        self.preload_hits = 0  # calls served by a model a preload brought in
        self.load_seconds: collections.deque[float] = collections.deque(maxlen=256)  # recent
        self.load_bucket_counts = [0] * (len(LOAD_BUCKETS_S) + 1)  # every load, for metrics
        self.load_seconds_sum = 0.0
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ultrafast-model-load")
        self._changed = asyncio.Event()
        self._ticker: asyncio.Task | None = None
        self._closed = False

    # ---- lookup and listing ------------------------------------------------------------------

    def entry(self, name: str | None) -> ModelEntry:
        entry = self.entries.get(self.default_name if name is None else name)
        if entry is None:
            served = ", ".join(self.entries)
            raise APIError(
                404,
                f"the model {quote(str(name), MAX_MODEL_NAME_CHARS)} does not exist; "
                f"this server has {served}",
                "not_found_error",
                "model_not_found",
                "model",
            )
        return entry

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.status == LOADED]

    def used_bytes(self, but: ModelEntry | None = None) -> int:
        return sum(
            e.num_bytes
            for e in self.entries.values()
            if e.status in (LOADED, LOADING) and e is not but
        )

    def describe(self, entry: ModelEntry) -> dict:
        """The extension fields /v1/models shows for one model."""
        return {
            "status": entry.status,
            "pinned": entry.pinned,
            "resident_bytes": entry.num_bytes,
            "in_flight": entry.in_flight,
            "load_s": None if entry.load_s is None else round(entry.load_s, 4),  # the last load
            **entry.extra,
        }

    # ---- the call path -----------------------------------------------------------------------

    async def acquire(
        self, name: str | None, keep_alive_s: float | None | bool = False
    ) -> tuple[Any, Callable[[], None]]:
        """The model's runtime (server/runtime.py), loaded if need be, and the
        release to call once when the call ends. keep_alive_s False: the server default."""
        entry = self.entry(name)
        now = self.clock()
        self.predictor.observe(entry.name, now)
        deadline = now + self.load_timeout_s
        if entry.status == LOADED:
            self.warm_calls += 1
        else:
            self.cold_calls += 1
        entry.waiting += 1
        try:
            while entry.status != LOADED:
                await self._step_towards_loaded(entry, deadline)
        finally:
            entry.waiting -= 1
        # no await from the status check to here: an eviction cannot slip in between
        entry.in_flight += 1
        entry.last_used_s = self.clock()
        entry.keep_alive_s = self.keep_alive_s if keep_alive_s is False else keep_alive_s
        if entry.preloaded_unused:
            entry.preloaded_unused = False
            self.preload_hits += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(entry)

        return entry.resident.runtime, release

    async def _step_towards_loaded(self, entry: ModelEntry, deadline: float) -> None:
        if entry.status == UNLOADED:
            self._check_fits_at_all(entry)
            if self._make_room(entry, before_s=None):
                self._start_load(entry, "demand")
            else:  # every other byte is in use by calls in flight or pins: wait for a release
                await self._wait([self._changed_waiter()], entry, deadline)
                return
        task = entry.load_task if entry.status == LOADING else entry.unload_task
        assert task is not None
        await self._wait([task], entry, deadline)
        if task is entry.load_task and entry.status == UNLOADED and entry.load_error:
            raise APIError(
                503,
                f"the model {entry.name!r} could not be loaded: {entry.load_error}",
                "server_error",
                "model_unavailable",
                "model",
                headers={"Retry-After": "5"},
            )

    async def _wait(self, waiters: list, entry: ModelEntry, deadline: float) -> None:
        remaining = deadline - self.clock()
        done: set = set()
        if remaining > 0:
            done, _ = await asyncio.wait(waiters, timeout=remaining)
        for w in waiters:  # our own event waiter only; a load or unload task runs on
            if not w.done() and w.get_name().startswith("residency-change"):
                w.cancel()
        if not done:
            raise APIError(
                503,
                f"the model {entry.name!r} is not loaded yet ({entry.status}; waited "
                f"{self.load_timeout_s:g} s for a load or for memory to free up)",
                "server_error",
                "model_loading",
                "model",
                headers={"Retry-After": "5"},
            )

    def _changed_waiter(self) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._changed.wait(), name="residency-change")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # waiters of the old event wake; new ones wait anew

    def _check_fits_at_all(self, entry: ModelEntry) -> None:
        if not self.budget_bytes:
            return
        pinned = sum(e.num_bytes for e in self.entries.values() if e.pinned and e is not entry)
        if entry.num_bytes > self.budget_bytes - pinned:
            raise APIError(
                503,
                f"the model {entry.name!r} needs {entry.num_bytes} bytes but the resident "
                f"budget is {self.budget_bytes} bytes ({pinned} of them pinned)",
                "server_error",
                "model_exceeds_budget",
                "model",
            )

    def _release(self, entry: ModelEntry) -> None:
        entry.in_flight -= 1
        now = self.clock()
        entry.last_used_s = now
        if entry.in_flight == 0:
            ka = entry.keep_alive_s
            entry.expires_s = None if ka is None else now + ka
            if ka == 0 and not entry.pinned and entry.status == LOADED:
                self._start_unload(entry, "keep_alive")
        self._notify()

    # ---- loads and evictions -----------------------------------------------------------------

    def _make_room(self, entry: ModelEntry, before_s: float | None) -> bool:
        """Evict idle models (LRU) until `entry` fits; False, evicting nothing, if it cannot."""
        if not self.budget_bytes:
            return True
        now = self.clock()
        candidates = [
            Candidate(e.name, e.num_bytes, e.last_used_s, self.predictor.next_use(e.name, now))
            for e in self.loaded()
            if e.in_flight == 0 and not e.waiting and not e.pinned and e is not entry
        ]
        free = self.budget_bytes - self.used_bytes(but=entry)
        victims = pick_victims(candidates, entry.num_bytes, free, before_s)
        if victims is None:
            return False
        for name in victims:
            self._start_unload(self.entries[name], "budget")
        return True

    def _start_load(self, entry: ModelEntry, reason: str) -> None:
        entry.status = LOADING
        entry.load_error = None
        loop = asyncio.get_running_loop()
        entry.load_task = loop.create_task(self._load(entry, reason), name=f"load-{entry.name}")

    async def _load(self, entry: ModelEntry, reason: str) -> None:
        started = self.clock()
        loop = asyncio.get_running_loop()
        try:
            resident = await loop.run_in_executor(self._worker, self._load_in_worker, entry)
        except Exception as exc:  # a missing file, a bad model: the calls waiting get a 503
            entry.status = UNLOADED
            entry.load_error = f"{type(exc).__name__}: {exc}"[:300]
            entry.failed_s = self.clock()
            self.load_failures += 1
            log.warning("model %s failed to load: %s", entry.name, entry.load_error)
            self._notify()
            return
        self._loaded(entry, resident, reason, self.clock() - started)
        self._notify()

    def _load_in_worker(self, entry: ModelEntry) -> Resident:
        resident = self.loader(entry.name)
        if self._closed:  # shut down while loading: nobody will unload it later
            resident.close()
            raise RuntimeError("the server is shutting down")
        return resident

    def _loaded(
        self, entry: ModelEntry, resident: Resident, reason: str, seconds: float | None
    ) -> None:
        entry.resident = resident
        entry.status = LOADED
        entry.load_s = seconds
        entry.last_used_s = self.clock()
        entry.preloaded_unused = reason == "preload"
        # a preload set how long to keep it (past the predicted call); else the default
        ka = entry.keep_alive_s if reason == "preload" else self.keep_alive_s
        entry.expires_s = None if ka is None else entry.last_used_s + ka
        self.loads[reason] += 1
        if seconds is None:  # the default model, built with the server: not timed here
            log.info("model %s loaded (%s)", entry.name, reason)
            return
        self.load_seconds.append(seconds)
        self.load_seconds_sum += seconds
        self.load_bucket_counts[bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
        log.info("model %s loaded (%s) in %.3f s", entry.name, reason, seconds)

    def _start_unload(self, entry: ModelEntry, reason: str) -> None:
        assert entry.status == LOADED and entry.in_flight == 0, "only an idle model unloads"
        resident, entry.resident = entry.resident, None
        entry.status = UNLOADING
        entry.preloaded_unused = False
        self.evictions[reason] += 1
        log.info("model %s unloading (%s)", entry.name, reason)
        loop = asyncio.get_running_loop()
        entry.unload_task = loop.create_task(
            self._unload(entry, resident), name=f"unload-{entry.name}"
        )

    async def _unload(self, entry: ModelEntry, resident: Resident) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._worker, resident.close)
        except Exception:  # the engine is gone either way; its bytes are free
            log.exception("model %s did not close cleanly", entry.name)
        entry.status = UNLOADED
        self._notify()

    # ---- the background tick: keep_alive expiry and preloading ----------------------------

    def start(self) -> None:
        """On the serving event loop (the app's lifespan)."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    async def _tick_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.tick_s)
            try:
                self.tick()
            except Exception:  # never let the residency loop die silently
                log.exception("model residency tick failed")

    def tick(self) -> None:
        now = self.clock()
        for e in self.loaded():
            if e.in_flight or e.waiting or e.pinned or e.expires_s is None or now < e.expires_s:
                continue
            self._start_unload(e, "keep_alive")
        if self.preload:
            self._preload(now)

    def _preload(self, now: float) -> None:
        if any(e.waiting for e in self.entries.values() if e.status != LOADED):
            return  # a call waits for room or a load: it goes first, a guess waits
        for e in self.entries.values():
            if e.status != UNLOADED or now - e.failed_s < RETRY_FAILED_PRELOAD_S:
                continue
            if e.keep_alive_s == 0:  # its latest call asked to unload it when done: a guess
                continue  # must not load it straight back (only a new call does)
            eta = self.predictor.next_use(e.name, now)
            if eta is None:
                continue
            lead = 1.5 * (e.load_s if e.load_s is not None else self._typical_load_s())
            if now < eta - lead - 2 * self.tick_s:
                continue
            pinned = sum(p.num_bytes for p in self.entries.values() if p.pinned)
            if self.budget_bytes and e.num_bytes > self.budget_bytes - pinned:
                continue
            if self._make_room(e, before_s=eta):
                self._start_load(e, "preload")
                # kept at least until the predicted call and then the default keep_alive
                e.keep_alive_s = None
                if self.keep_alive_s is not None:
                    e.keep_alive_s = max(0.0, eta - now) + self.keep_alive_s

    def _typical_load_s(self) -> float:
        return max(self.load_seconds) if self.load_seconds else 1.0

    # ---- startup and shutdown (not on the event loop) ----------------------------------------

    def adopt(self, name: str, resident: Resident, seconds: float | None) -> None:
        """A model loaded before serving (the default one, pinned ones)."""
        entry = self.entries[name]
        self._loaded(entry, resident, "startup", seconds)

    def evict_for_startup(self, name: str) -> None:
        """Before serving: free room for a pinned model, closing idle unpinned ones now."""
        entry = self.entries[name]
        while self.budget_bytes and entry.num_bytes > self.budget_bytes - self.used_bytes(entry):
            idle = [e for e in self.loaded() if not e.pinned and e is not entry]
            if not idle:
                raise ValueError(
                    f"the pinned models need more than --max-resident-bytes {self.budget_bytes}"
                )
            victim = min(idle, key=lambda e: e.last_used_s)
            victim.resident.close()
            victim.resident, victim.status = None, UNLOADED
            self.evictions["budget"] += 1

    def close(self) -> None:
        """Shutdown: free every resident model (after the event loop stopped)."""
        self._closed = True
        if self._ticker is not None and not self._ticker.get_loop().is_closed():
            self._ticker.cancel()  # (asyncio.run has already cancelled it when serving ended)
        self._worker.shutdown(wait=True)  # a load in progress finishes (and closes itself)
        for e in self.entries.values():
            if e.resident is not None:
                try:
                    e.resident.close()
                except Exception:
                    log.exception("model %s did not close cleanly", e.name)
                e.resident, e.status = None, UNLOADED
