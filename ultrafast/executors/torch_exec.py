"""The reference executor (and the GPU path): our PyTorch Llama over static per-slot KV.

One forward pass per step over every scheduled token, flattened; logits are computed only for
the rows the plan samples from, then `sample_plan` picks the tokens. A request whose share of
the plan is invalid (a token id outside the vocabulary, a slot that does not exist, a sequence
longer than its slot) is reported in `StepResult.errors` and left out; the rest still runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ultrafast.core.types import KVCopy, ScheduledSeq, StepPlan, StepResult
from ultrafast.executors import torch_state
from ultrafast.executors.base import ExecutorCaps
from ultrafast.executors.prompt_scoring import scoring_problem, split_prompt_rows, wants_prompt_rows
from ultrafast.executors.torch_compiled import CompiledDecode, argmax_on_device, resolve_mode
from ultrafast.kvcache.fingerprint import kv_fingerprint
from ultrafast.model.attention import SeqSpan, SlotKVCache
from ultrafast.model.llama import LlamaForCausalLM
from ultrafast.model.loader import load_model, resolve_dtype
from ultrafast.sampling.sampler import sample_keeping_deferred, sample_kept_row


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchExecutor:
    def __init__(
        self,
        model: str | Path | LlamaForCausalLM,
        num_slots: int,
        max_model_len: int,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        compile: bool | str | None = None,
        n_threads: int | None = None,
    ):
        """`model`: an HF directory or a built LlamaForCausalLM (cast only if dtype is given).

        device None: cuda if available, else cpu. dtype None: float32 on CPU, bfloat16 on CUDA.
        compile: decode-only steps through `torch_compiled.CompiledDecode` (None/"auto": on
        CUDA only; True/"inductor"; "graphs": CUDA graphs of the eager kernels; False/"off").
        n_threads: torch's intra-op threads on CPU (process-wide), like the ggml executor's:
        `serve` leaves a core to the event loop, which torch's default (every core) contends.
        """
        self.device = torch.device(device or _default_device())
        if n_threads is not None and self.device.type == "cpu":
            if n_threads < 1:
                raise ValueError("n_threads must be >= 1")
            torch.set_num_threads(n_threads)
        if isinstance(model, LlamaForCausalLM):
            if dtype is not None:
                model = model.to(resolve_dtype(dtype, self.device))
            self.model = model.to(self.device).eval()
        else:
            self.model, _ = load_model(model, dtype=dtype, device=self.device)
        config = self.model.config
        self.config = config
        self._model_source = model
        self._fingerprint: str | None = None
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        self.model.set_max_positions(max_model_len)  # RoPE tables for exactly our positions
        self.last_logits: torch.Tensor | None = None  # the last step's logits, for parity tests
        compile_mode = resolve_mode(compile, self.device)
        num_scratch = 0 if compile_mode == "off" else 1  # padding rows of compiled steps
        self.kv = SlotKVCache(
            config.num_hidden_layers,
            num_slots + num_scratch,
            max_model_len,
            config.num_key_value_heads,
            config.head_dim,
            self.model.model.embed_tokens.weight.dtype,
            self.device,
            config.layer_sliding_windows,
        )
        self.decode: CompiledDecode | None = None
        if compile_mode != "off":
            self.decode = CompiledDecode(
                self.model,
                self.kv,
                scratch_slot=num_slots,
                max_batch_size=num_slots,
                mode=compile_mode,
            )

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        num_slots: int = 4,
        max_model_len: int = 2048,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        compile: bool | str | None = None,
    ) -> TorchExecutor:
        return cls(model_dir, num_slots, max_model_len, device=device, dtype=dtype, compile=compile)

    def _seq_problem(self, seq: ScheduledSeq) -> str | None:
        if not 0 <= seq.slot_id < self.num_slots:
            return f"slot {seq.slot_id} does not exist (num_slots={self.num_slots})"
        if not seq.token_ids:
            return "no tokens scheduled"
        if seq.start_position < 0 or seq.start_position + seq.num_tokens > self.max_model_len:
            return (
                f"positions {seq.start_position}..{seq.start_position + seq.num_tokens} do "
                f"not fit a KV slot of {self.max_model_len}"
            )
        if not 0 <= seq.num_logits <= seq.num_tokens:
            return f"num_logits {seq.num_logits} outside [0, {seq.num_tokens}]"
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= self.vocab_size:  # C-speed check
            bad = next(t for t in seq.token_ids if not 0 <= t < self.vocab_size)
            return f"token id {bad} out of vocabulary (size {self.vocab_size})"
        return scoring_problem(seq) if seq.num_prompt_logits else None

    def _copy_problem(self, copy: KVCopy) -> str | None:
        slots_ok = all(0 <= s < self.num_slots for s in (copy.src_slot_id, copy.dst_slot_id))
        if not slots_ok or not 0 <= copy.num_tokens <= self.max_model_len:
            return f"invalid prefix copy {copy}"
        return None

    def _validate(self, plan: StepPlan) -> tuple[list[ScheduledSeq], list[KVCopy], dict]:
        errors: dict[str, str] = {}
        copies = []
        for copy in plan.kv_copies:
            problem = self._copy_problem(copy)
            if problem is None:
                copies.append(copy)
                continue
            owners = [s.request_id for s in plan.seqs if s.slot_id == copy.dst_slot_id]
            if not owners:  # nobody to blame: a scheduler bug, not a request's fault
                raise ValueError(problem)
            errors.update((rid, problem) for rid in owners)
        seqs, used_slots = [], set()
        for seq in plan.seqs:
            problem = errors.get(seq.request_id) or self._seq_problem(seq)
            if problem is None and seq.slot_id in used_slots:
                problem = f"slot {seq.slot_id} is scheduled twice in one step"
            if problem is not None:
                errors[seq.request_id] = problem
            else:
                seqs.append(seq)
                used_slots.add(seq.slot_id)
        return seqs, copies, errors

    def _inputs(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flattened ids and positions, and the rows to sample (after a sequence's prompt-scoring
        rows, if any), in one host->device copy."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        offset = 0
        for seq in seqs:
            ids += seq.token_ids
            positions += range(seq.start_position, seq.start_position + seq.num_tokens)
            if seq.num_prompt_logits:
                rows += range(offset, offset + seq.num_prompt_logits)
            offset += seq.num_tokens
            rows += range(offset - seq.num_logits, offset)
        packed = torch.tensor(ids + positions + rows, dtype=torch.long)
        packed = packed.to(self.device, non_blocking=True)
        num_tokens = len(ids)
        return (packed[:num_tokens], packed[num_tokens : 2 * num_tokens], packed[2 * num_tokens :])

    @torch.inference_mode()
    def sample_kept(self, seq: ScheduledSeq, kept) -> StepResult:
        return sample_kept_row(seq, kept)

    def caps(self) -> ExecutorCaps:
        gpu = self.device.type == "cuda"
        return ExecutorCaps(
            keeps_logits=True, device_kind="gpu" if gpu else "cpu", last_logits=True
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        seqs, copies, errors = self._validate(plan)
        for copy in copies:
            self.kv.copy_prefix(copy.src_slot_id, copy.dst_slot_id, copy.num_tokens)
        if not seqs:
            return StepResult(errors=errors, execute_time_s=time.perf_counter() - t0)
        logits = self._compiled_logits(seqs)
        if logits is None:
            input_ids, positions, rows = self._inputs(seqs)
            attn = self.kv.begin_step(
                [SeqSpan(s.slot_id, s.start_position, s.num_tokens) for s in seqs]
            )
            hidden = self.model(input_ids, positions, attn)
            logits = self.model.compute_logits(hidden[rows])
        prompt_logprobs = {}
        if wants_prompt_rows(seqs):  # scored on the device; only the figures cross over
            logits, prompt_logprobs = split_prompt_rows(seqs, logits)
        if not argmax_on_device(self.device, seqs):
            logits = logits.cpu()  # the sampler works on the host; this also waits for the GPU
        self.last_logits = logits
        t1 = time.perf_counter()
        result = sample_keeping_deferred(seqs, logits)
        result.prompt_logprobs = prompt_logprobs
        result.errors.update(errors)
        result.execute_time_s = t1 - t0
        result.sample_time_s = time.perf_counter() - t1
        return result

    def _compiled_logits(self, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """The compiled decode's logits, or None when this step is not for it (the eager path
        runs it). A compile/capture failure turns the compiled path off, never fails a step:
        the decode step writes KV only at the positions it recomputes, so eager can redo it."""
        if self.decode is None or not self.decode.accepts(seqs):
            return None
        try:
            return self.decode.logits(seqs)
        except Exception as exc:  # noqa: BLE001 - inductor/CUDA-graph errors have many types
            self.decode.disable(f"{type(exc).__name__}: {exc}")
            return None

    # ---- KV export/import (kvcache/): slice copies of one slot ----

    def kv_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = kv_fingerprint(
                executor="torch",
                model_sha256=torch_state.weights_identity(self._model_source),
                kv_dtype=str(self.kv.k[0].dtype),
                architecture=type(self.model).__name__,
            )
        return self._fingerprint

    def export_slot(self, slot_id: int, num_tokens: int) -> bytes:
        return torch_state.export_slot(self.kv, slot_id, num_tokens)

    def import_slot(self, slot_id: int, payload: bytes, num_tokens: int) -> None:
        torch_state.import_slot(self.kv, slot_id, payload, num_tokens)

    def close(self) -> None:
        """Drop the KV and the weights; on CUDA hand the memory back to the driver."""
        self.kv = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
