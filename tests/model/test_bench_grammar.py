"""`ultrafast bench grammar` runs end to end at a tiny setting (figures are not asserted)."""

import argparse
import json

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench import grammar


def test_bench_grammar_writes_its_report(tmp_path):
    out = tmp_path / "bench_grammar.json"
    args = argparse.Namespace(
        model=str(DEMO_MODEL_DIR),
        new_tokens=6,
        rounds=1,
        concurrency=2,
        threads=None,
        out=out,
        served=False,
    )
    assert grammar.main(args) == 0
    report = json.loads(out.read_text())
    assert set(report) >= {"batch_1", "batch_2", "compile", "schema_bytes"}
    assert 9_000 <= report["schema_bytes"] <= 11_000
    assert report["compile"]["first_ms"] > 0 and report["batch_2"]["free_ms_per_token"] > 0


def test_big_schema_compiles_and_each_salt_is_new():
    a, b = grammar.big_schema(1), grammar.big_schema(2)
    assert a != b and len(json.dumps(a)) > 9_000


def test_bench_grammar_served_writes_its_report(tmp_path):
    """Through a real server: every kind of call got content, first-seen, cached, long."""
    out = tmp_path / "bench_grammar_served.json"
    args = argparse.Namespace(model=str(DEMO_MODEL_DIR), rounds=2, out=out, served=True)
    assert grammar.main(args) == 0
    report = json.loads(out.read_text())
    for kind in ("none", "first_seen", "cached", "long_none", "long_first_seen"):
        assert len(report["raw_ms"][kind]) == 2 and min(report["raw_ms"][kind]) > 0
    assert report["schema_bytes"] == len(json.dumps(grammar.big_schema(0)))
