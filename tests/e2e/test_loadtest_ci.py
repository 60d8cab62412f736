"""The CI tier of `ultrafast loadtest`: short load scenarios and fault injections against real
servers (fake executor, and the demo model for L7 and the irregular burst), each followed by
the "nothing lost" checks. Behaviour only: no timing is asserted.

The full tier (the spec's sizes) is `ultrafast loadtest --tier full --scenario all`.
"""

import asyncio

import pytest

from ultrafast_harness.loadtest.harness import Context
from ultrafast_harness.loadtest.runner import BY_NAME, run_one, select

CI_SCENARIOS = [sc.name for sc in select("ci")]


@pytest.fixture(scope="module")
def ctx():
    context = Context(duration_s=60, max_requests=200, ci=True)
    yield context
    context.close()


@pytest.mark.parametrize("name", CI_SCENARIOS)
def test_scenario_keeps_nothing_lost(ctx, name):
    result = asyncio.run(run_one(ctx, BY_NAME[name]))
    assert result.status == "pass", (
        "\n".join(result.violations) + "\n" + str(result.metrics.get("traceback", ""))
    )
    assert result.num_requests > 0
    rest = result.metrics.get("at_rest")
    if rest is not None:  # (iii): nothing running or waiting, every slot and seat free
        assert rest["running"] == 0 and rest["waiting"] == 0 and rest["kv_slots_busy"] == 0
        assert not any(rest["in_flight"].values())


def test_selection_and_loopback_guard():
    assert [sc.name for sc in select("F3,L1")] == ["L1", "F3"]  # run order
    assert len(select("all")) >= 23
    with pytest.raises(ValueError):
        select("L1,X9")
    from ultrafast_harness.loadtest.harness import require_loopback

    assert require_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert require_loopback("http://localhost:1") == "http://localhost:1"
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"):
        with pytest.raises(ValueError):
            require_loopback(url)
