"""`bench sessions --oversubscribed`: the turns/s setups (tiers, no tiers and the two
ceilings) and the report that puts them side by side."""

import argparse

import pytest

from ultrafast_harness.bench import sessions_oversub as so


def _report(rates: dict[str, float]) -> dict:
    ttft = {"warm_slot_ttft_ms": 20.0, "next_turn_ttft_ms": 30.0, "ratio": 1.5}
    setups = {
        "no_tiers": (4, 16),
        "tiers": (4, 16),
        "own_slot_each": (16, 16),
        "as_many_as_slots": (4, 4),
    }
    return {
        "conversations": 12,
        "num_slots": 4,
        "turns": 6,
        "throughput_rounds": 2,
        "no_tiers": dict(ttft),
        "tiers": {**ttft, "after_restart_ttft_ms": 33.0, "after_restart_ratio": 1.65},
        "throughput": {
            name: {
                "slots": slots,
                "conversations": convs,
                "turns_per_s": rates[name],
                "rounds_turns_per_s": [rates[name] - 0.5, rates[name] + 0.5],
                "next_turn_ttft_ms": 10.0,
            }
            for name, (slots, convs) in setups.items()
        },
    }


def test_the_setups_compare_the_same_conversations_with_the_ceilings():
    assert so.SETUPS["no_tiers"] == ("plain", "many")
    assert so.SETUPS["tiers"] == ("tiered", "many")
    assert so.SETUPS["own_slot_each"] == ("wide", "many")  # a slot for every conversation
    assert so.SETUPS["as_many_as_slots"] == ("plain", "slots")
    assert set(so.SETUP_LABELS) == set(so.SETUPS)


def test_the_report_shows_every_setup_against_no_tiers():
    rates = {"no_tiers": 2.0, "tiers": 4.0, "own_slot_each": 10.0, "as_many_as_slots": 8.0}
    table = so.markdown(_report(rates))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()}
    assert (
        "| 16 | 16 | 10.00 | 9.50 10.50 | 10.0 | 5.00x |" in rows[so.SETUP_LABELS["own_slot_each"]]
    )
    assert "| 4 | 4 | 8.00 |" in rows[so.SETUP_LABELS["as_many_as_slots"]]
    assert rows[so.SETUP_LABELS["tiers"]].endswith("| 2.00x |")
    assert "2 interleaved rounds" in table


@pytest.mark.parametrize(
    "bad", [{"throughput_rounds": 0}, {"throughput_conversations": 0}, {"oversub_turns": 1}]
)
def test_bad_sizes_are_refused_before_any_server_starts(bad):
    args = argparse.Namespace(
        throughput_rounds=1, throughput_conversations=4, oversub_conversations=3, oversub_turns=2
    )
    for key, value in bad.items():
        setattr(args, key, value)
    with pytest.raises(SystemExit, match="must be at least"):
        so.main(args, ())
