"""An answer whose grammar did not reach an accepting state never finishes `stop` (issue 29
item 2): the engine's grammar step turns it into `length` and logs it; a complete one stays
`stop`. On the real matcher of the demo vocabulary: a grammar that cannot go on (its lexer
refuses every token) ends with the EOS the mask then allows, and that is not accepting."""

from __future__ import annotations

import logging

import pytest

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.core.types import RequestOutput
from ultrafast.engine.grammar_steps import advance
from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.matcher import GrammarRuntime
from ultrafast.request import Request, RequestStatus, SamplingParams
from ultrafast.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "maxLength": 5}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def runtime(tok):
    return GrammarRuntime.for_tokenizer(tok, tok.vocab_size)


def finished(runtime, tok, text: str, end_with_eos: bool = True):
    spec = GrammarSpec.from_json_schema(SCHEMA)
    request = Request(
        "r", [1, 2], SamplingParams(max_tokens=50, grammar=spec), eos_token_ids=tok.eos_token_ids
    )
    request.grammar_matcher = runtime.matcher(spec, tok.eos_token_ids)
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]] * end_with_eos
    request.status = RequestStatus.FINISHED_STOPPED
    output = RequestOutput("r", ids, finished=True, finish_reason="stop")
    advance([output], {"r": request})
    return output, request


def test_complete_answer_stays_stop(runtime, tok):
    output, request = finished(runtime, tok, '{"a":"hi"}')
    assert output.finish_reason == "stop" and request.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("text", ['{"', '{"a":"toolongvalue', "no json"])
def test_unfinished_answer_ends_length_and_is_logged(runtime, tok, text, caplog):
    with caplog.at_level(logging.WARNING, logger="ultrafast.engine.grammar_steps"):
        output, request = finished(runtime, tok, text)
    assert output.finish_reason == "length" and request.status == RequestStatus.FINISHED_LENGTH
    assert "did not reach an accepting state" in caplog.text
