"""The cluster bench's wait for a killed replica's replacement (`--after-kill replaced`)."""

import asyncio

import pytest

from ultrafast_harness.cluster.bench import _replaced


class Cluster:
    """Reports the killed pid (or not ready) for a few polls, then a new ready one."""

    def __init__(self, states):
        self.states = list(states)

    def replicas(self):
        return {"r0": self.states.pop(0) if len(self.states) > 1 else self.states[0]}


def test_the_wait_ends_only_on_a_new_ready_pid():
    cluster = Cluster(
        [{"pid": 7, "ready": True}, {"pid": 9, "ready": False}, {"pid": 9, "ready": True}]
    )
    asyncio.run(_replaced(cluster, "r0", 7))
    assert cluster.states == [{"pid": 9, "ready": True}]  # it polled until the last state


def test_a_replica_never_replaced_is_an_error():
    with pytest.raises(RuntimeError, match="not replaced"):
        asyncio.run(_replaced(Cluster([{"pid": 7, "ready": True}]), "r0", 7, timeout_s=0.3))
