"""One API call's generation: n engine requests, detokenizing, stop strings, SSE or one JSON body.

The HTTP response starts only when the first token exists, so an error before that is a plain
OpenAI error response, and the timing headers (queue wait, TTFT) are real. After the first
byte, a failure becomes an SSE error event followed by [DONE].

A run's life, in the order a front end calls it:
  `start()` submits to the engine; `events()` yields `ChoiceDelta` / `Ping` until every choice
  has ended; `conclude()` runs the session commit (if one was set with `set_commit`) and says
  which error, if any, the call must end with (`run_error`, the one place that error is
  built); `finish()` (always, in a `finally`) frees the engine requests, the admission ticket
  and refunds unused rate-limit tokens. A run that `finish()`es before `conclude()` (the client
  left) still commits what it generated, as incomplete, in the background.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from ultrafast.grammar.prefix_check import accepts_text
from ultrafast.request import Request
from ultrafast.server import openai_format as fmt
from ultrafast.server.admission import Admission, Ticket
from ultrafast.server.bridge import EngineBridge, RequestGroup, RequestOutput
from ultrafast.server.errors import APIError
from ultrafast.server.guard import CONTENT_FILTER, GuardConfig, GuardedChoice
from ultrafast.server.metrics import ServerMetrics
from ultrafast.server.run_types import (
    ENGINE_FAILED,
    ChoiceDelta,
    GenerationSpec,
    Ping,
    RunEvent,
    run_error,
)
from ultrafast.server.tools.stream import ToolSplitter, chat_tool_chunks
from ultrafast.tokenizer import StopStringMatcher, Tokenizer

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class RunDeps:
    """What a run uses of the server, and nothing more."""

    bridge: EngineBridge
    tokenizer: Tokenizer
    admission: Admission
    metrics: ServerMetrics
    guard: GuardConfig | None  # None: text goes out as soon as it exists
    runs: set[GenerationRun]  # the runs in flight, for the shutdown drain
    ping_interval_s: float  # a Ping when no output came for this long


# the session commit: (run, None at a normal end / "client_disconnected") -> error code or None
CommitHook = Callable[["GenerationRun", str | None], Awaitable[str | None]]

log = logging.getLogger(__name__)


class GenerationRun:
    """A generation's run: the engine requests of one GenerationSpec (its plan), their
    outputs as they come, and the response (whole or streamed) they make."""

    def __init__(self, deps: RunDeps, spec: GenerationSpec, ticket: Ticket):
        self.deps = deps
        self.spec = spec
        self.ticket = ticket
        tok = deps.tokenizer
        requests, self.choice_prompts = [], []
        for p, prompt in enumerate(spec.prompts):
            for i in range(spec.n):
                params = spec.params
                if params.seed is not None and i:
                    params = replace(params, seed=params.seed + i)  # n choices must differ
                requests.append(
                    Request(
                        f"{spec.request_id}-{p}-{i}",
                        list(prompt),
                        params,
                        tier=spec.tier,
                        tenant=spec.tenant,
                        arrival_time_s=spec.arrival_s,
                        eos_token_ids=tok.eos_token_ids,
                        prediction_token_ids=list(spec.prediction_token_ids or []),
                        grammar_pending=spec.grammar_compile,
                    )
                )
                self.choice_prompts.append(p)
        num_choices = len(requests)
        self.generation = RequestGroup(deps.bridge, requests)  # the call's engine requests
        echo = spec.echo_texts or [""] * len(spec.prompts)
        self.choices = [
            fmt.ChoiceState(c, text=echo[self.choice_prompts[c]]) for c in range(num_choices)
        ]
        for choice in self.choices:  # echo: the generated text's offsets start after it
            choice.echo_chars = len(choice.text)
            if self.scores_prompt:
                choice.prompt_token_ids = spec.prompts[self.choice_prompts[choice.index]]
        self.detoks = [
            tok.detokenizer(spec.prompts[self.choice_prompts[c]], spec.keep_token_ids)
            for c in range(num_choices)
        ]
        self.matchers = [StopStringMatcher(spec.stops) for _ in range(num_choices)]
        # each choice's output after stop strings: what a stop inside a grammar's answer cut
        self.stop_checked = [""] * num_choices if spec.stops and spec.params.grammar else None
        self.num_output_tokens = [0] * num_choices
        self.num_prediction_tokens = [(0, 0)] * num_choices  # (accepted, rejected) per choice
        self.first_token_s: float | None = None
        self.queue_time_s = 0.0
        self._commit_hook: CommitHook | None = None
        self._committed = False
        self._started = False
        self.timer = deps.metrics.request_timer(spec.tier, spec.tenant, spec.arrival_s)
        guard = deps.guard
        self.guarded = None if guard is None else [GuardedChoice(guard) for _ in self.choices]
        self._released_logprobs = [0] * num_choices
        self._on_finish: list[Callable[[GenerationRun], None]] = []  # rate-limit refunds
        self.tools = ToolSplitter.for_run(spec.tools, self.choices)  # None: no tool calling

    def on_finish(self, callback: Callable[[GenerationRun], None]) -> None:
        """Run `callback(run)` once when the call ends, whatever the reason."""
        self._on_finish.append(callback)

    def set_commit(self, hook: CommitHook) -> None:
        """The session commit `conclude()` awaits (or `finish()` schedules, if the run ended
        early). One per run."""
        assert self._commit_hook is None, "a run commits once"
        self._commit_hook = hook

    def decode_token(self, token_ids: list[int]) -> str:
        """Logprobs' token text: the output's special tokens shown as the output text has them."""
        return self.deps.tokenizer.decode(token_ids, keep_ids=self.spec.keep_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Completions `echo` + `logprobs`: the response lists the prompt's logprobs first."""
        spec = self.spec
        return (
            bool(spec.echo_texts) and spec.want_logprobs and spec.params.prompt_logprobs is not None
        )

    def _apply(self, index: int, out: RequestOutput) -> tuple[str, list, str | None]:
        """Fold one engine output into choice `index`; returns (text delta, logprobs, finish)."""
        choice = self.choices[index]
        if out.error is not None:
            choice.finish_reason, choice.error = "error", out.error
            return "", [], "error"
        self.num_output_tokens[index] = out.num_output_tokens
        self.num_prediction_tokens[index] = (
            out.num_accepted_prediction_tokens,
            out.num_rejected_prediction_tokens,
        )
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
        if self.stop_checked is not None:
            self.stop_checked[index] += text
        if stopped:
            finish = "stop" if self._complete_at_stop(index) else "length"
            self.generation.abort(index)
        elif out.finished:
            text += self.matchers[index].flush()
            finish = out.finish_reason
        return text, out.new_logprobs, finish

    def _complete_at_stop(self, index: int) -> bool:
        """A stop string matched: True unless it cut a constrained answer short. An answer
        whose grammar is not in an accepting state there (a JSON value not closed, a tool
        call cut) ends `length`, never `stop` (issue 29 item 2); logged."""
        spec = self.spec
        if self.stop_checked is None or spec.grammar_runtime is None:
            return True
        assert spec.params.grammar is not None
        choice = self.choices[index]
        if accepts_text(
            spec.grammar_runtime,
            spec.params.grammar,
            choice.token_ids,
            self.stop_checked[index],
            spec.keep_token_ids,
        ):
            return True
        log.warning(
            "%s choice %d: stop string %r cut the %s answer before its grammar was complete "
            "(%d tokens); finishing with 'length', not 'stop'",
            spec.request_id,
            index,
            self.matchers[index].matched,
            spec.params.grammar.source,
            len(choice.token_ids),
        )
        return False

    def _release(
        self, index: int, text: str, finish: str | None, engine_finished: bool
    ) -> tuple[str, str | None]:
        """Text the guard (if any) let out joins the choice: tool calls split from content
        first, so the guard screens a call's arguments as it screens content."""
        if self.tools is not None and finish not in (CONTENT_FILTER, "error"):
            # content and calls apart; one call allowed: end at it
            text, finish = self.tools.split(index, text, finish)
            if finish == "tool_calls" and not engine_finished:
                self.generation.abort(index)
        choice = self.choices[index]
        choice.text += text
        if finish:
            choice.finish_reason = finish
        return text, finish

    async def events(self) -> AsyncIterator[RunEvent]:
        """A ChoiceDelta per engine output, a Ping per quiet interval, until every choice ended.

        Waits on the queue itself: cancelling a `queue.get()` on timeout is harmless, while
        cancelling a generator would run its cleanup and abort the requests.
        """
        gen = self.generation
        while gen.unfinished:
            try:
                out = await asyncio.wait_for(gen.queue.get(), timeout=self.deps.ping_interval_s)
            except asyncio.TimeoutError:
                yield Ping()
                continue
            if out is None or out.request_id not in gen.unfinished:
                continue  # interrupted, or a choice we already ended (stop string), draining
            if out.finished:
                gen.unfinished.discard(out.request_id)
            if self.first_token_s is None and (out.new_token_ids or out.finished):
                self.first_token_s = time.monotonic()
                self.queue_time_s = out.queue_time_s
                self.deps.admission.first_token(self.ticket)
            index = gen.index_of[out.request_id]
            text, logprobs, finish = self._apply(index, out)
            num_tokens = len(out.new_token_ids)
            if self.guarded is not None:
                text, logprobs, num_tokens, finish = await self._guard(
                    index, text, logprobs, num_tokens, finish
                )
            text, finish = self._release(index, text, finish, out.finished)
            self.timer.output(index, num_tokens, out.queue_time_s)
            calls = () if self.tools is None else self.tools.take(index)
            yield ChoiceDelta(index, text, logprobs, finish, calls)

    async def _guard(
        self, index: int, text: str, logprobs: list, num_tokens: int, finish: str | None
    ) -> tuple[str, list, int, str | None]:
        """Pass the choice's new text through its guard; on a hit, cut the choice there."""
        assert self.guarded is not None
        choice = self.choices[index]
        text, logprobs, num_tokens, blocked = await self.guarded[index].push(
            text, logprobs, num_tokens, finish is not None
        )
        if blocked:  # the response keeps only what was released; the held text is dropped
            del choice.logprobs[self._released_logprobs[index] :]
            self.deps.metrics.guard_cuts.inc()
            self.generation.abort(index)
            return "", [], 0, CONTENT_FILTER
        self._released_logprobs[index] += len(logprobs)
        return text, logprobs, num_tokens, finish

    def usage(self) -> dict:
        prediction = None
        if self.spec.prediction_token_ids is not None:
            prediction = (
                sum(a for a, _ in self.num_prediction_tokens),
                sum(r for _, r in self.num_prediction_tokens),
            )
        return fmt.usage(
            sum(len(p) for p in self.spec.prompts),
            sum(self.num_output_tokens),
            min((c.num_cached_tokens for c in self.choices), default=0),
            prediction,
        )

    def timing_headers(self) -> dict:
        ttft_ms = ((self.first_token_s or time.monotonic()) - self.spec.arrival_s) * 1000
        queue_ms = self.queue_time_s * 1000
        return {
            "x-request-id": self.spec.request_id,
            "x-service-tier": self.spec.tier.api_name,
            "x-queue-wait-ms": f"{queue_ms:.1f}",
            "x-ttft-ms": f"{ttft_ms:.1f}",
            "server-timing": f"queue;dur={queue_ms:.1f}, ttft;dur={ttft_ms:.1f}",
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Submit to the engine; once (a grammar still compiling may have started it)."""
        if self._started:
            return
        self._started = True
        self.deps.runs.add(self)
        self.generation.start()

    async def commit(self) -> str | None:
        """Run the session commit (if any) once, at the normal end of the run: None, or the
        error code of a commit that could not be made."""
        if self._commit_hook is None or self._committed:
            return None
        self._committed = True
        return await self._commit_hook(self, None)

    async def conclude(self) -> APIError | None:
        """After the last event: commit, and the error the call must end with, if any."""
        if any(c.error for c in self.choices):
            return run_error(ENGINE_FAILED)  # nothing is committed for a failed run
        failed = await self.commit()
        return None if failed is None else run_error(failed)

    def finish(self) -> None:
        """Always, once the call ends: free the engine requests and the admission seat."""
        self.deps.runs.discard(self)
        self.generation.abort_all()
        self.deps.admission.release(self.ticket)
        self.timer.finish(
            sum(len(p) for p in self.spec.prompts) * self.spec.n, sum(self.num_output_tokens)
        )
        callbacks, self._on_finish = self._on_finish, []
        for callback in callbacks:
            callback(self)
        if self._commit_hook is not None and not self._committed:
            self._committed = True  # the client left: store what was generated, as incomplete
            asyncio.ensure_future(self._commit_hook(self, "client_disconnected"))

    async def collect(self, http: HTTPRequest) -> bool:
        """Run to the end without streaming; False if the client left first (the run is then
        finished: its slots are free). Polls the connection, since nothing is written."""
        self.start()
        collect = asyncio.ensure_future(self._drain())
        while not collect.done():
            done, _ = await asyncio.wait({collect}, timeout=0.25)
            if not done and await http.is_disconnected():
                collect.cancel()  # the client left: abort, free the slots
                self.finish()
                return False
        collect.result()
        return True

    async def _drain(self) -> None:
        async for _ in self.events():
            pass

    async def run_to_end(self, http: HTTPRequest) -> bool:
        """A non-streamed call, for every front end: run to the end, commit, finish (always);
        False if the client left first (answer 499), the call's error raised if it failed.
        Then `choices` and `usage()` hold the answer to shape."""
        try:
            if not await self.collect(http):
                return False
            error = await self.conclude()
        finally:
            self.finish()
        if error is not None:
            raise error
        return True

    # ---- chat / completions responses --------------------------------------------------------

    async def respond_json(self, http: HTTPRequest) -> Response:
        if not await self.run_to_end(http):
            return Response(status_code=499)
        build = fmt.chat_response if self.spec.chat else fmt.completion_response
        body = build(
            self.spec.request_id,
            self.spec.model_name,
            self.spec.tier.api_name,
            self.choices,
            self.usage(),
            self.decode_token,
            self.spec.want_logprobs,
        )
        return JSONResponse(body, headers=self.timing_headers())

    async def respond_stream(self) -> Response:
        """Wait for the first token (errors before it are plain HTTP errors), then stream."""
        self.start()
        events = self.events().__aiter__()
        first: list[RunEvent] = []
        try:
            # Headers wait for the first token (so they carry real timings), unless it takes
            # longer than a ping interval: then the stream starts with a keep-alive comment.
            first.append(await events.__anext__())
        except StopAsyncIteration:
            pass
        except BaseException:
            self.finish()
            raise
        head = first[0] if first else None
        if isinstance(head, ChoiceDelta) and head.finish == "error" and len(self.choices) == 1:
            self.finish()
            raise run_error(ENGINE_FAILED)
        return StreamingResponse(
            self._sse(first, events),
            media_type="text/event-stream",
            headers={**self.timing_headers(), "cache-control": "no-cache"},
        )

    async def _sse(self, first: list[RunEvent], events) -> AsyncIterator[bytes]:
        spec = self.spec
        writer = fmt.ChunkWriter(
            spec.request_id,
            spec.model_name,
            spec.tier.api_name,
            spec.chat,
            self.decode_token,
            spec.want_logprobs,
        )
        try:
            # with prompt logprobs, a choice's echo waits for its first output, which has them
            echo_later = set(range(len(self.choices))) if self.scores_prompt else set()
            echo_texts = spec.echo_texts or []  # scores_prompt implies echo texts
            for choice in self.choices:
                if spec.chat:
                    yield writer.role(choice.index)
                elif echo_texts and choice.index not in echo_later:
                    yield writer.echo(
                        choice.index, echo_texts[self.choice_prompts[choice.index]], None
                    )
            async for event in _chained(first, events):
                if (
                    isinstance(event, ChoiceDelta)
                    and event.index in echo_later
                    and event.finish != "error"
                ):
                    echo_later.discard(event.index)
                    yield writer.echo(
                        event.index,
                        echo_texts[self.choice_prompts[event.index]],
                        self.choices[event.index].prompt_part(),
                    )
                if isinstance(event, Ping):
                    yield b": ping\n\n"
                elif event.finish == "error":
                    break  # conclude() below names the failure
                elif event.tool_events:  # content first, then the calls, then the finish
                    assert spec.tools is not None  # tool events come from a call's tool plan
                    if event.text or event.logprobs:
                        yield writer.delta(event.index, event.text, event.logprobs)
                    for chunk in chat_tool_chunks(
                        writer, event.index, event.tool_events, spec.tools.done_events
                    ):
                        yield chunk
                    if event.finish:
                        yield writer.delta(event.index, "", [], event.finish)
                elif event.text or event.logprobs or event.finish:
                    yield writer.delta(event.index, event.text, event.logprobs, event.finish)
            error = await self.conclude()
            if error is not None:
                yield fmt.error_event(error.message, code=error.code)
                if error.code == ENGINE_FAILED:
                    yield fmt.SSE_DONE
                    return
            if spec.include_usage:
                yield writer.usage(self.usage())
            yield fmt.SSE_DONE
        finally:
            self.finish()


async def _chained(first: list[RunEvent], rest) -> AsyncIterator[RunEvent]:
    for event in first:
        yield event
    async for event in rest:
        yield event
