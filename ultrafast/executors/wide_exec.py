"""The ggml executor with wide passes: prefill chunks' KV computed by a bf16 PyTorch forward.

A step's long prefill chunks (at least `wide_min_tokens` tokens, the crossover measured at
start by wide_route.py) leave the llama.cpp batch: the wide forward (wide_forward.py) computes
the KV of all their tokens but the last, over the slot's earlier KV exported from llama.cpp,
and the result is imported into the slot (ggml_kv_rows.py + the per-sequence state API). The
last token of a chunk that samples then runs in llama.cpp with the step's decodes, so logits,
sampling, kept rows and every other contract stay the plain GgmlExecutor's. Decodes,
draft verifications and prompt scoring never leave llama.cpp.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult
from ultrafast.executors import ggml_kv_rows
from ultrafast.executors.ggml_exec import GgmlExecutor
from ultrafast.executors.ggml_kv_rows import SlotRows
from ultrafast.executors.wide_forward import SeqChunk, WideForward
from ultrafast.executors.wide_lazy import WideLazy
from ultrafast.executors.wide_route import WIDE_PASS_MODES

log = logging.getLogger(__name__)


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

    # ---- routing ----

    def _routes(self, seq: ScheduledSeq) -> bool:
        return (
            len(seq.token_ids) >= max(2, self.wide_min_tokens)
            and seq.num_logits <= 1
            and not seq.num_prompt_logits
            and self._check(seq) is None
        )

    def execute(self, plan: StepPlan) -> StepResult:
        if self.wide is None and not self._wide_paused:
            self.wide_lazy.on_pass(plan)  # loads on first need; takes the weights once in
        if self.wide is None or self._wide_paused:
            return super().execute(plan)
        routed = [s for s in plan.seqs if self._routes(s)]
        if not routed:
            return super().execute(plan)
        start_s = time.perf_counter()
        for copy in plan.kv_copies:  # the wide pass reads the slots' earlier KV
            self._copy_prefix(copy.src_slot_id, copy.dst_slot_id, copy.num_tokens)
        tails, errors = self._wide_prefill(routed, plan.spare_threads)
        wide_s = time.perf_counter() - start_s
        taken = {id(s) for s in routed}
        rest = [s for s in plan.seqs if id(s) not in taken] + tails
        result = super().execute(replace(plan, seqs=rest, kv_copies=[])) if rest else StepResult()
        result.errors.update(errors)
        result.execute_time_s += wide_s
        return result

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
        """Compute and import the KV of every seq's tokens but a sampled last one; return those
        last tokens as 1-token seqs for llama.cpp, and the seqs that failed alone."""
        assert self.wide is not None
        errors: dict[str, str] = {}
        chunks: list[SeqChunk] = []
        ok: list[tuple[ScheduledSeq, SlotRows | None]] = []
        token_ids: list[int] = []
        positions: list[int] = []
        for seq in seqs:
            error = self._trim_slot(seq.slot_id, seq.start_position)
            prior = None
            if error is None and seq.start_position:
                prior, error = self._prior_rows(seq)
            if error is not None:
                errors[seq.request_id] = error
                continue
            n = len(seq.token_ids) - (1 if seq.num_logits else 0)
            chunk = SeqChunk(len(token_ids), n, seq.start_position)
            if prior is not None:
                chunk.prior_k = [self.wide.from_gguf_keys(k) for k in prior.k]
                chunk.prior_v = [self.wide.from_gguf_values(v) for v in prior.v]
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
                end = seq.start_position + chunk.num_tokens
                tails.append(replace(seq, token_ids=seq.token_ids[-1:], start_position=end))
        return tails, errors

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

    def _set_torch_threads(self, spare_threads: int) -> None:
        threads = self.n_threads_batch
        if self.thread_plan is not None:
            threads = self.thread_plan.for_tokens(self.max_num_batched_tokens)
        threads = max(1, threads - spare_threads)  # a grammar compiling beside the pass
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
