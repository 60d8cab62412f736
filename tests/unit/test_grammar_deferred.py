"""The grammar runtime built after ready (grammar/deferred.py): a constrained request that
arrives before it is built waits for it and gets the same answer as with a runtime built up
front; plain requests never wait for it; a build that fails refuses constrained requests with
a 400, never a 500. Fake executor over the demo vocabulary, as test_grammar_overlap.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.unit.engine_driver import run_all
from tests.unit.test_grammar_engine import SCHEMA, SPEC, engine, request, text
from tests.unit.test_grammar_engine import runtime as runtime  # noqa: F401 (fixture)
from tests.unit.test_grammar_engine import tok as tok  # noqa: F401 (fixture)
from tests.unit.test_grammar_overlap import step_until
from ultrafast.engine.thread import EngineThread
from ultrafast.grammar.cache import GrammarError
from ultrafast.grammar.deferred import DeferredGrammarRuntime
from ultrafast.grammar.matcher import GrammarRuntime
from ultrafast.grammar.tokenizer import GrammarUnavailable
from ultrafast.llm import build_grammar
from ultrafast.server import structured
from ultrafast.server.errors import APIError


class GatedBuild:
    """Builds the real runtime when `go` is set; counts the builds."""

    def __init__(self, tok):
        self.tok, self.go, self.builds = tok, threading.Event(), 0

    def __call__(self) -> GrammarRuntime:
        assert self.go.wait(10)
        self.builds += 1
        return GrammarRuntime.for_tokenizer(self.tok, self.tok.vocab_size)


def test_a_constrained_request_before_the_build_waits_and_gets_the_same_answer(
    tok,
    runtime,  # noqa: F811
):
    want, _ = run_all(engine(tok, runtime)[0], [request(tok, "c")])
    build = GatedBuild(tok)
    deferred = DeferredGrammarRuntime(build)
    core, _ = engine(tok, deferred)
    with ThreadPoolExecutor(2) as pool:
        slow = request(tok, "c")
        slow.grammar_pending = deferred.start_compile(SPEC, pool)  # as the server does
        core.add_request(slow)
        core.add_request(request(tok, "free", None, max_tokens=12))
        outputs: dict = {}
        # the plain request is answered while the grammar runtime is not built
        step_until(core, outputs, lambda: "finished:free" in outputs)
        assert not deferred.built and build.builds == 0 and deferred.compiles_running == 1
        assert not outputs.get("c")
        build.go.set()
        step_until(core, outputs, lambda: not core.has_work())
    assert outputs["c"] == want["c"] and outputs["finished:c"] == ["stop"]
    jsonschema.validate(json.loads(text(tok, outputs["c"])), SCHEMA)
    assert build.builds == 1 and deferred.compiles_running == 0
    deferred.start()  # built already: nothing more
    assert build.builds == 1


def test_start_builds_in_the_background_once(tok):
    build = GatedBuild(tok)
    deferred = DeferredGrammarRuntime(build)
    deferred.start()
    build.go.set()
    built = GrammarRuntime.for_tokenizer(tok, tok.vocab_size)
    assert deferred.max_token_bytes == built.max_token_bytes
    assert build.builds == 1


def _unavailable() -> GrammarRuntime:
    raise GrammarUnavailable("llguidance cannot use this tokenizer: test")


def test_a_failed_build_refuses_constrained_requests_with_a_400():
    deferred = DeferredGrammarRuntime(_unavailable)
    with pytest.raises(APIError) as info:
        asyncio.run(structured.compile_grammar(deferred, SPEC, "response_format.json_schema"))
    assert (info.value.status, info.value.code) == (400, "unsupported_parameter")
    assert deferred.max_token_bytes is None  # the answer-fits check is skipped, no 500
    with pytest.raises(GrammarError):  # the engine drops that request alone
        deferred.matcher(SPEC, ())


def test_build_grammar_defers_only_when_asked(tok):
    assert isinstance(build_grammar(tok, tok.vocab_size, deferred=True), DeferredGrammarRuntime)
    assert isinstance(build_grammar(tok, tok.vocab_size), GrammarRuntime)


def test_the_engine_builds_it_when_first_idle_and_only_then(tok):
    build = GatedBuild(tok)
    build.go.set()
    deferred = DeferredGrammarRuntime(build)
    core, _ = engine(tok, deferred)
    assert not deferred.started  # nothing built while the engine is made
    assert not core.grammar_stage.build_when_idle()  # nor at once: a first request goes first
    assert not deferred.started
    core.grammar_stage._build_after_s = time.monotonic()  # (DEFERRED_BUILD_AFTER_S later)
    thread = EngineThread(core).start()
    try:
        deadline = time.monotonic() + 10
        while not deferred.built and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        thread.stop()
    assert deferred.built and build.builds == 1
    assert not core.grammar_stage.build_when_idle()  # once
    plain, _ = engine(tok, GrammarRuntime.for_tokenizer(tok, tok.vocab_size))
    assert not plain.grammar_stage.build_when_idle()  # a runtime built up front: nothing


def test_a_plain_request_does_not_build_it():
    """The answer-fits check reads the grammar runtime only for a constrained request: the
    first plain answer once built it on the event loop (0.3-0.5 s of its TTFT)."""
    from types import SimpleNamespace

    from ultrafast.request import SamplingParams
    from ultrafast.server.calls import _check_answer_fits

    deferred = DeferredGrammarRuntime(lambda: pytest.fail("built for a plain request"))
    runtime = SimpleNamespace(grammar=deferred)
    plain = SimpleNamespace(params=SamplingParams(), max_tokens_param="max_tokens")
    _check_answer_fits(runtime, plain, 16)
    assert not deferred.started
