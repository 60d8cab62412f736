"""EmbeddingEngine: concurrent requests share forward passes, results go back to the right
job in input order, a failing pass fails only its jobs, shutdown stops the thread."""

import threading

import numpy as np

from tests.unit.fake_embedder import FakeEmbedExecutor, vector
from ultrafast.core.embed_queue import EmbedJob
from ultrafast.engine.embed_engine import EmbeddingEngine
from ultrafast.request import ServiceTier


def submit(engine, inputs, tier=ServiceTier.DEFAULT):
    done = threading.Event()
    box = {}

    def on_done(vectors, error):
        box["vectors"], box["error"] = vectors, error
        done.set()

    engine.submit(EmbedJob(inputs, tier, on_done))
    return done, box


def test_requests_waiting_during_a_pass_share_the_next_one():
    gate = threading.Event()
    executor = FakeEmbedExecutor(gate=gate)
    engine = EmbeddingEngine(executor)
    try:
        first = submit(engine, [[1, 5, 2]])
        assert executor.entered.wait(5)  # the first pass runs (and waits at the gate)
        b = submit(engine, [[1, 6, 2], [1, 7, 2]])
        c = submit(engine, [[1, 8, 9, 2]], ServiceTier.PRIORITY)
        gate.set()
        for done, _ in (first, b, c):
            assert done.wait(5)
        assert executor.passes[1] == [[1, 8, 9, 2], [1, 6, 2], [1, 7, 2]]  # priority first
        for (_, box), inputs in ((b, [[1, 6, 2], [1, 7, 2]]), (c, [[1, 8, 9, 2]])):
            assert box["error"] is None
            for got, ids in zip(box["vectors"], inputs):
                np.testing.assert_allclose(got, vector(ids))
        assert engine.snapshot().step_id == 1
    finally:
        engine.shutdown()
    assert executor.closed and not engine.alive


def test_a_failing_pass_fails_its_jobs_and_the_engine_goes_on():
    executor = FakeEmbedExecutor()
    real_embed = executor.embed

    def embed(inputs):
        if any(99 in ids for ids in inputs):
            raise RuntimeError("llama_decode failed with status -1")
        return real_embed(inputs)

    executor.embed = embed
    engine = EmbeddingEngine(executor)
    try:
        done, box = submit(engine, [[1, 99, 2]])
        assert done.wait(5)
        assert box["vectors"] is None and box["error"].code == "engine_error"
        done, box = submit(engine, [[1, 5, 2]])
        assert done.wait(5) and box["error"] is None
        assert engine.alive
    finally:
        engine.shutdown()


def test_queue_full_is_refused_through_the_callback():
    engine = EmbeddingEngine(FakeEmbedExecutor(), max_waiting_inputs=2)
    try:
        done, box = submit(engine, [[1, 2]] * 3)
        assert done.wait(5)
        assert box["error"].code == "queue_full"
    finally:
        engine.shutdown()
