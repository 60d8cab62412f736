"""The ingress's view of its replicas: a poller that feeds their /ready state and queue depths
to the router, and /metrics of the whole cluster.

Ray restarts a replica whose process died or whose `check_health` raised (replica.py); the poller
only decides where calls go meanwhile: a replica that does not answer its stats call within
`timeout_s` is routed around until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from ultrafast.cluster.router import REASONS, TIERS, Router

log = logging.getLogger(__name__)

# what the ingress adds to the replicas' series (deploy/grafana queries them)
CLUSTER_METRIC_NAMES = frozenset(
    {"ultrafast_cluster_routing_decisions_total", "ultrafast_cluster_replica_up"}
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)(.*)$")


class ReplicaPoller:
    def __init__(
        self,
        router: Router,
        names: Callable[[], list[str]],
        stats: Callable[[str], Awaitable[dict]],
        interval_s: float = 0.5,
        timeout_s: float = 1.0,
        running: Callable[[], Awaitable[dict]] | None = None,
    ):
        self.router, self.names, self.stats = router, names, stats
        # name -> whether Ray says its replica runs: a dead process shows at once there, while
        # a stats call to it would wait for the replacement until `timeout_s`
        self.running = running
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.last: dict[str, dict] = {}  # replica -> its last stats (or {"ready": False})
        self._task: asyncio.Task | None = None

    async def poll_once(self) -> None:
        names = self.names()
        self.router.set_replicas(names)
        if self.running is not None:
            try:
                running = await asyncio.wait_for(self.running(), self.timeout_s)
            except Exception:
                running = {}
            for name in names:
                if running.get(name) is False:
                    self.router.mark_down(name)
        results = await asyncio.gather(
            *(asyncio.wait_for(self.stats(n), self.timeout_s) for n in names),
            return_exceptions=True,
        )
        for name, result in zip(names, results):
            if isinstance(result, BaseException):
                if self.last.get(name, {}).get("ready", True):
                    log.warning("replica %s does not answer (%r): routing around it", name, result)
                self.last[name] = {"ready": False, "error": type(result).__name__}
                self.router.mark_down(name)
            else:
                restarted = result.get("pid") != self.last.get(name, {}).get("pid")
                if restarted and name in self.last:
                    self.router.prefixes.forget(name)  # a new process: an empty cache
                self.last[name] = result
                self.router.report(name, result)

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # the poller must outlive any one bad round
                log.exception("replica poll failed")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class DeathWatch:
    """One call at a time in flight on each replica (EngineReplica.watch), re-issued as each
    ends: Ray breaks it the moment the replica's process dies, so calls stop going there at
    once instead of after the poller's next round (a call to a dead replica otherwise waits in
    Ray for its replacement). The poller brings the replica back when its successor answers."""

    def __init__(
        self,
        router: Router,
        names: Callable[[], list[str]],
        watch: Callable[[str], AsyncIterator[int]],
        retry_s: float = 0.5,
    ):
        self.router, self.names, self.watch, self.retry_s = router, names, watch, retry_s
        self._tasks: dict[str, asyncio.Task] = {}

    async def _watch_one(self, name: str) -> None:
        while True:
            try:
                async for _ in self.watch(name):
                    pass
                continue  # the call ended as planned: the next one
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                load = self.router.loads.get(name)
                if load is not None and load.healthy:
                    log.warning("replica %s died (%s): routing around it", name, exc)
                self.router.mark_down(name)
            await asyncio.sleep(self.retry_s)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for name in self.names():
            if name not in self._tasks:
                self._tasks[name] = loop.create_task(self._watch_one(name))

    def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()


def merge_metrics(per_replica: dict[str, str], router: Router, replica_up: dict) -> str:
    """Every replica's exposition with a `replica` label, plus `replica="all"` sums of the
    counters and histograms, plus the ingress's routing counters."""
    lines: list[str] = []
    seen_meta: set[str] = set()
    kinds: dict[str, str] = {}
    sums: dict[tuple, float] = {}
    order: list[tuple] = []
    for replica, text in per_replica.items():
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 4 and parts[1] == "TYPE":
                    kinds[parts[2]] = parts[3]
                if line not in seen_meta:
                    seen_meta.add(line)
                    lines.append(line)
                continue
            match = _SAMPLE.match(line)
            if match is None:
                continue
            name, labels, value = match.group(1), match.group(2) or "{}", match.group(3)
            inner = labels[1:-1]
            tagged = f'replica="{replica}"' + ("," + inner if inner else "")
            lines.append(f"{name}{{{tagged}}} {value}")
            family = re.sub(r"_(bucket|count|sum|total|created)$", "", name)
            if kinds.get(family) in ("counter", "histogram") or kinds.get(name) == "counter":
                key = (name, inner)
                if key not in sums:
                    order.append(key)
                    sums[key] = 0.0
                try:
                    sums[key] += float(value)
                except ValueError:
                    pass
    for name, inner in order:
        tagged = 'replica="all"' + ("," + inner if inner else "")
        lines.append(f"{name}{{{tagged}}} {sums[(name, inner)]}")
    lines.append(
        "# HELP ultrafast_cluster_routing_decisions_total Calls routed, by tier and reason"
    )
    lines.append("# TYPE ultrafast_cluster_routing_decisions_total counter")
    for tier in TIERS:
        counts = router.decisions.get(tier, {})
        for reason in REASONS:
            lines.append(
                f'ultrafast_cluster_routing_decisions_total{{tier="{tier}",reason="{reason}"}} '
                f"{counts.get(reason, 0)}"
            )
    lines.append("# HELP ultrafast_cluster_replica_up 1 when the replica answers and is ready")
    lines.append("# TYPE ultrafast_cluster_replica_up gauge")
    for replica, up in replica_up.items():
        lines.append(f'ultrafast_cluster_replica_up{{replica="{replica}"}} {1 if up else 0}')
    return "\n".join(lines) + "\n"
