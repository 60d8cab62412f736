"""One call pipeline for every API: a typed `CallInput` in, an admitted `GenerationRun` out.

Each front end only translates its own wire format into a `CallInput`: chat completions and
completions (`chat_call`, `completion_call`, from the validated protocol models), the Responses
API and the Realtime WebSocket (frontends/responses.py, frontends/realtime.py, which build it
from their own fields and join the stored history into `messages` first). From here the work
is the same for all, in this order: model and readiness checks, a lease on the model's
runtime (server/runtime.py: its tokenizer, limits, admission, engine), tier entitlement, the
tenant's request budget, tier capacity (503 before any tokenizing), template + tokenize off
the event loop (a stored answer keeps its own ids, prompt/chat_tokens.py), the context check,
the tenant's token budget, SLO admission from the tokens left to prefill (429 for a priority
call that would miss its target), then the run (generate.py), not yet started.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.types import Scope

from ultrafast.grammar.schema_check import SchemaProblem
from ultrafast.request import SamplingChoice, SamplingParams, ServiceTier
from ultrafast.server import auth
from ultrafast.server.access_log import note_run
from ultrafast.server.errors import APIError, bad_request, invalid_value
from ultrafast.server.generate import GenerationRun, GenerationSpec
from ultrafast.server.prompt import ChatMessage, encode_chat
from ultrafast.server.protocol import ChatCompletionRequest, CompletionRequest, Limits
from ultrafast.server.residency.budget import parse_keep_alive
from ultrafast.server.runtime import ModelRuntime
from ultrafast.server.state import ServerState, check_generates, check_model, check_ready
from ultrafast.server.structured import json_format_grammar, start_compile, wait_compiled
from ultrafast.server.tools.plan import ToolPlan, chat_tool_plan
from ultrafast.tokenizer import ChatTemplateError, NoChatTemplateError


@dataclass
class CallInput:
    """One generation call in the server's terms, built by a front end. Param names say which
    of the front end's own fields an error must name (`max_output_tokens`, `input`)."""

    chat: bool  # chat template over `messages`, else `prompts` as they are
    params: SamplingChoice  # made SamplingParams here, with `max_tokens` below or the room
    max_tokens: int | None = None  # the client's limit, None: the context left, capped
    messages: list[ChatMessage] = field(default_factory=list)  # history + new turn(s)
    prompts: list[Any] = field(default_factory=list)  # completions: str or token-id lists
    model: str | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stops: list[str] = field(default_factory=list)
    tier: ServiceTier = ServiceTier.DEFAULT
    auto_tier: bool = False  # "auto": priority when it can be had, else default
    tier_named: bool = True  # False: the call named no tier (the key's default_tier serves it)
    echo: bool = False  # completions: the prompt text leads each choice
    prediction_text: str | None = None  # chat `prediction`: drafts for the engine
    request_id: str | None = None  # the front end's id for the call (e.g. resp_...)
    tools: ToolPlan | None = None  # function tools (server/tools/): prompt, grammar, parser
    tier_param: str = "service_tier"
    prompt_param: str = "messages"
    max_tokens_param: str = "max_tokens"
    keep_alive: Any = None  # Ollama's extension: how long the model stays loaded after the call
    # what a grammar (params.grammar) that does not compile is reported as
    grammar_param: str = "response_format"


# ---- chat completions / completions: from their validated protocol models -------------------


def chat_call(
    req: ChatCompletionRequest, limits: Limits, messages: list[ChatMessage] | None = None
) -> CallInput:
    """`messages` replaces the request's own (a session's history joined with the new turn)."""
    params = req.sampling_choice(limits.vocab_size, limits.sampling_defaults)
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema
        params = replace(
            params,
            grammar=json_format_grammar(
                fmt.type,
                schema.schema_ if schema else None,
                schema.strict if schema else None,
                "response_format.json_schema.schema",
            ),
        )
    return CallInput(
        chat=True,
        params=params,
        messages=messages if messages is not None else chat_messages(req),
        **_common_fields(req),
        prediction_text=req.prediction_text() or None,
        tools=chat_tool_plan(req),
        max_tokens_param="max_completion_tokens"
        if req.max_completion_tokens is not None
        else "max_tokens",
        grammar_param="response_format.json_schema.schema"
        if fmt is not None and fmt.type == "json_schema"
        else "response_format",
    )


def completion_call(req: CompletionRequest, limits: Limits) -> CallInput:
    return CallInput(
        chat=False,
        params=req.sampling_choice(limits.vocab_size, limits.sampling_defaults),
        prompts=req.prompt_list(),
        **_common_fields(req),
        echo=req.echo,
        prompt_param="prompt",
    )


def _common_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The CallInput fields both OpenAI endpoints read from their request the same way."""
    return {
        "max_tokens": req.requested_max_tokens(),
        "model": req.model,
        "n": req.n,
        "stream": bool(req.stream),
        "include_usage": req.include_usage(),
        "stops": req.stop_list(),
        "tier": req.tier(),
        "auto_tier": req.tier_is_auto(),
        "tier_named": req.requested_tier_name() is not None,
        "keep_alive": req.keep_alive,
        "tier_param": "service_tier" if req.service_tier is not None else "priority",
    }


def chat_messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    return [
        ChatMessage(
            m["role"],
            m["content"],
            extra={k: v for k, v in m.items() if k not in ("role", "content")},
        )
        for m in req.messages_for_template()
    ]


# ---- the other front ends: their own field names, the same limits ----------------------------


def check_options(
    limits: Limits,
    *,
    temperature: float | None,
    top_p: float | None,
    max_tokens: int | None,
    max_tokens_param: str,
    service_tier: object = None,
) -> tuple[ServiceTier, bool]:
    """Ranges of the sampling fields the Responses and Realtime APIs carry, named as they
    name them; returns the requested tier and whether it was "auto"."""
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens_cap:
        raise invalid_value(
            max_tokens_param,
            f"{max_tokens_param} must be between 1 and "
            f"{limits.max_tokens_cap} (the cap for this key)",
        )
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise invalid_value("temperature", "temperature must be in [0.0, 2.0]")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise invalid_value("top_p", "top_p must be in (0.0, 1.0]")
    if service_tier is None:
        return ServiceTier.DEFAULT, False
    try:
        tier = ServiceTier.parse(service_tier if isinstance(service_tier, str) else "?")
    except ValueError:
        raise invalid_value(
            "service_tier", "service_tier must be one of auto, default, flex, priority, ultrafast"
        ) from None
    return tier, service_tier == "auto"


def plain_params(temperature: float | None, top_p: float | None, limits: Limits) -> SamplingChoice:
    """Responses / Realtime: what the client set, else the model's defaults, else OpenAI's."""
    model = dict(limits.sampling_defaults)
    return SamplingChoice(
        temperature=model.get("temperature", 1.0) if temperature is None else temperature,
        top_p=model.get("top_p", 1.0) if top_p is None else top_p,
        top_k=int(model.get("top_k", 0)) if 0 < model.get("top_k", 0) < limits.vocab_size else 0,
        min_p=model.get("min_p", 0.0),
        repetition_penalty=model.get("repetition_penalty", 1.0),
    )


# ---- the pipeline ------------------------------------------------------------------------------


async def prepare_call(state: ServerState, scope: Scope, call: CallInput) -> GenerationRun:
    """Check, tokenize and admit one call; the run is not started (the caller starts it, and
    must `finish()` it). `scope` is the HTTP or WebSocket scope (its tenant). The call first
    takes a lease on its model's runtime (server/runtime.py: with several models, loading it
    if need be) and runs on it; the lease ends with the run."""
    keep_alive = _keep_alive_seconds(call.keep_alive)
    check_generates(state, call.model)
    check_model(state, call.model)
    check_ready(state)
    runtime, release = await state.models.lease(
        call.model, keep_alive, state.config.max_stream_buffer_events
    )
    try:
        run = await _prepare_on(state, runtime, scope, call)
    except BaseException:
        release()
        raise
    run.on_finish(lambda _run: release())
    note_run(scope, run)  # the request's access-log line counts its tokens
    return run


def _keep_alive_seconds(value: Any) -> float | None | bool:
    """The request's keep_alive in seconds (None: forever), False when it sent none."""
    if value is None:
        return False
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise invalid_value("keep_alive", str(exc)) from None


async def _prepare_on(
    state: ServerState, runtime: ModelRuntime, scope: Scope, call: CallInput
) -> GenerationRun:
    arrival_s = time.monotonic()
    request_id = call.request_id or ("chatcmpl-" if call.chat else "cmpl-") + uuid.uuid4().hex[:24]
    tenant = auth.tenant_of(scope)
    asked, auto = call.tier, call.auto_tier
    if not call.tier_named:
        asked, auto = auth.unnamed_tier(scope, asked, auto)
    tier, auto = auth.entitled_tier(tenant, asked, auto, call.tier_param, state.auth_refused)
    auth.take_request(tenant, state.auth_refused)
    ticket = runtime.admission.reserve(tier, auto=auto, tenant=tenant.name)
    try:
        prep = await _tokenized(state, runtime, call, arrival_s)
        return await _admitted(state, runtime, call, prep, tenant, ticket, auto, request_id)
    except BaseException:
        runtime.admission.release(ticket)
        raise


@dataclass
class _Prepared:
    """A call's prompts and grammar, before its admission."""

    prompts: list[list[int]]
    plan: ToolPlan | None
    grammar: Any  # the GrammarSpec the output must follow (tools, response_format), or None
    grammar_param: str
    compiling: Any  # the grammar's compile, running off the event loop (structured.py)
    arrival_s: float
    prediction_ids: list[int] | None = None
    echo: list[str] | None = None


def _grammar(
    state: ServerState, runtime: ModelRuntime, call: CallInput
) -> tuple[ToolPlan | None, Any, str]:
    """The call's tool plan, and the grammar its output follows: the calls' grammar
    (tools/grammar.py) is calls OR the response_format's answer (free text when there is
    none); `none` bans the call trigger unless a response_format grammar shapes the answer."""
    tok = runtime.tokenizer
    plan = (
        None
        if call.tools is None
        else call.tools.for_template(tok.chat_template, tok.special_tokens)
    )
    grammar, grammar_param = call.params.grammar, call.grammar_param
    if plan is not None:
        plan = plan.capped(state.config.max_tool_calls)
        try:
            tool_grammar = plan.grammar(grammar)
        except SchemaProblem as problem:
            raise bad_request(problem.code, problem.param("tools"), str(problem)) from None
        if tool_grammar is not None and tool_grammar is not grammar:
            grammar = tool_grammar
            if call.params.grammar is None:
                grammar_param = "tools"
    return plan, grammar, grammar_param


async def _tokenized(
    state: ServerState, runtime: ModelRuntime, call: CallInput, arrival_s: float
) -> _Prepared:
    """Grammar compile started, then template + tokenize off the event loop."""
    plan, grammar, grammar_param = _grammar(state, runtime, call)
    if plan is None or not plan.calls_allowed:  # before its compile takes a thread
        _check_answer_fits(runtime, call, call.max_tokens or state.config.max_tokens_cap)
    # off the event loop and the engine thread, time-capped: it runs while the prompt is
    # tokenized and prefilled, and is awaited before the run is handed back
    compiling = None if grammar is None else start_compile(runtime.grammar, grammar, grammar_param)
    prep = _Prepared([], plan, grammar, grammar_param, compiling, arrival_s)
    loop, tok = asyncio.get_running_loop(), runtime.tokenizer
    if call.chat:
        messages, template_vars = call.messages, dict[str, Any]()
        if plan is not None:  # tools into the prompt, in the model's format or ours
            messages, template_vars = plan.render(call.messages)
        try:
            prep.prompts = [
                await loop.run_in_executor(state.pool, encode_chat, tok, messages, template_vars)
            ]
        except ChatTemplateError as exc:  # no template, or one that raised: the caller's 400
            raise template_error(exc, call.prompt_param) from None
        if call.prediction_text:  # predicted outputs: the engine drafts from these ids
            prep.prediction_ids = await loop.run_in_executor(
                state.pool, tok.encode, call.prediction_text, False
            )
    else:
        prep.prompts = await loop.run_in_executor(
            state.pool, _completion_prompts, tok, call.prompts
        )
        prep.echo = [tok.decode(p) for p in prep.prompts] if call.echo else None
    if not prep.prompts or not all(prep.prompts):
        raise APIError(
            400, "the prompt is empty", "invalid_request_error", "invalid_value", call.prompt_param
        )
    return prep


async def _admitted(
    state: ServerState,
    runtime: ModelRuntime,
    call: CallInput,
    prep: _Prepared,
    tenant: auth.Tenant,
    ticket: Any,
    auto: bool,
    request_id: str,
) -> GenerationRun:
    """The context check, the tenant's token budget, SLO admission, then the run."""
    prompts = prep.prompts
    max_tokens = _resolve_max_tokens(state, runtime, call, max(len(p) for p in prompts))
    if prep.plan is None or not prep.plan.calls_allowed:
        _check_answer_fits(runtime, call, max_tokens)
    params = call.params.with_budget(max_tokens, grammar=prep.grammar)
    num_prompt_tokens = sum(len(p) for p in prompts) * call.n
    num_tokens_taken = auth.take_tokens(
        tenant, num_prompt_tokens + max_tokens * len(prompts) * call.n, state.auth_refused
    )
    try:
        # admission predicts TTFT from the tokens left to prefill, not the cached history;
        # a scoring call (prompt logprobs) takes no cached prefix, so all of it
        if params.prompt_logprobs is not None:
            num_new = sum(len(p) for p in prompts)
        else:
            num_new = await asyncio.get_running_loop().run_in_executor(
                state.pool, _num_uncached, runtime, prompts, tenant.name
            )
        runtime.admission.admit(ticket, num_new * call.n, auto)
    except APIError:
        _refund_tokens(tenant, num_tokens_taken, 0)
        raise
    run = GenerationRun(
        state.run_deps(runtime),
        _spec(runtime, call, prep, params, ticket, request_id, tenant),
        ticket,
    )
    if num_tokens_taken:
        run.on_finish(
            lambda r: _refund_tokens(
                tenant, num_tokens_taken, num_prompt_tokens + sum(r.num_output_tokens)
            )
        )
    if prep.compiling is not None:
        await _await_compile(run, prep.compiling, prep.grammar_param)
    return run


def _spec(
    runtime: ModelRuntime,
    call: CallInput,
    prep: _Prepared,
    params: SamplingParams,
    ticket: Any,
    request_id: str,
    tenant: auth.Tenant,
) -> GenerationSpec:
    plan = prep.plan
    return GenerationSpec(
        request_id=request_id,
        model_name=runtime.name,
        prompts=prep.prompts,
        params=params,
        n=call.n,
        tier=ticket.tier,
        stops=call.stops,
        chat=call.chat,
        stream=call.stream,
        include_usage=call.include_usage,
        want_logprobs=params.logprobs,
        echo_texts=prep.echo,
        arrival_s=prep.arrival_s,
        prediction_token_ids=prep.prediction_ids,
        tenant=tenant.name,
        tools=plan,
        keep_token_ids=frozenset() if plan is None else plan.keep_token_ids,
        grammar_compile=prep.compiling,
        grammar_runtime=None if prep.grammar is None else runtime.grammar,
    )


async def _await_compile(run: GenerationRun, compiling, param: str) -> None:
    """A grammar still compiling: start the run, so the engine prefills the prompt (all but
    the token whose logits need the grammar) meanwhile, then wait. A compile that fails or
    runs past the cap ends the run and answers 400, before any response byte."""
    if not compiling.done():
        run.start()
    try:
        await wait_compiled(compiling, param)
    except BaseException:
        run.finish()
        raise


def template_error(exc: ChatTemplateError, param: str) -> APIError:
    code = "no_chat_template" if isinstance(exc, NoChatTemplateError) else "chat_template_error"
    return APIError(400, str(exc), "invalid_request_error", code, param)


def _resolve_max_tokens(
    state: ServerState, runtime: ModelRuntime, call: CallInput, num_prompt: int
) -> int:
    room = runtime.max_model_len - num_prompt
    if room <= 0:
        raise APIError(
            400,
            f"the prompt has {num_prompt} tokens but this model's context is "
            f"{runtime.max_model_len} tokens",
            "invalid_request_error",
            "context_length_exceeded",
            call.prompt_param,
        )
    if call.max_tokens is None:  # the server's default output cap (--max-tokens; 0: none)
        return min(room, state.config.max_tokens_cap, state.config.default_max_tokens or room)
    if call.max_tokens > room:
        raise APIError(
            400,
            f"{call.max_tokens_param}={call.max_tokens} plus the prompt's "
            f"{num_prompt} tokens exceeds this model's context of "
            f"{runtime.max_model_len} tokens",
            "invalid_request_error",
            "context_length_exceeded",
            call.max_tokens_param,
        )
    return call.max_tokens


def _check_answer_fits(runtime: ModelRuntime, call: CallInput, max_tokens: int) -> None:
    """400 naming the schema keyword when the shortest answer the schema allows cannot fit in
    the token budget even at the vocabulary's longest token: it would only end cut."""
    spec = call.params.grammar
    if spec is None or not spec.min_chars:  # (a deferred grammar runtime is not built for it)
        return
    longest = getattr(runtime.grammar, "max_token_bytes", None)
    if not isinstance(longest, int):
        return
    if spec.min_chars > max_tokens * longest:
        chars = "unbounded" if spec.min_chars == float("inf") else f"{spec.min_chars:.0f}"
        raise APIError(
            400,
            f"the shortest answer this schema allows has {chars} characters "
            f"(from {spec.min_path or 'the schema'}); {call.max_tokens_param}={max_tokens} "
            f"tokens hold at most {max_tokens * longest}",
            "invalid_request_error",
            "grammar_unsatisfiable",
            f"{call.grammar_param}.{spec.min_path}" if spec.min_path else call.grammar_param,
        )


def _num_uncached(runtime: ModelRuntime, prompts: list[list[int]], tenant: str) -> int:
    engine = runtime.live
    return sum(len(p) - engine.cached_prefix_tokens(p, tenant) for p in prompts)


def _refund_tokens(tenant: auth.Tenant, num_taken: int, num_used: int) -> None:
    """Give back the reserved tokens a call did not use (max_tokens is an upper bound)."""
    if tenant.token_bucket is not None and num_taken > num_used:
        tenant.token_bucket.give_back(num_taken - num_used)


def _completion_prompts(tokenizer, prompts: list[Any]) -> list[list[int]]:
    return [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
