"""`ultrafast bench` end to end on the demo model in quick mode: every runner runs, and the
JSON, Markdown and PNG it writes are complete and well-formed (no timing is asserted)."""

import json
import subprocess
import sys

from ultrafast.config import DEMO_MODEL_DIR


def test_bench_run_quick_mode_writes_json_markdown_png(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "bench",
            "--model",
            str(DEMO_MODEL_DIR),
            "--max-tokens",
            "8",
            "--rounds",
            "1",
            "--concurrency",
            "1,2",
            "--prompt-tokens",
            "12",
            "--threads",
            "1",
            "--roofline",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["skipped"] == {}
    assert set(report["runners"]) == {"ours-engine", "ours-server", "llama.cpp", "transformers"}
    assert set(report["results"]) == {"1", "2"}
    assert set(report["results"]["1"]) == set(report["runners"])
    assert "llama.cpp" not in report["results"]["2"]  # no batching: concurrency 1 only
    for level, by_runner in report["results"].items():
        for r in by_runner.values():
            assert r["num_streams"] == int(level) and r["num_tokens"] == 8 * int(level)
            assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
            assert 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p99"] and r["tok_s"] > 0
    pair = report["ratios"]["1"]["ours-server / llama.cpp"]
    assert pair["tok_s"] > 0 and pair["itl_p50"] > 0
    roof = report["roofline"]
    assert roof["bandwidth_gb_s"]["cpu"] > 0
    # fp32 transformers reads twice the bytes per token of the f16 GGUF
    by = roof["runners"]
    assert by["transformers"]["weight_bytes"] == 2 * by["llama.cpp"]["weight_bytes"]
    assert 0 < by["ours-engine"]["fraction"]
    table = out.with_suffix(".md").read_text()
    assert "| 2 | ours-server |" in table and "roofline" in table
    assert "concurrency 1 only" in table
    png = out.with_suffix(".png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
