"""`ultrafast bench serve` end to end against ours only, on the demo model, in a tiny setting:
every phase runs, every request is answered with exactly the tokens asked for, and the JSON,
Markdown and PNG are complete (no timing is asserted). vLLM without its venv is skipped, saying
why."""

import json
import subprocess
import sys

from ultrafast.weight_format import resolve_outtype


def test_bench_serve_tiny_run_on_ours(tmp_path):
    out = tmp_path / "serve.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultrafast.cli",
            "bench",
            "serve",
            "--servers",
            "ours,vllm",
            "--vllm-venv",
            str(tmp_path / "no-venv"),
            "--model",
            "demo",
            "--streams",
            "1,2",
            "--long-streams",
            "2",
            "--long-prompt-tokens",
            "200",
            "--new-tokens",
            "8",
            "--burst-short",
            "4",
            "--burst-long",
            "1",
            "--burst-long-tokens",
            "4",
            "--priority-probes",
            "2",
            "--probe-load-streams",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "make vllm-cpu" in report["servers"]["vllm"]["skipped"]
    ours = report["servers"]["ours"]
    assert ours["precision"] == resolve_outtype("auto")[0]
    assert ours["startup_s"] > 0 and ours["peak_rss_mib"] > 50
    assert set(ours["levels"]) == {"1", "2", "long 2"}
    for level, lv in ours["levels"].items():
        streams = int(level.split()[-1])
        assert lv["errors"] == 0 and lv["requests"] == streams
        assert lv["tokens"] == 8 * streams  # EOS ignored: exactly what was asked
        # the chat prompt as the server counted it
        assert lv["prompt_tokens"] >= (200 if level.startswith("long") else 102) - 8
        assert lv["cpu"]["cpu_model"] and "cpu_amx" in lv["cpu"]  # every row: which CPU
        assert 0 < lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] and lv["itl_p99_ms"] > 0
    burst = ours["burst"]
    assert burst["requests"] == 5 and burst["errors"] == 0 and burst["long"]["tokens"] == 4
    probe = ours["priority_probe"]
    assert probe["idle"]["requests"] == 2 and probe["loaded"]["errors"] == 0
    assert probe["ttft_p50_ratio"] > 0
    table = out.with_suffix(".md").read_text()
    assert "| ours | 2 |" in table and "skipped" in table and "loaded / idle" in table
    assert "| ours | long 2 |" in table and report["order"].startswith("servers interleaved")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
