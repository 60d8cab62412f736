"""Every command answers --help, and bad arguments fail with a clear message, not a traceback."""

import subprocess
import sys

import pytest


def ultrafast(*args):
    return subprocess.run([sys.executable, "-m", "ultrafast.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["bench"], ["convert"]])
def test_help(command):
    done = ultrafast(*command, "--help")
    assert done.returncode == 0 and "usage: ultrafast" in done.stdout


def test_missing_model_is_a_clear_error(tmp_path):
    done = ultrafast("generate", "x", "--model", str(tmp_path / "nope"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_convert_refuses_a_non_model_directory(tmp_path):
    done = ultrafast("convert", str(tmp_path), str(tmp_path / "x.gguf"))
    assert done.returncode != 0 and "Traceback" not in done.stderr


def test_spec_flags(tmp_path):
    done = ultrafast("generate", "def f(x):", "--max-tokens", "12", "--spec", "ngram",
                     "--spec-tiers", "priority,default", "--threads", "1", "--stats")
    assert done.returncode == 0, done.stderr
    assert "spec ngram:" in done.stderr and "drafts accepted" in done.stderr
    done = ultrafast("generate", "x", "--spec-tiers", "turbo")
    assert done.returncode == 2 and "unknown spec tier" in done.stderr
    done = ultrafast("generate", "x", "--spec", "draft", "--draft-model", str(tmp_path / "nope"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr
