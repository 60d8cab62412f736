"""Several models resident by use (server/residency/): sizes, durations, the LRU choice, the
use predictor and the registry's loads, evictions, keep_alive, pins, errors and preloads,
with a fake loader and a fake clock (no engine)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ultrafast.server.errors import APIError
from ultrafast.server.residency.budget import (
    Candidate,
    parse_bytes,
    parse_keep_alive,
    pick_victims,
)
from ultrafast.server.residency.predictor import UsePredictor
from ultrafast.server.residency.registry import LOADED, UNLOADED, ModelEntry, ModelRegistry

# ---- budget.py ------------------------------------------------------------------------------


def test_parse_bytes_units():
    assert parse_bytes("123") == 123
    assert parse_bytes("2G") == 2_000_000_000
    assert parse_bytes("1.5GiB") == int(1.5 * 2**30)
    assert parse_bytes("300mb") == 300_000_000
    with pytest.raises(ValueError):
        parse_bytes("lots")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("5m", 300.0), ("1h30m", 5400.0), ("90s", 90.0), ("500ms", 0.5), (30, 30.0), ("0", 0.0)],
)
def test_parse_keep_alive_durations(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [-1, "-1", "-5m", -0.5])
def test_negative_keep_alive_is_forever(value):
    assert parse_keep_alive(value) is None


@pytest.mark.parametrize("value", ["5 minutes", "m5", "", True, [1], {"s": 1}, "inf", float("nan")])
def test_bad_keep_alive_is_refused(value):  # B61
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_pick_victims_least_recently_used_first():
    cands = [Candidate("a", 10, last_used_s=5.0), Candidate("b", 10, last_used_s=1.0)]
    assert pick_victims(cands, need_bytes=10, free_bytes=0) == ["b"]
    assert pick_victims(cands, need_bytes=20, free_bytes=0) == ["b", "a"]
    assert pick_victims(cands, need_bytes=21, free_bytes=0) is None
    assert pick_victims(cands, need_bytes=5, free_bytes=5) == []


def test_pick_victims_keeps_a_model_needed_before_the_preload():
    cands = [
        Candidate("soon", 10, last_used_s=1.0, next_use_s=3.0),
        Candidate("later", 10, last_used_s=2.0, next_use_s=50.0),
    ]
    assert pick_victims(cands, 10, 0, before_s=10.0) == ["later"]
    assert pick_victims(cands, 20, 0, before_s=10.0) is None


# ---- predictor.py ---------------------------------------------------------------------------


def test_steady_period_predicts_the_next_call():
    p = UsePredictor(min_samples=3)
    for t in (0.0, 10.0, 20.1, 29.9):
        p.observe("a", t)
    assert p.next_use("a", now=30.0) == pytest.approx(29.9 + 29.9 / 3)


def test_irregular_calls_predict_nothing():
    p = UsePredictor(min_samples=3)
    for t in (0.0, 1.0, 9.0, 10.0, 30.0):
        p.observe("a", t)
    assert p.next_use("a", now=31.0) is None


def test_a_long_overdue_call_stops_the_prediction():
    p = UsePredictor(min_samples=3)
    for t in (0.0, 10.0, 20.0, 30.0):
        p.observe("a", t)
    assert p.next_use("a", now=44.0) == pytest.approx(40.0)
    assert p.next_use("a", now=46.0) is None


def test_follower_in_an_agent_loop():
    p = UsePredictor(min_samples=3)
    t = 0.0
    for _ in range(4):  # plan with `planner`, act with `coder` 2 s later, at uneven intervals
        p.observe("planner", t)
        p.observe("coder", t + 2.0)
        t += 7.0 + 5.0 * (_ % 2)
    p.observe("planner", 100.0)
    assert p.next_use("coder", now=100.5) == pytest.approx(102.0)
    assert p.next_use("planner", now=100.5) is None  # its own calls were not periodic


# ---- registry.py ----------------------------------------------------------------------------


class FakeModel:
    def __init__(self, name: str):
        self.runtime = name
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Harness:
    """A registry over fake models; `load_s` advances the fake clock during each load."""

    def __init__(self, sizes: dict[str, int], budget: int, load_s: float = 0.0, **kw):
        self.now = 0.0
        self.load_s = load_s
        self.built: list[FakeModel] = []
        self.fail: set[str] = set()
        self.lock = threading.Lock()
        entries = [
            ModelEntry(name, size, pinned=name in kw.get("pinned", ()))
            for name, size in sizes.items()
        ]
        kw.pop("pinned", None)
        self.registry = ModelRegistry(
            entries, self.load, budget_bytes=budget, clock=lambda: self.now, **kw
        )

    def load(self, name: str) -> FakeModel:
        if name in self.fail:
            raise FileNotFoundError(f"model path /models/{name} does not exist")
        with self.lock:
            self.now += self.load_s
        model = FakeModel(name)
        self.built.append(model)
        return model

    async def call(self, name: str, keep_alive=False) -> str:
        view, release = await self.registry.acquire(name, keep_alive)
        release()
        return view

    async def settle(self) -> None:
        """Let load and unload tasks (worker thread + event loop) finish."""
        for _ in range(200):
            busy = [
                t
                for e in self.registry.entries.values()
                for t in (e.load_task, e.unload_task)
                if t is not None and not t.done()
            ]
            if not busy:
                return
            await asyncio.sleep(0.005)


def status(h: Harness) -> dict[str, str]:
    return {name: e.status for name, e in h.registry.entries.items()}


def test_budget_for_one_swaps_the_least_recently_used():
    async def run():
        h = Harness({"a": 10, "b": 10}, budget=15)
        assert await h.call("a") == "a"
        assert await h.call("b") == "b"
        await h.settle()
        assert status(h) == {"a": UNLOADED, "b": LOADED}
        assert h.built[0].closed and not h.built[1].closed
        assert await h.call(None) == "a"  # no `model`: the first one
        assert h.registry.loads["demand"] == 3 and h.registry.evictions["budget"] == 2
        assert h.registry.cold_calls == 3

    asyncio.run(run())


def test_a_model_with_a_call_in_flight_is_never_evicted():  # F33
    async def run():
        h = Harness({"a": 10, "b": 10}, budget=15, load_timeout_s=0.2)
        view, release_a = await h.registry.acquire("a")
        with pytest.raises(APIError) as err:  # b waits for room, a stays: 503, bounded
            await h.registry.acquire("b")
        assert err.value.status == 503 and "'b'" in str(err.value)
        assert err.value.code == "model_loading"
        assert status(h)["a"] == LOADED and not h.built[0].closed
        waiter = asyncio.ensure_future(h.registry.acquire("b"))
        await asyncio.sleep(0.02)
        assert not waiter.done() and not h.built[0].closed
        release_a()  # a's call ends: now b may take its room
        view_b, release_b = await waiter
        assert view_b == "b" and h.built[0].closed
        release_b()
        release_b()  # idempotent
        assert h.registry.entries["b"].in_flight == 0

    asyncio.run(run())


def test_keep_alive_zero_forever_and_default():
    async def run():
        h = Harness({"a": 10, "b": 10, "c": 10}, budget=0, keep_alive_s=60.0)
        await h.call("a", keep_alive=0.0)
        await h.settle()
        assert status(h)["a"] == UNLOADED and h.registry.evictions["keep_alive"] == 1
        await h.call("b", keep_alive=None)  # -1: forever
        await h.call("c")  # the server default, 60 s
        h.now += 61.0
        h.registry.tick()
        await h.settle()
        assert status(h) == {"a": UNLOADED, "b": LOADED, "c": UNLOADED}

    asyncio.run(run())


def test_keep_alive_zero_is_not_undone_by_a_preload():
    """A call that said keep_alive 0 unloads its model; a steady call pattern must not load it
    straight back (seen in the e2e residency test on a slow machine: `loading` after the call)."""

    async def run():
        h = Harness({"a": 10, "b": 10}, budget=0)
        for t in (0.0, 10.0):  # a is called every 10 s
            h.now = t
            await h.call("a")
        h.now = 20.0
        await h.call("a", keep_alive=0.0)
        await h.settle()
        assert status(h)["a"] == UNLOADED
        h.now = 30.0  # the period's guess (30 s) is due: still the client's 0 wins
        h.registry.tick()
        await h.settle()
        assert status(h)["a"] == UNLOADED and h.registry.loads["preload"] == 0
        await h.call("a")  # a call with the default keep_alive: preloads may follow again
        assert h.registry.entries["a"].keep_alive_s != 0

    asyncio.run(run())


def test_pinned_model_stays_and_too_large_is_refused():  # B60
    async def run():
        h = Harness({"p": 10, "a": 10, "big": 25}, budget=30, pinned=("p",))
        await h.call("p")
        await h.call("a")
        with pytest.raises(APIError) as err:  # 25 > 30 - 10 pinned: it can never fit
            await h.call("big")
        assert err.value.status == 503 and err.value.code == "model_exceeds_budget"
        assert "'big'" in str(err.value)
        h.now += 1e6
        h.registry.tick()
        await h.settle()
        assert status(h)["p"] == LOADED  # no keep_alive expiry for a pin

    asyncio.run(run())


def test_a_failed_load_is_a_503_naming_the_model_and_is_retried():  # F34
    async def run():
        h = Harness({"a": 10, "gone": 10}, budget=0)
        h.fail.add("gone")
        with pytest.raises(APIError) as err:
            await h.call("gone")
        assert err.value.status == 503 and err.value.code == "model_unavailable"
        assert "'gone'" in str(err.value) and "does not exist" in str(err.value)
        assert h.registry.load_failures == 1 and status(h)["gone"] == UNLOADED
        assert await h.call("a") == "a"  # the others still serve
        h.fail.clear()  # the file is back: the next call loads it
        assert await h.call("gone") == "gone"

    asyncio.run(run())


def test_unknown_model_is_a_404_naming_it():
    async def run():
        h = Harness({"a": 10}, budget=0)
        with pytest.raises(APIError) as err:
            await h.call("nope")
        assert err.value.status == 404 and "'nope'" in str(err.value) and "a" in str(err.value)

    asyncio.run(run())


def test_a_waiting_call_goes_before_a_preload():
    async def run():
        h = Harness({"a": 10, "b": 10, "c": 10}, budget=15)
        _, release_a = await h.registry.acquire("a")
        for t in (0.0, 10.0, 20.0):  # c is called every 10 s: next at 30
            h.registry.predictor.observe("c", t)
        h.now = 30.0
        waiter = asyncio.ensure_future(h.registry.acquire("b"))
        await asyncio.sleep(0.01)  # b waits for a's room
        release_a()
        h.registry.tick()  # before b's waiter runs: c is due, but b was asked for
        assert h.registry.loads["preload"] == 0 and status(h)["c"] == UNLOADED
        view_b, release_b = await waiter
        assert view_b == "b"
        release_b()

    asyncio.run(run())


def replay_alternating(preload: bool, cycles: int = 24) -> ModelRegistry:
    """a at t = 10k, b at t = 10k + 5, budget for one, loads take 1 s (fake clock)."""

    async def run():
        h = Harness({"a": 10, "b": 10}, budget=15, load_s=1.0, preload=preload)
        for k in range(cycles):
            for name, offset in (("a", 0.0), ("b", 5.0)):
                target = 10.0 * k + offset
                while h.now + 0.25 <= target:  # between calls: the background tick
                    h.now += 0.25
                    h.registry.tick()
                    await h.settle()
                h.now = max(h.now, target)
                await h.call(name)
        return h.registry

    return asyncio.run(run())


def test_preloading_a_periodic_trace_cuts_cold_loads():
    without = replay_alternating(preload=False)
    with_preload = replay_alternating(preload=True)
    assert without.cold_calls == 48  # every call loads its model
    assert with_preload.loads["preload"] > 0 and with_preload.preload_hits > 0
    assert with_preload.cold_calls <= 0.2 * without.cold_calls


# ---- the serve flags ------------------------------------------------------------------------


def _serve_args(*argv: str):
    import argparse

    from ultrafast.cli_serve import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_models_flags_make_the_server_config():
    from ultrafast.cli_serve import server_config

    config = server_config(
        _serve_args(
            "--models",
            "a=/m/a.gguf,b=/m/b",
            "--models",
            "/m/c.gguf",
            "--max-resident-bytes",
            "1.5G",
            "--pin",
            "b",
            "--keep-alive",
            "-1",
            "--no-preload",
        )
    )
    assert config.models == (("a", "/m/a.gguf"), ("b", "/m/b"), ("c", "/m/c.gguf"))
    assert config.max_resident_bytes == 1_500_000_000 and config.pinned_models == ("b",)
    assert config.keep_alive_s is None and not config.preload_models


@pytest.mark.parametrize(
    "argv",
    [
        ("--models", "a=/x,a=/y"),  # a name twice
        ("--models", "=/x"),
        ("--models", "a=/x", "--pin", "b"),  # not one of the models
        ("--models", "a=/x", "--max-resident-bytes", "lots"),
        ("--models", "a=/x", "--keep-alive", "soon"),
    ],
)
def test_bad_models_flags_are_refused(argv):
    from ultrafast.cli_serve import server_config

    with pytest.raises(ValueError):
        server_config(_serve_args(*argv))
