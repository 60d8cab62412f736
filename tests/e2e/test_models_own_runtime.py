"""Each model of `--models` answers with its own runtime (server/runtime.py, issue 31 item 1):
/tokenize and /detokenize use the named model's tokenizer, and a Responses call uses the
named model's limits (its sampling defaults) and names that model. The second model is
SmolLM2 (another vocabulary than the demo model's), with a sampling sidecar of its own
that makes its default sampling greedy (top_k 1)."""

from __future__ import annotations

import json

import httpx
import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.model_defaults import sidecar_path
from ultrafast.model_files import load_tokenizer, resolve_model
from ultrafast_harness.bench.server_process import ServerProcess

TEXT = "Tokenizers differ: the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def two_vocabularies(tmp_path_factory):
    from tests.model.gguf_files import require_smollm2

    folder = tmp_path_factory.mktemp("smol")
    smol = folder / "smol.gguf"
    smol.symlink_to(require_smollm2())
    # this copy's own defaults: top_k 1 makes any temperature pick the most likely token
    sidecar_path(smol).write_text(json.dumps({"top_k": 1}), encoding="utf-8")
    srv = ServerProcess(
        "--models",
        f"code={DEMO_MODEL_DIR},smol={smol}",
        "--threads",
        "1",
        model=None,
        num_slots=2,
        max_model_len=512,
    )
    yield srv, smol
    srv.stop()


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=120)


def test_tokenize_uses_the_named_models_tokenizer(two_vocabularies):
    srv, smol = two_vocabularies
    own = load_tokenizer(resolve_model(smol)).encode(TEXT)
    demo = load_tokenizer(resolve_model(DEMO_MODEL_DIR)).encode(TEXT)
    assert own != demo  # the two vocabularies tell the models apart
    r = post(srv, "/tokenize", {"model": "smol", "prompt": TEXT})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == own
    assert post(srv, "/tokenize", {"prompt": TEXT}).json()["tokens"] == demo  # the default
    assert post(srv, "/tokenize", {"model": "code", "prompt": TEXT}).json()["tokens"] == demo
    back = post(srv, "/detokenize", {"model": "smol", "tokens": own})
    assert back.status_code == 200 and TEXT in back.json()["prompt"]
    for path, body in (("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [1]})):
        r = post(srv, path, {**body, "model": "nope"})
        error = r.json()["error"]
        assert r.status_code == 404 and error["code"] == "model_not_found", r.text
        assert error["param"] == "model" and "'nope'" in error["message"]
    r = post(srv, "/tokenize", {"prompt": TEXT, "model": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_responses_use_the_named_models_limits(two_vocabularies):
    srv, _ = two_vocabularies
    body = {"model": "smol", "input": "Name three colours.", "max_output_tokens": 16}
    body["store"] = False
    greedy = post(srv, "/v1/responses", {**body, "temperature": 0})
    hot = post(srv, "/v1/responses", {**body, "temperature": 2.0})
    assert greedy.status_code == 200 and hot.status_code == 200, (greedy.text, hot.text)
    assert hot.json()["model"] == "smol"
    # the model's own top_k 1 (its sidecar): a hot temperature still gives the greedy text;
    # the default model's limits (no top_k) would sample the whole vocabulary at 2.0
    texts = [r.json()["output"][0]["content"][0]["text"] for r in (greedy, hot)]
    assert texts[0] and texts[1] == texts[0]
