"""`ultrafast loadtest` refuses what it must not do (non-loopback targets, unknown scenarios)
with a clear message, before starting anything."""

import subprocess
import sys


def loadtest(*args):
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "loadtest", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_lists_the_bounds():
    done = loadtest("--help")
    assert done.returncode == 0
    for flag in ("--duration-s", "--max-requests", "--scenario", "--url"):
        assert flag in done.stdout


def test_non_loopback_target_is_refused(tmp_path):
    done = loadtest(
        "--url", "http://192.168.1.20:8000", "--scenario", "L7", "--out", str(tmp_path / "r.json")
    )
    assert done.returncode == 2 and "loopback" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "r.json").exists()


def test_unknown_scenario_is_refused(tmp_path):
    done = loadtest("--scenario", "L1,Z9", "--out", str(tmp_path / "r.json"))
    assert done.returncode == 2 and "Z9" in done.stderr and "Traceback" not in done.stderr
