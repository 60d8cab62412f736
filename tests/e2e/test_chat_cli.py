"""`ultrafast chat MODEL` in-process, as a user runs it (a child process, lines on stdin): it
answers each turn and leaves at /bye; a model without a chat template is refused at start,
naming --chat-template, and chats with one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from ultrafast.config import DEMO_MODEL_DIR

FAST = ["--threads", "1", "--batch-threads", "1", "--max-tokens", "4", "--temperature", "0"]


def run_chat(*argv: str, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "chat", *argv, *FAST],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_chat_answers_each_turn_and_leaves_at_bye():
    done = run_chat(str(DEMO_MODEL_DIR), stdin="def f(x):\ndef g(y):\n/bye\nnot read\n")
    assert done.returncode == 0, done.stderr
    # a prompt per turn, then the one /bye answered: nothing after it was read
    assert done.stdout.count(">>> ") == 3, done.stdout
    assert done.stdout.replace(">>> ", "").strip(), done.stdout  # the answers' text


def test_a_model_without_a_template_needs_the_flag(tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(DEMO_MODEL_DIR, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    refused = run_chat(str(bare), stdin="hello\n")
    assert refused.returncode == 2 and "--chat-template" in refused.stderr
    done = run_chat(str(bare), "--chat-template", "chatml", stdin="def f(x):\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.replace(">>> ", "").strip()
