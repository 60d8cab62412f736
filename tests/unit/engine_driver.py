"""Drive an EngineCore step by step in unit tests (the executor is executors/fake_exec.py)."""

from __future__ import annotations

import collections


def run_all(engine, requests, arrivals=None, abort_at=None):
    """Drive `engine` until idle: request i arrives at step `arrivals[i]` (default all at 0),
    `abort_at[step]` is aborted at that step. Returns (tokens by request id, finish reasons)."""
    arrivals = arrivals or [0] * len(requests)
    outputs, finish = collections.defaultdict(list), {}
    pending = list(zip(arrivals, requests))
    step = 0
    while pending or engine.has_work():
        for at, request in [p for p in pending if p[0] <= step]:
            engine.add_request(request)
            pending.remove((at, request))
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        step += 1
        assert step < 10_000
    return outputs, finish


def prompt(seed: int, n: int) -> list[int]:
    """A deterministic prompt of n token ids (vocab 97)."""
    return [(seed * 31 + i * 7) % 97 for i in range(n)]
