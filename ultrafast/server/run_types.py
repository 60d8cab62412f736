"""What a call's run is given and what it yields: the spec the HTTP layer decided, the events a
front end reads (`ChoiceDelta`, `Ping`), and the one error a failed run ends with."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ultrafast.request import SamplingParams, ServiceTier
from ultrafast.server.errors import APIError

if TYPE_CHECKING:
    from ultrafast.grammar.matcher import GrammarRuntime
    from ultrafast.server.tools.plan import ToolPlan

ENGINE_FAILED = "engine_error"


@dataclass
class GenerationSpec:
    """A generation's plan: everything the HTTP layer decided about a call, in engine terms
    plus output options (its run is server/generate.py's GenerationRun)."""

    request_id: str
    model_name: str
    prompts: list[list[int]]  # completions may batch prompts; choice = prompt * n + i
    params: SamplingParams
    n: int
    tier: ServiceTier
    stops: list[str]
    chat: bool
    stream: bool
    include_usage: bool
    want_logprobs: bool
    tenant: str = ""
    echo_texts: list[str] | None = None  # completions `echo`: prompt text, one per prompt
    arrival_s: float = 0.0
    prediction_token_ids: list[int] | None = None  # chat `prediction`: drafts for every choice
    tools: ToolPlan | None = None  # the text splits into content + tool calls
    # special tokens whose text the output keeps (a tool format's trigger token); others skipped
    keep_token_ids: frozenset[int] = frozenset()
    # the compile of params.grammar when it may still be running
    grammar_compile: Future[None] | None = None
    # the model's grammar.matcher.GrammarRuntime: is an answer a stop string cut complete?
    grammar_runtime: GrammarRuntime | None = None


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice: text (after stop strings and the guard), its logprobs, and
    the finish reason when the choice ended ("error": the engine failed it)."""

    index: int
    text: str
    logprobs: list
    finish: str | None = None
    tool_events: tuple = ()  # server/tools/parse.py events: call start, argument text, call end


@dataclass(frozen=True)
class Ping:
    """No output for a ping interval: streams send a keep-alive."""


RunEvent = ChoiceDelta | Ping


def run_error(code: str) -> APIError:
    """The error a call ends with when its run failed: the engine failed a choice
    (`engine_error`), or the answer could not be stored (the commit's code)."""
    if code == ENGINE_FAILED:
        return APIError(500, "the engine failed while generating", "server_error", code, None)
    return APIError(
        503,
        "the answer could not be stored in the session store",
        "server_error",
        code,
        None,
        headers={"Retry-After": "1"},
    )
