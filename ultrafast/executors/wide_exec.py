"""The ggml executor with wide passes: bf16 PyTorch forwards where they beat llama.cpp.

A step's long prefill chunks (at least `wide_min_tokens` tokens, the crossover measured at
start by wide_route.py) leave the llama.cpp batch. Two cases:

- wide decode off: the wide forward (wide_forward.py) computes the KV of all their tokens but
  the last, over the slot's earlier KV exported from llama.cpp, and imports it into the slot
  (ggml_kv_rows.py + the per-sequence state API); the last token of a chunk that samples runs
  in llama.cpp with the step's decodes.
- wide decode on (a measured on width, wide_decode_route.py): the step is one torch pass over
  the KV mirror (wide_decode.step_logits): every token of its prefill chunks, their first
  tokens sampled from it, and its 1-token decodes when they reach the on width or a long chunk
  runs anyway; everything else that can run in it joins it. llama.cpp gets a slot's rows by
  a push when it next runs the slot (_ggml_slot), and the mirror pulls what llama.cpp wrote.

Sampling, kept rows and masks are the same sample_keeping_deferred either way. Draft
verifications and prompt scoring never leave llama.cpp.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult
from ultrafast.executors import ggml_kv_rows, wide_decode
from ultrafast.executors.ggml_exec import GgmlExecutor
from ultrafast.executors.ggml_kv_rows import SlotRows
from ultrafast.executors.wide_decode_route import DecodeRouter, plan_wide_decode
from ultrafast.executors.wide_forward import SeqChunk, WideForward
from ultrafast.executors.wide_kv_mirror import KVMirror
from ultrafast.executors.wide_lazy import WideLazy
from ultrafast.executors.wide_route import WIDE_PASS_MODES
from ultrafast.sampling.sampler import sample_keeping_deferred

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 120.0  # close waits this long for a weight load in its thread

# A narrow decode step (under the router's width) whose slots hold at least this many rows in
# the mirror alone stays in torch: pushing them costs ~0.1 ms a row (two slots of 1,123 rows:
# 210 ms, then a 310 ms first step), and at such lengths llama.cpp's narrow step was no faster
# than torch's (2 decodes at 1,100 positions: 52-65 ms against 30-44 ms for torch's 4, served,
# 2-core AMX Xeon). Shorter slots are pushed once and decode on llama.cpp (17 vs ~30 ms).
STAY_ROWS = 512


class WideGgmlExecutor(GgmlExecutor):
    """GgmlExecutor plus the wide prefill path; `wide_pass` is auto (measured), on or off."""

    def __init__(
        self, gguf_path: str | Path, *args, wide_pass: str = "auto", by_need=False, **kwargs
    ) -> None:
        """`by_need` (serving): only feature detection now, the rest by need (wide_lazy.py);
        otherwise the weights load and both paths are timed here."""
        if wide_pass not in WIDE_PASS_MODES:
            raise ValueError(f"wide_pass must be one of {', '.join(WIDE_PASS_MODES)}")
        super().__init__(gguf_path, *args, **kwargs)
        self.wide: WideForward | None = None
        self.wide_min_tokens = 0  # chunks of at least this many tokens take the wide path
        self._wide_paused = False
        self.mirror: KVMirror | None = None  # the torch side's KV of wide-decoded slots
        self.decode_router = DecodeRouter(0)
        self.decode_force: bool | None = None  # a measurement's choice, over the router's
        # the last torch decode step's logits rows, in slot order (the ggml rows are in
        # last_logits): parity tests read them
        self.last_decode_logits = np.empty((0, self.vocab_size), dtype=np.float32)
        try:
            self.wide_lazy = WideLazy(self, wide_pass)
            if not by_need:
                self.wide_lazy.decide_now(use_cache=False)
        except BaseException:
            self.close()
            raise
        if by_need:
            log.info("wide passes: %s", self.wide_status)

    @property
    def wide_status(self) -> str:
        return self.wide_lazy.status

    def close(self) -> None:
        """A weight load still running in its thread ends first: left running, it met the
        interpreter's exit inside torch, and the process aborted ("terminate called without
        an active exception") after its work was done."""
        lazy = getattr(self, "wide_lazy", None)  # absent when __init__ failed before it
        if lazy is not None:
            lazy.wait_loaded(CLOSE_WAIT_S)  # a load is seconds; a stuck one must not hang us
            if lazy.loading():
                log.warning("wide passes: the weight load still runs at close")
        super().close()

    def start_wide_decode(
        self, slots: list[int] | None = None, should_stop: Callable[[], bool] = lambda: False
    ) -> str:
        """With the wide forward in self.wide: its KV mirror, and from which width decode
        steps run in torch, timed in `slots` (wide_decode_route.py); the status clause."""
        assert self.wide is not None
        self.mirror = wide_decode.new_mirror(self.wide, self.max_model_len, self.num_slots)
        return plan_wide_decode(self, self.wide_lazy.mode, slots, should_stop)

    def use_wide_decode(self, on_width: int, from_positions: dict[int, int] | None = None) -> None:
        """A cached decision: the mirror, and decode steps from `on_width` in torch (0: none)
        or at longer contexts (DecodeRouter.from_positions)."""
        assert self.wide is not None
        self.mirror = wide_decode.new_mirror(self.wide, self.max_model_len, self.num_slots)
        self.decode_router = DecodeRouter(on_width, dict(from_positions or {}))

    # ---- routing ----

    def _routes(self, seq: ScheduledSeq, min_tokens: int) -> bool:
        return (
            len(seq.token_ids) >= max(2, min_tokens)
            and seq.num_logits <= 1
            and not seq.num_prompt_logits
            and self._check(seq) is None
        )

    def _torch_rows(self, plan: StepPlan) -> tuple[list[ScheduledSeq], list[ScheduledSeq], bool]:
        """The step's prefill chunks for the wide pass, its 1-token decodes for torch, and
        whether those decode in torch.

        With wide decode on, a step whose decodes (counting the chunks that sample) reach the
        on width, or that holds a chunk long enough for the wide path, runs one torch pass,
        and everything else that can joins it: every prefill chunk however short (on
        llama.cpp a 20-50 token remainder of the 512-token budget cost a push and a 120-290 ms
        pass in a served 16-stream step) and every decode however few (beside a 512-token
        chunk two decodes had cost a 67-400 ms llama.cpp pass and a push of each slot's
        ~1,000 rows, 95-164 ms, in a served run of four long prompts); a few more rows in a
        pass that runs anyway cost milliseconds."""
        routed = [s for s in plan.seqs if self._routes(s, self.wide_min_tokens)]
        if not self._over_mirror():
            return routed, [], False
        along = [s for s in plan.seqs if self._routes(s, 2)]
        decodes = self._decodes(plan)
        wide = self.decode_force
        if wide is None:
            tails = [s for s in along if s.num_logits]
            positions = sum(s.start_position + len(s.token_ids) - 1 for s in decodes + tails)
            wide = self.decode_router.wide(len(decodes) + len(tails), positions) or bool(routed)
            wide = wide or self._unpushed_rows(decodes) >= STAY_ROWS
        return (along, decodes, True) if wide else (routed, [], False)

    def _unpushed_rows(self, decodes: list[ScheduledSeq]) -> int:
        """The rows only the mirror holds of the decodes' slots: what llama.cpp would need
        pushed before it could run them."""
        assert self.mirror is not None
        return sum(
            max(0, self.mirror.length(s.slot_id) - self._slot_lens[s.slot_id]) for s in decodes
        )

    def _over_mirror(self) -> bool:
        """Whether torch passes run over the KV mirror: wide decode on (a measured on width),
        or forced by a measurement (the decode width's own timing, wide_decode_route.py)."""
        forced = bool(self.decode_force)
        return self.mirror is not None and (self.decode_router.enabled or forced)

    def _decodes(self, plan: StepPlan) -> list[ScheduledSeq]:
        """The step's 1-token decodes that can run in torch (none if two share a slot)."""
        decodes = [
            s
            for s in plan.seqs
            if len(s.token_ids) == 1
            and s.num_logits == 1
            and not s.num_prompt_logits
            and self._check(s) is None
        ]
        return decodes if len({s.slot_id for s in decodes}) == len(decodes) else []

    def execute(self, plan: StepPlan) -> StepResult:
        if self.wide is None and not self._wide_paused:
            self.wide_lazy.on_pass(plan)  # loads on first need; takes the weights once in
        if self.wide is None or self._wide_paused:
            return super().execute(plan)
        routed, decodes, in_torch = self._torch_rows(plan)
        if not routed and not in_torch:
            return super().execute(plan)
        start_s = time.perf_counter()
        for copy in plan.kv_copies:  # the wide pass reads the slots' earlier KV
            self._copy_prefix(copy.src_slot_id, copy.dst_slot_id, copy.num_tokens)
        tails: list[ScheduledSeq] = []
        over_mirror = self._over_mirror()
        if over_mirror:  # wide decode on: one torch pass over the mirror
            decodes = decodes if in_torch else []
            done = self._torch_step(routed, decodes, plan.spare_threads)
        else:  # the chunks' KV into llama.cpp, their last tokens in its pass below
            decodes = []
            tails, errors = self._wide_prefill(routed, plan.spare_threads)
            done = StepResult(errors=errors)
        wide_s = time.perf_counter() - start_s - done.sample_time_s
        taken = {id(s) for s in routed + decodes}
        rest = [s for s in plan.seqs if id(s) not in taken] + tails
        result = super().execute(replace(plan, seqs=rest, kv_copies=[])) if rest else StepResult()
        _merge(result, done)
        result.execute_time_s += wide_s
        if over_mirror and not rest:
            # the whole step was one torch pass, mixed lengths and all: its cost fits the
            # step-cost line (admission prices queued prompts from it; left out as several
            # passes, a cold server knew only decode steps and priced 16 queued 1,000-token
            # prompts at ~32 s, refusing one with 429, where their prefill took ~4.5 s)
            result.num_passes = 1
        return result

    # ---- wide decode steps (wide_decode.py) and the KV moves they need ----

    def _torch_step(
        self, chunks: list[ScheduledSeq], decodes: list[ScheduledSeq], spare_threads: int
    ) -> StepResult:
        """The step's prefill chunks (every token; the last one's logits too) and 1-token
        decodes as one torch pass over the mirror (wide_decode.step_logits: one read of the
        weights where a prefill pass and a decode pass read them twice), sampled here; a seq
        whose slot cannot be made ready fails alone."""
        assert self.wide is not None and self.mirror is not None
        errors: dict[str, str] = {}
        chunks = [s for s in chunks if self._ready(s, errors)]
        decodes = sorted((s for s in decodes if self._ready(s, errors)), key=lambda s: s.slot_id)
        result = StepResult()
        if chunks or decodes:
            prefill, logits_of = _prefill_rows(chunks)
            decoding = None
            if decodes:
                slots, starts = [s.slot_id for s in decodes], [s.start_position for s in decodes]
                decoding = ([s.token_ids[0] for s in decodes], slots, starts)
            self._set_torch_threads(spare_threads, len(prefill[0]) if prefill else len(decodes))
            logits = wide_decode.step_logits(self.wide, self.mirror, prefill, decoding, logits_of)
            rows = logits.numpy()
            self.last_decode_logits = rows[len(logits_of) :]
            sampled_s = time.perf_counter()
            result = sample_keeping_deferred([chunks[j] for j in logits_of] + decodes, rows)
            result.sample_time_s = time.perf_counter() - sampled_s
        result.errors.update(errors)
        return result

    def _ready(self, seq: ScheduledSeq, errors: dict[str, str]) -> bool:
        """The mirror made to hold exactly the seq's earlier positions, or its error noted."""
        error = self._torch_slot(seq.slot_id, seq.start_position)
        if error is not None:
            errors[seq.request_id] = error
        return error is None

    def _torch_slot(self, slot: int, start: int) -> str | None:
        """Make the mirror hold exactly [0, start) of `slot` (pulling llama.cpp's newer rows);
        llama.cpp's rows past start are dropped (they are stale)."""
        assert self.mirror is not None
        held, mirrored = self._slot_lens[slot], self.mirror.length(slot)
        if start > max(held, mirrored):
            return f"slot {slot} holds {max(held, mirrored)} positions, cannot start at {start}"
        if mirrored < start:
            error = wide_decode.pull(self, slot, start)
            if error is not None:
                return error
        self.mirror.trim(slot, start)
        if held > start:
            super()._trim_slot(slot, start)
        return None

    def _ggml_slot(self, slot: int, end: int) -> None:
        """Push the mirror's rows of `slot` up to `end` that llama.cpp lacks; forget the rest."""
        if self.mirror is None:
            return
        held, mirrored = self._slot_lens[slot], self.mirror.length(slot)
        if held < min(mirrored, end):
            try:
                wide_decode.push(self, slot, held, min(mirrored, end))
            except ValueError as exc:  # the slot is empty now: its request fails below
                log.warning("wide decode: llama.cpp refused slot %d's KV: %s", slot, exc)
                self.mirror.trim(slot, 0)
        self.mirror.trim(slot, end)

    def _trim_slot(self, slot_id: int, start_position: int) -> str | None:
        self._ggml_slot(slot_id, start_position)
        return super()._trim_slot(slot_id, start_position)

    def _copy_prefix(self, src_slot_id: int, dst_slot_id: int, num_tokens: int) -> None:
        mirror, src, dst = self.mirror, src_slot_id, dst_slot_id
        if mirror is not None and src != dst and mirror.length(src) < num_tokens:
            if num_tokens <= self._slot_lens[src]:
                # the prefix is llama.cpp's only (a slot it filled, e.g. a shared system
                # prompt): the source's mirror takes it once, so this copy and the next ones
                # are mirror copies, not a pull into every new slot (a state export, 3-5 ms of
                # a ~50 ms batch-1 TTFT, 2-core AMX Xeon); a refused pull changes nothing
                wide_decode.pull(self, src, num_tokens)
        mirrored = mirror is not None and src != dst and num_tokens <= mirror.length(src)
        if mirror is not None and mirrored and self._mirror_copy_will_do(src, num_tokens):
            # copied in the mirror only; llama.cpp's dst forgets its rows and gets them by a
            # push when it next runs the slot
            mirror.copy_prefix(src, dst, num_tokens)
            super()._trim_slot(dst, 0)
            return
        self._ggml_slot(src_slot_id, self.max_model_len)
        super()._copy_prefix(src_slot_id, dst_slot_id, num_tokens)
        if mirror is None:
            return
        if mirrored:
            # both hold it (the source prefilled in torch, then decoded on llama.cpp): the
            # mirror copies it too, or the next torch pass pulls it back from llama.cpp, a
            # state export of the whole source slot (4-5 ms of a batch-1 TTFT of ~50 ms for a
            # 24-token system prompt, 2-core AMX Xeon)
            mirror.copy_prefix(src, dst, num_tokens)
        else:  # the copy is llama.cpp's: the mirror pulls it if needed
            mirror.trim(dst_slot_id, 0 if src_slot_id != dst_slot_id else num_tokens)

    def _mirror_copy_will_do(self, src: int, num_tokens: int) -> bool:
        """Whether a prefix the mirror holds is copied there alone, llama.cpp's copy skipped.

        Where only the mirror holds it (a prompt prefilled in torch): copying it in llama.cpp
        would first push the whole source slot (768 rows, 113 ms, to copy a 32-token system
        prompt in a served run). Where both hold it and torch passes run over the mirror: the
        copy's next pass is torch's, and llama.cpp's copy was a state export and import of
        the source slot (3.7 ms of a ~45 ms batch-1 TTFT, 16 of them ahead of a 16-stream
        level's first pass, 2-core AMX Xeon) that the push before its next pass redoes."""
        return self._slot_lens[src] < num_tokens or self._over_mirror()

    def export_slot(self, slot_id: int, num_tokens: int) -> bytes:
        self._ggml_slot(slot_id, self.max_model_len)
        return self.ggml_export(slot_id, num_tokens)

    def import_slot(self, slot_id: int, payload: bytes, num_tokens: int) -> None:
        if self.mirror is not None:
            self.mirror.trim(slot_id, 0)
        self.ggml_import(slot_id, payload, num_tokens)

    def ggml_export(self, slot_id: int, num_tokens: int) -> bytes:
        """llama.cpp's own KV of the slot, whatever the mirror holds."""
        return super().export_slot(slot_id, num_tokens)

    def ggml_import(self, slot_id: int, payload: bytes, num_tokens: int) -> None:
        super().import_slot(slot_id, payload, num_tokens)

    def calibrate_threads(self, *args, **kwargs):
        """ggml's own thread calibration times ggml's passes: the wide path stays out of it."""
        self._wide_paused = True
        try:
            return super().calibrate_threads(*args, **kwargs)
        finally:
            self._wide_paused = False

    # ---- the wide prefill ----

    def _wide_prefill(
        self, seqs: list[ScheduledSeq], spare_threads: int = 0
    ) -> tuple[list[ScheduledSeq], dict[str, str]]:
        """Without wide decode: compute the KV of every seq's tokens but a sampled last one
        and import it into llama.cpp's slot; return those last tokens as 1-token seqs (for
        llama.cpp's pass), and the seqs that failed alone."""
        assert self.wide is not None
        errors: dict[str, str] = {}
        chunks: list[SeqChunk] = []
        ok: list[tuple[ScheduledSeq, SlotRows | None]] = []
        token_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            n = len(seq.token_ids) - (1 if seq.num_logits else 0)
            chunk = SeqChunk(len(token_ids), n, seq.start_position)
            prior, error = self._ggml_prior(seq, chunk)
            if error is not None:
                errors[seq.request_id] = error
                continue
            chunks.append(chunk)
            ok.append((seq, prior))
            token_ids += seq.token_ids[:n]
            positions += range(seq.start_position, seq.start_position + n)
        if not ok:
            return [], errors
        self._set_torch_threads(spare_threads)
        keys, values = self.wide.kv(
            torch.tensor(token_ids, dtype=torch.long),
            torch.tensor(positions, dtype=torch.long),
            chunks,
        )
        tails = []
        for (seq, prior), chunk in zip(ok, chunks):
            error = self._import(seq, prior, chunk, keys, values)
            if error is not None:
                errors[seq.request_id] = error
            elif seq.num_logits:
                tails.append(replace(seq, token_ids=seq.token_ids[-1:], start_position=chunk.end))
        return tails, errors

    def _ggml_prior(self, seq, chunk: SeqChunk) -> tuple[SlotRows | None, str | None]:
        """The slot's earlier KV, read from llama.cpp (which gets the chunk's KV after it)."""
        assert self.wide is not None
        error = self._trim_slot(seq.slot_id, seq.start_position)
        if error is not None or not seq.start_position:
            return None, error
        prior, error = self._prior_rows(seq)
        if prior is not None:
            chunk.prior_k = [self.wide.from_gguf_keys(k) for k in prior.k]
            chunk.prior_v = [self.wide.from_gguf_values(v) for v in prior.v]
        return prior, error

    def _prior_rows(self, seq: ScheduledSeq) -> tuple[SlotRows | None, str | None]:
        try:
            rows = ggml_kv_rows.parse_chunk(self.export_slot(seq.slot_id, seq.start_position))
        except ValueError as exc:
            return None, f"wide pass: the slot's KV cannot be read: {exc}"
        if not np.array_equal(rows.positions, np.arange(seq.start_position)):
            return None, "wide pass: the slot's KV is not positions [0, start)"
        return rows, None

    def _import(self, seq, prior, chunk: SeqChunk, keys, values) -> str | None:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        dtype = ggml_kv_rows.GGML_TYPES[0 if self.kv_cache_dtype == "f32" else 1]
        new = SlotRows(
            np.arange(seq.start_position, seq.start_position + chunk.num_tokens, dtype=np.int32),
            [k[rows].numpy().astype(dtype) for k in keys],
            [v[rows].numpy().astype(dtype) for v in values],
            v_trans=not self.flash_attn,
        )
        full = new if prior is None else ggml_kv_rows.concat(prior, new)
        try:
            self.import_slot(seq.slot_id, ggml_kv_rows.build_chunk(full), full.num_cells)
        except ValueError as exc:
            return f"wide pass: llama.cpp refused the computed KV: {exc}"
        return None

    def _set_torch_threads(self, spare_threads: int, num_tokens: int | None = None) -> None:
        threads = self.n_threads_batch
        if self.thread_plan is not None:
            threads = self.thread_plan.for_tokens(num_tokens or self.max_num_batched_tokens)
        threads = max(1, threads - spare_threads)  # a grammar compiling beside the pass
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _merge(result: StepResult, other: StepResult) -> None:
    """Add the torch decodes' results to the llama.cpp pass's (disjoint requests)."""
    result.sampled_token_ids.update(other.sampled_token_ids)
    result.logprobs.update(other.logprobs)
    result.errors.update(other.errors)
    result.kept_logits.update(other.kept_logits)
    result.sample_time_s += other.sample_time_s


def _prefill_rows(chunks: list[ScheduledSeq]):
    """step_logits' prefill argument (None without chunks), and which chunks sample."""
    if not chunks:
        return None, []
    token_ids: list[int] = []
    positions: list[int] = []
    rows = []
    for seq in chunks:
        n = len(seq.token_ids)
        rows.append(SeqChunk(len(token_ids), n, seq.start_position))
        token_ids += seq.token_ids
        positions += range(seq.start_position, seq.start_position + n)
    logits_of = [j for j, s in enumerate(chunks) if s.num_logits]
    return (token_ids, positions, rows, [s.slot_id for s in chunks]), logits_of
