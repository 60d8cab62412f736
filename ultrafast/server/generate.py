"""One API call's generation: n engine requests, detokenizing, stop strings, SSE or one JSON body.

The HTTP response starts only when the first token exists, so an error before that is a plain
OpenAI error response, and the timing headers (queue wait, TTFT) are real. After the first
byte, a failure becomes an SSE error event followed by [DONE].
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ultrafast.core.scheduler import RequestOutput
from ultrafast.request import Request, SamplingParams, ServiceTier
from ultrafast.server import openai_format as fmt
from ultrafast.server.admission import Ticket
from ultrafast.server.bridge import Generation
from ultrafast.server.errors import APIError
from ultrafast.server.guard import CONTENT_FILTER, GuardedChoice
from ultrafast.tokenizer import StopStringMatcher


@dataclass
class GenerationSpec:
    """Everything the HTTP layer decided about a call, in engine terms plus output options."""

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


class GenerationRun:
    def __init__(self, state, spec: GenerationSpec, ticket: Ticket):
        self.state = state
        self.spec = spec
        self.ticket = ticket
        tok = state.tokenizer
        requests, self.choice_prompts = [], []
        for p, prompt in enumerate(spec.prompts):
            for i in range(spec.n):
                params = spec.params
                if params.seed is not None and i:
                    params = replace(params, seed=params.seed + i)  # n choices must differ
                requests.append(Request(f"{spec.request_id}-{p}-{i}", list(prompt), params,
                                        tier=spec.tier, tenant=spec.tenant,
                                        arrival_time_s=spec.arrival_s,
                                        eos_token_ids=tok.eos_token_ids,
                                        prediction_token_ids=list(spec.prediction_token_ids
                                                                  or [])))
                self.choice_prompts.append(p)
        num_choices = len(requests)
        self.generation = Generation(state.bridge, requests)
        echo = spec.echo_texts or [""] * len(spec.prompts)
        self.choices = [fmt.ChoiceState(c, text=echo[self.choice_prompts[c]])
                        for c in range(num_choices)]
        for choice in self.choices:  # echo: the generated text's offsets start after it
            choice.echo_chars = len(choice.text)
            if self.scores_prompt:
                choice.prompt_token_ids = spec.prompts[self.choice_prompts[choice.index]]
        self.detoks = [tok.detokenizer(spec.prompts[self.choice_prompts[c]])
                       for c in range(num_choices)]
        self.matchers = [StopStringMatcher(spec.stops) for _ in range(num_choices)]
        self.num_output_tokens = [0] * num_choices
        self.num_prediction_tokens = [(0, 0)] * num_choices  # (accepted, rejected) per choice
        self.first_token_s: float | None = None
        self.queue_time_s = 0.0
        # Session commit (server/session_flow.py): awaited with reason None before the last
        # event or the JSON body, or scheduled from finish() if the run ended early (client
        # left); returns an error code when the commit could not be made.
        self.on_complete = None
        self._completed = False
        self.timer = state.metrics.request_timer(spec.tier, spec.tenant, spec.arrival_s)
        guard = state.guard  # None: text goes out as soon as it exists
        self.guarded = None if guard is None else [GuardedChoice(guard) for _ in self.choices]
        self._released = [[len(c.text), 0] for c in self.choices]  # chars, logprobs sent
        self.on_finish = []  # callbacks(run) when the call ends: rate-limit refunds

    def _apply(self, index: int, out: RequestOutput) -> tuple[str, list, str | None]:
        """Fold one engine output into choice `index`; returns (text delta, logprobs, finish)."""
        choice = self.choices[index]
        if out.error is not None:
            choice.finish_reason, choice.error = "error", out.error
            return "", [], "error"
        self.num_output_tokens[index] = out.num_output_tokens
        self.num_prediction_tokens[index] = (out.num_accepted_prediction_tokens,
                                             out.num_rejected_prediction_tokens)
        choice.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        choice.token_ids.extend(out.new_token_ids)
        choice.logprobs.extend(out.new_logprobs)
        delta = self.detoks[index].push(out.new_token_ids)
        if out.finished:
            delta += self.detoks[index].flush()
        text, stopped = self.matchers[index].push(delta)
        finish = None
        if stopped:
            finish = "stop"
            self.generation.abort(index)
        elif out.finished:
            text += self.matchers[index].flush()
            finish = out.finish_reason
        choice.text += text
        if finish:
            choice.finish_reason = finish
        return text, out.new_logprobs, finish

    async def _outputs(self) -> AsyncIterator[tuple[int, str, list, str | None]]:
        """(choice, text delta, logprobs, finish) per engine output; (-1, ...) = keep-alive.

        Waits on the queue itself: cancelling a `queue.get()` on timeout is harmless, while
        cancelling a generator would run its cleanup and abort the requests.
        """
        gen = self.generation
        ping_s = self.state.config.sse_ping_interval_s
        while gen.unfinished:
            try:
                out = await asyncio.wait_for(gen.queue.get(), timeout=ping_s)
            except asyncio.TimeoutError:
                yield -1, "", [], None
                continue
            if out.request_id not in gen.unfinished:
                continue  # a choice we already ended (stop string), still draining
            if out.finished:
                gen.unfinished.discard(out.request_id)
            if self.first_token_s is None and (out.new_token_ids or out.finished):
                self.first_token_s = time.monotonic()
                self.queue_time_s = out.queue_time_s
                self.state.admission.first_token(self.ticket)
            index = gen.index_of[out.request_id]
            text, logprobs, finish = self._apply(index, out)
            num_tokens = len(out.new_token_ids)
            if self.guarded is not None:
                text, logprobs, num_tokens, finish = await self._guard(
                    index, text, logprobs, num_tokens, finish)
            self.timer.output(index, num_tokens, out.queue_time_s)
            yield index, text, logprobs, finish

    async def _guard(self, index: int, text: str, logprobs: list, num_tokens: int,
                     finish: str | None) -> tuple[str, list, int, str | None]:
        """Pass the choice's new text through its guard; on a hit, cut the choice there."""
        choice, released = self.choices[index], self._released[index]
        text, logprobs, num_tokens, blocked = await self.guarded[index].push(
            text, logprobs, num_tokens, finish is not None)
        if blocked:  # the response keeps only what was released; the held text is dropped
            choice.text = choice.text[:released[0]]
            del choice.logprobs[released[1]:]
            choice.finish_reason = CONTENT_FILTER
            self.state.metrics.guard_cuts.inc()
            self.generation.abort(index)
            return "", [], 0, CONTENT_FILTER
        released[0] += len(text)
        released[1] += len(logprobs)
        return text, logprobs, num_tokens, finish

    def usage(self) -> dict:
        prediction = None
        if self.spec.prediction_token_ids is not None:
            prediction = (sum(a for a, _ in self.num_prediction_tokens),
                          sum(r for _, r in self.num_prediction_tokens))
        return fmt.usage(sum(len(p) for p in self.spec.prompts),
                         sum(self.num_output_tokens),
                         min((c.num_cached_tokens for c in self.choices), default=0), prediction)

    def timing_headers(self) -> dict:
        ttft_ms = ((self.first_token_s or time.monotonic()) - self.spec.arrival_s) * 1000
        queue_ms = self.queue_time_s * 1000
        return {"x-request-id": self.spec.request_id, "x-service-tier": self.spec.tier.api_name,
                "x-queue-wait-ms": f"{queue_ms:.1f}", "x-ttft-ms": f"{ttft_ms:.1f}",
                "server-timing": f"queue;dur={queue_ms:.1f}, ttft;dur={ttft_ms:.1f}"}

    def finish(self) -> None:
        self.state.runs.discard(self)
        self.generation.abort_all()
        self.state.admission.release(self.ticket)
        self.timer.finish(sum(len(p) for p in self.spec.prompts) * self.spec.n,
                          sum(self.num_output_tokens))
        callbacks, self.on_finish = self.on_finish, []
        for callback in callbacks:
            callback(self)
        if self.on_complete is not None and not self._completed:
            self._completed = True  # the client left: store what was generated, as incomplete
            asyncio.ensure_future(self.on_complete(self, "client_disconnected"))

    async def complete(self) -> str | None:
        """Run the session commit (if any) once, at the normal end of the run."""
        if self.on_complete is None or self._completed:
            return None
        self._completed = True
        return await self.on_complete(self, None)

    @property
    def scores_prompt(self) -> bool:
        """Completions `echo` + `logprobs`: the response lists the prompt's logprobs first."""
        spec = self.spec
        return (bool(spec.echo_texts) and spec.want_logprobs
                and spec.params.prompt_logprobs is not None)

    # ---- non-streaming -----------------------------------------------------------------------

    def start(self) -> None:
        self.state.runs.add(self)
        self.generation.start()

    async def respond_json(self, http: HTTPRequest) -> Response:
        self.start()
        try:
            collect = asyncio.ensure_future(self._collect())
            while not collect.done():
                done, _ = await asyncio.wait({collect}, timeout=0.25)
                if not done and await http.is_disconnected():
                    collect.cancel()  # the client left: abort, free the slots
                    self.finish()
                    return Response(status_code=499)
            collect.result()
            errors = [c.error for c in self.choices if c.error]
            failed = None if errors else await self.complete()
        finally:
            self.finish()
        if errors:
            raise APIError(500, "the engine failed while generating", "server_error",
                           "engine_error", None)
        if failed:
            raise APIError(503, "the answer could not be stored in the session store",
                           "server_error", failed, None, headers={"Retry-After": "1"})
        build = fmt.chat_response if self.spec.chat else fmt.completion_response
        body = build(self.spec.request_id, self.spec.model_name, self.spec.tier.api_name,
                     self.choices, self.usage(), self.state.tokenizer.decode,
                     self.spec.want_logprobs)
        return JSONResponse(body, headers=self.timing_headers())

    async def _collect(self) -> None:
        async for _ in self._outputs():
            pass

    # ---- streaming ---------------------------------------------------------------------------

    async def respond_stream(self) -> Response:
        """Wait for the first token (errors before it are plain HTTP errors), then stream."""
        self.start()
        events = self._outputs().__aiter__()
        first: list = []
        try:
            # Headers wait for the first token (so they carry real timings), unless it takes
            # longer than a ping interval: then the stream starts with a keep-alive comment.
            first.append(await events.__anext__())
        except StopAsyncIteration:
            pass
        except BaseException:
            self.finish()
            raise
        if first and first[0][0] >= 0 and first[0][3] == "error" and len(self.choices) == 1:
            self.finish()
            raise APIError(500, "the engine failed before the first token", "server_error",
                           "engine_error", None)
        return StreamingResponse(self._sse(first, events), media_type="text/event-stream",
                                 headers={**self.timing_headers(), "cache-control": "no-cache"})

    async def _sse(self, first: list, events) -> AsyncIterator[bytes]:
        spec = self.spec
        writer = fmt.ChunkWriter(spec.request_id, spec.model_name, spec.tier.api_name, spec.chat,
                                 self.state.tokenizer.decode, spec.want_logprobs)
        try:
            # with prompt logprobs, a choice's echo waits for its first output, which has them
            echo_later = set(range(len(self.choices))) if self.scores_prompt else set()
            for choice in self.choices:
                if spec.chat:
                    yield writer.role(choice.index)
                elif spec.echo_texts and choice.index not in echo_later:
                    yield writer.echo(choice.index, spec.echo_texts[self.choice_prompts[
                        choice.index]], None)
            pending = list(first)
            while True:
                for index, text, logprobs, finish in pending:
                    if index in echo_later and finish != "error":
                        echo_later.discard(index)
                        yield writer.echo(index, spec.echo_texts[self.choice_prompts[index]],
                                          self.choices[index].prompt_part())
                    if index < 0:
                        yield b": ping\n\n"
                    elif finish == "error":
                        yield fmt.error_event("the engine failed while generating")
                        yield fmt.SSE_DONE
                        return
                    elif text or logprobs or finish:
                        yield writer.delta(index, text, logprobs, finish)
                try:
                    pending = [await events.__anext__()]
                except StopAsyncIteration:
                    break
            failed = await self.complete()
            if failed:
                yield fmt.error_event("the answer could not be stored in the session store",
                                      code=failed)
            if spec.include_usage:
                yield writer.usage(self.usage())
            yield fmt.SSE_DONE
        finally:
            self.finish()
