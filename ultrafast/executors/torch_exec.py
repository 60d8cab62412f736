"""The reference executor (and the GPU path): our PyTorch Llama over static per-slot KV.

One forward pass per step over every scheduled token, flattened; logits are computed only for
the rows the plan samples from, then `sample_plan` picks the tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ultrafast.core.types import ScheduledSeq, StepPlan, StepResult
from ultrafast.model.attention import SeqSpan, SlotKVCache
from ultrafast.model.llama import LlamaForCausalLM
from ultrafast.model.loader import load_model
from ultrafast.runtime.sampler import sample_plan


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchExecutor:
    def __init__(self, model: str | Path | LlamaForCausalLM, num_slots: int, max_model_len: int,
                 device: str | None = None, dtype: str | None = None):
        self.device = torch.device(device or _default_device())
        dtype = dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        if isinstance(model, LlamaForCausalLM):
            self.model = model.to(self.device).eval()
        else:
            self.model, _ = load_model(model, dtype=dtype, device=self.device)
        config = self.model.config
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.vocab_size = config.vocab_size
        cache_dtype = next(self.model.parameters()).dtype
        self.last_logits: torch.Tensor | None = None
        self.kv = SlotKVCache(config.num_hidden_layers, num_slots, max_model_len,
                              config.num_key_value_heads, config.head_dim, cache_dtype,
                              self.device)

    @classmethod
    def from_dir(cls, model_dir: str | Path, num_slots: int = 4, max_model_len: int = 2048,
                 **kwargs) -> "TorchExecutor":
        return cls(model_dir, num_slots, max_model_len, **kwargs)

    def _invalid(self, seq: ScheduledSeq) -> str | None:
        if not 0 <= seq.slot_id < self.num_slots:
            return f"slot {seq.slot_id} does not exist"
        if seq.start_position + seq.num_tokens > self.max_model_len:
            return "sequence is longer than the KV slot"
        if any(not 0 <= t < self.vocab_size for t in seq.token_ids):
            return f"token id out of vocabulary (size {self.vocab_size})"
        return None

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        for copy in plan.kv_copies:
            self.kv.copy_prefix(copy.src_slot_id, copy.dst_slot_id, copy.num_tokens)
        errors = {}
        seqs = []
        for seq in plan.seqs:
            problem = self._invalid(seq)
            if problem:
                errors[seq.request_id] = problem
            else:
                seqs.append(seq)
        if not seqs:
            return StepResult(errors=errors, execute_time_s=time.perf_counter() - t0)
        ids, positions, rows, offset = [], [], [], 0
        for seq in seqs:
            ids += seq.token_ids
            positions += range(seq.start_position, seq.start_position + seq.num_tokens)
            offset += seq.num_tokens
            rows += range(offset - seq.num_logits, offset)
        attn = self.kv.step([SeqSpan(s.slot_id, s.start_position, s.num_tokens) for s in seqs])
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(positions, device=self.device), attn)
        rows_t = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows_t])
        logits = logits.cpu() if self.device.type != "cpu" else logits
        self.last_logits = logits  # for parity tests against other implementations
        t1 = time.perf_counter()
        result = sample_plan(seqs, logits)
        result.errors.update(errors)
        result.execute_time_s = t1 - t0
        result.sample_time_s = time.perf_counter() - t1
        return result

    def close(self) -> None:
        self.kv = None  # type: ignore[assignment]
