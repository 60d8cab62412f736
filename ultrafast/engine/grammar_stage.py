"""The grammar's stage of an engine step: what constrained decoding adds around the plain step.

`EngineCore.step` calls it at four points: `before_schedule` (matchers for grammars whose
compile ended, and first tokens from kept logits), `constrain` (drafts cut to their grammar,
forced tokens proposed as drafts), `fill_masks` (one mask row per sampled position) and
`after_update` (matchers advance over the accepted tokens). The per-token work is in
engine/grammar_steps.py; the matching itself in ultrafast/grammar.

A grammar compiling while its request is admitted does not hold the request back: its prompt
prefills meanwhile and the logits its last prompt token leaves are kept (`kept`), sampled under
the mask once the matcher exists. While any grammar compiles, steps of a model faster than a
compile are kept short and leave a core to the compile (COMPILE_*).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ultrafast.core.types import Draft, RequestOutput, ScheduledSeq, StepPlan, StepResult
from ultrafast.engine import grammar_steps
from ultrafast.engine.speculation import best_draft_length
from ultrafast.engine.step_costs import StepCostModel
from ultrafast.request import Request

if TYPE_CHECKING:
    from ultrafast.grammar.matcher import GrammarRuntime

COMPILE_POLL_S = 0.002  # an idle step's wait for a compile: new arrivals wait at most this
# kernel threads a step leaves idle while a grammar compiles on any thread (`compiles_now`):
# with every core in the pass, the compile timeshares with spinning kernel threads and the
# request's first token waits for both
COMPILE_SPARE_THREADS = 1
# and each such step is sized to about this long at the full thread count, so a compile of a
# few ms is noticed soon after it ends. Only where a lone decode is shorter than this: a model
# whose steps outlast a compile hides the compile in its prefill, and a step on one core fewer
# would cost more than the compile it speeds up
COMPILE_STEP_S = 0.002
# a deferred grammar runtime is built at the engine's first idle moment this long after the
# engine was made: a first request that comes at once (a user who starts the server and asks)
# is answered first; a constrained request before then builds it at once (grammar/deferred.py)
DEFERRED_BUILD_AFTER_S = 3.0
FORCED_DRAFT_RETRY_STEPS = 64  # steps without forced drafts before one is tried again
# calls that reuse "no forced draft pays" before it is recomputed from the step costs: the
# search is a Python loop over draft lengths, run for every constrained seq
FORCED_WORTH_REUSE_CALLS = 16

# runs a kept row's sampling through the executor and the step's update (EngineCore's part)
RunKept = Callable[[ScheduledSeq, Any, dict[str, Request]], list[RequestOutput]]


class GrammarStage:
    """Owns the requests whose grammar compiles, their kept logits rows and the forced-draft
    memo. Without a grammar runtime every method is a no-op (constrained requests refused)."""

    def __init__(
        self,
        runtime: GrammarRuntime | None,
        run_kept: RunKept,
        abort: Callable[[str], None],
        measured_costs: bool = True,
    ):
        """`measured_costs` off (SpeculationConfig.use_measured_costs): every forced token rides."""
        self.runtime = runtime
        self.measured_costs = measured_costs
        self._build_after_s = time.monotonic() + DEFERRED_BUILD_AFTER_S
        self._run_kept = run_kept
        self._abort = abort
        self.compiling: dict[str, Request] = {}  # admitted while their grammar compiles
        # request id -> the logits its last prompt token left while its grammar compiled
        # (ScheduledSeq.defer_sample), sampled when the matcher is made
        self.kept: dict[str, Any] = {}
        self.forced_idle_steps = 0  # calls of forced_drafts_worth that proposed none
        # (forced tokens available, lone stream) -> calls left that may reuse "none pay"
        self._forced_none_memo: dict[tuple[int, bool], int] = {}

    def build_when_idle(self) -> bool:
        """The engine is idle: build a deferred grammar runtime now (DEFERRED_BUILD_AFTER_S
        after the engine was made), on the engine thread, so that its ~0.3 s neither delays
        the server's first answer nor runs beside the start costs' timings; True if it was
        built now."""
        from ultrafast.grammar.deferred import DeferredGrammarRuntime

        if not isinstance(self.runtime, DeferredGrammarRuntime) or self.runtime.started:
            return False
        if time.monotonic() < self._build_after_s:
            return False
        self.runtime.build_quietly()
        return True

    def admit(self, request: Request) -> None:
        """A new request: its matcher now (a cached or finished compile), or it waits in
        `compiling` while its prompt prefills. ValueError: no grammar runtime, or the grammar
        does not compile (GrammarError is a ValueError, which fails this request alone)."""
        spec = request.sampling_params.grammar
        if spec is None or request.grammar_matcher is not None:
            return
        if self.runtime is None:
            raise ValueError("constrained decoding is not available with this model")
        pending = request.grammar_pending
        if pending is not None and not pending.done():
            # still compiling (server thread): the prompt prefills meanwhile, all but the
            # token that gives the first logits (Scheduler); the matcher comes at a step
            self.compiling[request.request_id] = request
        else:
            request.grammar_matcher = self.runtime.matcher(spec, request.eos_token_ids)

    def before_schedule(self, requests: dict[str, Request]) -> list[RequestOutput]:
        """First tokens sampled from kept logits of grammars that have just compiled: the
        step returns them at once (after a pass they would wait a whole step more)."""
        return self._take_compiled(requests, wait=False) if self.compiling else []

    def when_idle(self, requests: dict[str, Request]) -> list[RequestOutput]:
        """Nothing was scheduled: wait a moment for a compile to end rather than spin."""
        return self._take_compiled(requests, wait=True) if self.compiling else []

    def compiles_now(self) -> bool:
        """A grammar compiles now: for a request admitted meanwhile, or on any thread (the
        server compiles while a request's prompt is still being tokenized). A pass on every
        core beside it timeshares with the compile (the kernel threads wait for each other
        while one is descheduled)."""
        return bool(self.compiling) or (
            self.runtime is not None and self.runtime.compiles_running > 0
        )

    def step_shape(self, compiling: bool, costs: StepCostModel) -> tuple[int, int | None]:
        """(kernel threads to leave idle, token cap) for a step scheduled while `compiling`:
        a core for the compile where a lone decode is shorter than COMPILE_STEP_S, and short
        steps while a request of ours waits on its compile (the one after it runs in full)."""
        decode_s = costs.single_decode_s
        if not compiling or decode_s is None or decode_s >= COMPILE_STEP_S:
            return 0, None
        cap = costs.token_budget(COMPILE_STEP_S) if self.compiling else None
        return COMPILE_SPARE_THREADS, cap

    def constrain(
        self,
        drafts: dict[str, Draft],
        running: list[Request],
        costs: StepCostModel,
    ) -> dict[str, Draft]:
        """Drafts cut to their grammar-valid prefix; forced tokens as drafts where none."""
        if self.runtime is None:
            return drafts
        lone = len(running) <= 1
        return grammar_steps.constrain_drafts(
            drafts,
            running,
            lambda available: self.forced_drafts_worth(available, costs, lone),
        )

    def fill_masks(self, plan: StepPlan, requests: dict[str, Request]) -> dict[str, Request]:
        """Mask rows on the plan's constrained seqs; returns their requests."""
        return grammar_steps.fill_masks(plan, requests) if self.runtime is not None else {}

    def after_update(
        self, outputs: list[RequestOutput], constrained: dict[str, Request], result: StepResult
    ) -> None:
        """Only accepted tokens advance a grammar; kept rows wait for their matcher."""
        if constrained:
            grammar_steps.advance(outputs, constrained)
        if result.kept_logits:
            self.kept.update(result.kept_logits)

    def forced_drafts_worth(self, available: int, costs: StepCostModel, lone: bool) -> int:
        """How many grammar-forced tokens to propose as drafts: all are accepted, so the k
        with the most tokens per second at the measured step costs (a lone stream's by its
        own timed pass widths); "none" is reused for FORCED_WORTH_REUSE_CALLS calls. Before
        the costs are known, or when drafts are sized from fixed costs (`measured_costs`
        off): all. `lone`: the only request running."""
        base_s, per_token_s = costs.base_s, costs.per_token_s
        if not self.measured_costs or base_s is None or per_token_s is None:
            return available
        calls_left = self._forced_none_memo.get((available, lone), 0)
        if calls_left:  # none paid a moment ago: the (slowly moving) costs still say so
            self._forced_none_memo[available, lone] = calls_left - 1
            k = 0
        else:
            measured = costs.lone_pass_s if lone else ()
            k = best_draft_length(1.0, available, base_s, per_token_s, 0.0, measured)
            if k == 0:  # a positive k is recomputed each time: it may be a width to time
                self._forced_none_memo[available, lone] = FORCED_WORTH_REUSE_CALLS - 1
        if k == 0:  # now and then one rides anyway: a width timed under a load spike is retimed
            self.forced_idle_steps += 1
            if self.forced_idle_steps >= FORCED_DRAFT_RETRY_STEPS:
                self.forced_idle_steps = 0
                return 1
        return k

    def _take_compiled(self, requests: dict[str, Request], wait: bool) -> list[RequestOutput]:
        """Matchers for the requests whose compile has finished, and the first token of those
        whose prompt is already in (from its kept logits). A failed compile aborts its
        request (the server answers 400 from the same compile); an aborted request is
        forgotten. `wait`: nothing else to run, so wait a moment for a compile to end."""
        assert self.runtime is not None  # nothing compiles without one (admit)
        pending = [r.grammar_pending for r in self.compiling.values()]
        if wait and pending:
            concurrent.futures.wait(pending, COMPILE_POLL_S, concurrent.futures.FIRST_COMPLETED)
        outputs: list[RequestOutput] = []
        for request_id, request in list(self.compiling.items()):
            if requests.get(request_id) is not request:
                del self.compiling[request_id]
                self.kept.pop(request_id, None)
            elif request.grammar_pending.done():
                del self.compiling[request_id]
                kept = self.kept.pop(request_id, None)
                spec = request.sampling_params.grammar
                assert spec is not None  # admitted as constrained
                try:
                    request.grammar_matcher = self.runtime.matcher(spec, request.eos_token_ids)
                except ValueError:  # GrammarError: the compile failed
                    self._abort(request_id)
                    continue
                if kept is not None:
                    outputs += self._sample_kept(request, kept)
        return outputs

    def _sample_kept(self, request: Request, kept: Any) -> list[RequestOutput]:
        """The first token of a request whose prompt prefilled while its grammar compiled,
        from the logits its last prompt token left (ScheduledSeq.defer_sample), under the
        mask now that the matcher exists: no pass of its own after the compile. Nothing if
        the request was preempted since (its prefill runs again and samples as usual)."""
        if request.num_computed_tokens != request.num_tokens or request.num_output_tokens:
            return []
        seq = ScheduledSeq(
            request_id=request.request_id,
            slot_id=request.held_slot_id,
            token_ids=[],  # nothing to compute: the prefill did
            start_position=request.num_tokens,
            num_logits=1,
            sampling_params=request.sampling_params,
            sampling_seed=request.sampling_seed,
            num_output_tokens=0,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )
        seq.token_mask = request.grammar_matcher.masks([])
        return self._run_kept(seq, kept, {request.request_id: request})
