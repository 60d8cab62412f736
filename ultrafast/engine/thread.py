"""EngineThread: runs an EngineCore on its own thread, the engine's boundary to the server.

Requests and aborts go in through one queue, outputs come back through a per-request callback
(the server wraps it with `loop.call_soon_threadsafe`). Moving the engine to its own process
later changes only that boundary.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ultrafast.core.types import RequestOutput
from ultrafast.engine.core import EngineCore, StepStats
from ultrafast.engine.idle_trim import IdleTrim
from ultrafast.engine.read_api import (
    AbortRequest,
    AddRequest,
    Configure,
    EngineReadAPI,
    EngineSettings,
    EngineSnapshot,
    InboxItem,
    OutputCallback,
    Wake,
)
from ultrafast.request import Request, ServiceTier

log = logging.getLogger(__name__)


class EngineThread:
    """Runs an EngineCore on a daemon thread. Thread-safe `submit`, `abort` and the read
    API (`read`: snapshot, cached prefixes, configure)."""

    def __init__(
        self,
        core: EngineCore,
        on_stats: Callable[[StepStats], None] | None = None,
        shaper_window_s: float = 0.0,
        idle_trim: IdleTrim | None = None,
    ):
        self.core = core
        # freed memory back to the kernel after an idle stretch (engine/idle_trim.py)
        self.idle_trim = IdleTrim() if idle_trim is None else idle_trim
        # Request shaper: default/flex arrivals wait up to this long so a burst joins one step;
        # a priority arrival ends the wait at once.
        self.shaper_window_s = shaper_window_s
        self._first_shaped_arrival_s: float | None = None
        self._priority_arrived = False
        self.on_stats = on_stats
        self._inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._thread = threading.Thread(target=self._run, name="ultrafast-engine", daemon=True)
        self._stopping = threading.Event()
        self._warmup = False
        self._measure_speed = True
        self._background = False
        self._warmed = threading.Event()
        self.dead_reason: str | None = None
        # engine/read_api.py: the published snapshot (the pool lock is the core's)
        self.read = EngineReadAPI(core, self._inbox.put)

    def start(
        self,
        warmup: bool = False,
        timeout_s: float = 600.0,
        measure_speed: bool = True,
        background: bool = False,
    ) -> EngineThread:
        """Start the thread; with `warmup`, it first runs `core.warmup()` and this returns
        once that is done (`measure_speed` False: without timing the idle speed, e.g. a
        model reloaded by the residency cache, whose speed was measured at its first load;
        `background`: start costs not cached are measured later, while the engine is idle).

        Warm up here, not on the caller's thread: llama.cpp's CPU threads come from OpenMP,
        and once one thread has run a pass, passes run from any other thread do not get the
        extra threads' speed (they run at the one-thread speed)."""
        self._warmup = warmup
        self._measure_speed = measure_speed
        self._background = background
        self._warmed.clear()
        self._thread.start()
        if warmup and not self._warmed.wait(timeout_s):
            raise RuntimeError("the engine did not warm up in time")
        if self.dead_reason is not None:
            raise RuntimeError(f"the engine thread died while warming up: {self.dead_reason}")
        return self

    def submit(self, request: Request, on_output: OutputCallback) -> None:
        self._inbox.put(AddRequest(request, on_output))

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._inbox.put(Wake())
        self._thread.join(timeout_s)

    # the read API's calls, as the server (server/bridge.py) makes them
    def snapshot(self) -> EngineSnapshot:
        return self.read.snapshot()

    def cached_prefix_tokens(self, token_ids: list[int], tenant: str) -> int:
        return self.read.cached_prefix_tokens(token_ids, tenant)

    def configure(self, settings: EngineSettings) -> None:
        self.read.configure(settings)

    @property
    def device_kind(self) -> str:
        return self.read.device_kind

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued item; False if there was none."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, item: InboxItem) -> None:
        match item:
            case AddRequest(request, on_output):
                self._add(request, on_output)
            case AbortRequest(request_id):
                self.core.abort(request_id)
            case Configure(settings):
                self._apply_settings(settings)

    def _add(self, request: Request, on_output: OutputCallback) -> None:
        try:
            self.core.add_request(request)
        except (ValueError, OverflowError) as exc:
            on_output(
                RequestOutput(
                    request.request_id, [], finished=True, finish_reason="error", error=str(exc)
                )
            )
            return
        self._callbacks[request.request_id] = on_output
        if request.tier == ServiceTier.PRIORITY:
            self._priority_arrived = True
        elif self._first_shaped_arrival_s is None:
            self._first_shaped_arrival_s = time.monotonic()

    def _apply_settings(self, settings: EngineSettings) -> None:
        if settings.reserved_priority_seats is not None:
            self.core.scheduler.set_reserved_priority_seats(dict(settings.reserved_priority_seats))

    def _run(self) -> None:
        try:
            if self._warmup:
                self.core.warmup(measure_speed=self._measure_speed, background=self._background)
            self.read.publish(force=True)
            self._warmed.set()
            start_costs = self.core.start_costs
            while not self._stopping.is_set():
                handled = self._drain_inbox(block=not self.core.has_work())
                if not self.core.has_work():
                    if handled:
                        self.read.publish(force=True)
                    elif self.core.grammar_stage.build_when_idle():  # idle for an inbox wait
                        continue  # (a deferred grammar runtime built: grammar/deferred.py)
                    elif start_costs.wants_tick():
                        start_costs.tick(self._work_waiting)
                        self.read.publish(force=True)
                    elif self.idle_trim.due():
                        self.idle_trim.run()
                    continue
                self._coalesce()
                outputs = self.core.step()
                self.idle_trim.busy()
                self.read.publish(force=not self.core.has_work())
                for output in outputs:
                    callback = self._callbacks.get(output.request_id)
                    if output.finished:
                        self._callbacks.pop(output.request_id, None)
                    if callback is not None:
                        self._deliver(callback, output)
                if self.on_stats is not None and self.core.last_stats is not None:
                    self.on_stats(self.core.last_stats)
                start_costs.observe(self.core.last_stats)
        except BaseException as exc:  # fatal: tell every waiter, then die visibly
            self.dead_reason = f"{type(exc).__name__}"
            log.exception("engine thread died")
            self._warmed.set()  # a failed warm-up must not leave start() waiting
            for request_id, callback in list(self._callbacks.items()):
                self._deliver(
                    callback,
                    RequestOutput(
                        request_id, [], finished=True, finish_reason="error", error="engine failed"
                    ),
                )
            self._callbacks.clear()

    def _work_waiting(self) -> bool:
        """A background measurement gives way: a request (or a stop) is waiting."""
        return not self._inbox.empty() or self._stopping.is_set()

    def _coalesce(self) -> None:
        """Hold a step for the shaper window while only default/flex arrivals are new."""
        first = self._first_shaped_arrival_s
        priority_running = any(r.tier == ServiceTier.PRIORITY for r in self.core.scheduler.running)
        if self.shaper_window_s > 0 and first is not None and not priority_running:
            deadline = first + self.shaper_window_s
            while not self._priority_arrived and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    self._handle(self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        self._first_shaped_arrival_s = None
        self._priority_arrived = False

    @staticmethod
    def _deliver(callback: OutputCallback, output: RequestOutput) -> None:
        try:
            callback(output)
        except Exception:  # a broken consumer must not stop the engine
            log.exception("output callback failed for %s", output.request_id)
