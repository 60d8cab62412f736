"""`ultrafast bench startup` end to end on the demo GGUF, ours only: a cold start (empty cache
directory) and a warm one each answer, with memory and CPU figures; the warm start finds the
start costs the cold one cached (unless the machine was too busy to cache them). No timing is
asserted."""

import json
import subprocess
import sys

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast_harness.bench.startup_bench import llama_cpp_argv, markdown


def test_bench_startup_cold_then_warm_on_ours(tmp_path):
    out = tmp_path / "startup.json"
    gguf = DEMO_MODEL_DIR / "demo-code-f16.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "bench", "startup", "--servers", "ours"]
        + ["--gguf", str(gguf), "--starts", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    cold, warm = report["starts"]
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    for start in (cold, warm):
        assert start["error"] is None and start["first_answer_s"] > 0
        assert start["idle_rss_mib"] > 50 and start["cpu_s"] > 0
        # a short question is no need for the wide path: its weights are not loaded
        assert start["wide_pass"].startswith(("by need", "off (not available")), start
    assert cold["start_costs"] in ("measured", "contended")
    if cold["start_costs"] == "measured":
        assert warm["start_costs"] == "cached"
    table = out.with_suffix(".md").read_text()
    assert "| ours | cold |" in table and "| wide path |" in table


def test_the_llama_cpp_peer_runs_through_the_amx_safe_wrapper_on_every_core(tmp_path):
    argv = llama_cpp_argv(tmp_path / "m.gguf", 1234)
    assert argv[1:3] == ["-m", "ultrafast_harness.bench.llama_server_peer"]
    assert argv[argv.index("--n_threads") + 1] == argv[argv.index("--n_threads_batch") + 1]
    table = markdown(
        {
            "model": "m.gguf",
            "cpu": {"cpu_model": "Xeon", "cores": 2},
            "starts": [],
            "skipped": {"llama.cpp": "llama_cpp.server is not importable"},
        }
    )
    assert "| llama.cpp | skipped |" in table and "not importable" in table
