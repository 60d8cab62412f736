"""The setup leaves the machine as it was: the tests' binaries come from the project's tool
folder (.tools/bin) before PATH, no setup step installs a system package or service, and
`make run ARGS=...` passes its arguments to `ultrafast serve` (local_tools.py, Makefile,
scripts/fetch_tools.sh)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ultrafast.local_tools import REPO_ROOT, find_tool

INSTALLS = ("apt-get install", "apt install", "dpkg -i", "systemctl", "update-rc.d")


def test_the_tool_folder_wins_over_path(tmp_path, monkeypatch):
    tool = tmp_path / "bin" / "redis-server"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o644)
    monkeypatch.setenv("ULTRAFAST_TOOLS_DIR", str(tmp_path))
    assert find_tool("redis-server") != str(tool)  # only an executable counts
    tool.chmod(0o755)
    assert find_tool("redis-server") == str(tool)
    assert find_tool("sh") == shutil.which("sh")  # not there: PATH


def dry_run(*targets: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        ["make", "-n", "-B", *targets],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_run_and_setup_install_no_system_package_and_pass_args():
    commands = dry_run("run", "ARGS=--port 9000 --host 127.0.0.1")
    assert "ultrafast serve --port 9000 --host 127.0.0.1" in commands
    for install in INSTALLS:
        assert install not in commands, install
    assert "chromium" not in commands  # the browser comes with `make test` only


def test_the_tools_are_unpacked_not_installed():
    assert "scripts/fetch_tools.sh" in dry_run("test-deps")
    script = (REPO_ROOT / "scripts" / "fetch_tools.sh").read_text()
    assert "apt-get download" in script and "dpkg -x" in script
    for install in INSTALLS:
        assert install not in script, install


def test_the_unpacked_redis_server_runs(monkeypatch):
    monkeypatch.delenv("ULTRAFAST_TOOLS_DIR", raising=False)
    tool = REPO_ROOT / ".tools" / "bin" / "redis-server"
    if not tool.is_file():
        pytest.skip(f"{tool} absent (make tools puts it there)")
    done = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "Redis server" in done.stdout
    assert find_tool("redis-server") == str(tool)  # the tests' RedisServer takes this one
