"""Compiled decode for the torch executor: decode-only steps on static shapes.

A step in which every sequence feeds exactly one token and samples it (plain decode) is run by
`CompiledDecode` instead of the eager path. The batch is padded up to a fixed bucket
(1, 2, 4, 8, ... num_slots) with rows that write into a scratch KV slot nobody owns, and the
keys are read up to a bucketed length (powers of two from `min_key_len`, capped at the slot
length), so every step hits one of a few fixed shapes:

- `mode="inductor"`: the step (model + logits) goes through `torch.compile`; the batch and key
  dimensions are marked dynamic, so a handful of compiles cover every bucket.
- `mode="graphs"`: the eager kernels at those static shapes (no compile).
- on CUDA, in both modes, each (batch, keys) bucket is captured once into a CUDA graph and
  replayed: one launch per step. (On CPU "graphs" is the static-shape twin without capture.)

Prefill chunks, drafts and mixed steps stay on the eager path; the eager `StepAttention` is the
slow twin that tests compare against (same greedy tokens, logits within float noise).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch.nn.functional as F

from ultrafast.core.types import ScheduledSeq
from ultrafast.model.attention import SlotKVCache
from ultrafast.model.llama import LlamaForCausalLM
from ultrafast.request import SamplingParams

log = logging.getLogger(__name__)

MODES = ("off", "graphs", "inductor")
# capture() runs the model on a scratch slot and samples nothing: any valid params do
_CAPTURE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def resolve_mode(compile: bool | str | None, device: torch.device) -> str:
    """None/"auto": CUDA graphs of the compiled step on CUDA, off on CPU (not measured to help
    yet: the lead decides by `ultrafast bench --compile`); True = inductor; False = off."""
    if compile is None or compile == "auto":
        if device.type != "cuda":
            return "off"
        # inductor's GPU code generator is triton; without it, graphs of the eager kernels
        return "inductor" if importlib.util.find_spec("triton") is not None else "graphs"
    if compile is True:
        return "inductor"
    if compile is False:
        return "off"
    if compile not in MODES:
        raise ValueError(f"compile must be one of auto, {', '.join(MODES)}; got {compile!r}")
    return compile


def argmax_on_device(device: torch.device, seqs: list[ScheduledSeq]) -> bool:
    """On a GPU, a step whose every sequence is plain greedy is sampled there (the sampler's
    batched argmax on the device tensor): only token ids cross to the host, not [B, vocab]
    float32 logits (513 KB per row at a 128k vocabulary)."""
    if device.type == "cpu":
        return False
    for s in seqs:
        p = s.sampling_params
        if not p.greedy or p.logit_bias or p.needs_penalties or p.logprobs:
            return False
    return True


def _powers_of_two_up_to(first: int, last: int) -> list[int]:
    sizes, n = [], max(1, first)
    while n < last:
        sizes.append(n)
        n *= 2
    return sizes + [last]


class _DecodeAttention:
    """Attention for B single-token queries, each over its slot's keys [0, num_keys)."""

    def __init__(
        self,
        cache: SlotKVCache,
        slot_ids: torch.Tensor,
        positions: torch.Tensor,
        key_positions: torch.Tensor,
    ):
        self.cache = cache
        self.slot_ids = slot_ids
        self.positions = positions
        self.num_keys = key_positions.shape[0]
        causal = key_positions[None, :] <= positions[:, None]  # [B, K]
        self.masks: dict[int | None, torch.Tensor] = {None: causal[:, None, None, :]}
        for window in {w for w in cache.layer_sliding_windows if w is not None}:
            windowed = causal & (key_positions[None, :] > positions[:, None] - window)
            self.masks[window] = windowed[:, None, None, :]

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_cache[self.slot_ids, :, self.positions] = k.to(k_cache.dtype)
        v_cache[self.slot_ids, :, self.positions] = v.to(v_cache.dtype)
        keys = k_cache[self.slot_ids, :, : self.num_keys].to(q.dtype)  # [B, Hkv, K, D]
        values = v_cache[self.slot_ids, :, : self.num_keys].to(q.dtype)
        b, hq, d = q.shape
        num_kv_heads = keys.shape[1]
        # GQA folded into the query dim: query head h reads KV head h // G, as in HF
        qb = q.reshape(b, num_kv_heads, hq // num_kv_heads, d)
        mask = self.masks[self.cache.layer_sliding_windows[layer_idx]]
        out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask)
        return out.reshape(b, hq, d)


def _mark_dynamic(*tensors: torch.Tensor) -> None:
    """Batch and key dims dynamic: one inductor compile serves every bucket (batch 1 apart)
    instead of one per shape (which would also run into dynamo's recompile limit)."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class _Graph:
    """One CUDA graph of the decode step at a fixed (batch, keys) shape, with its own inputs."""

    def __init__(
        self,
        step,
        scratch_slot: int,
        batch_size: int,
        key_positions: torch.Tensor,
        pool,
        dynamic: bool,
    ):
        device = key_positions.device
        self.inputs = torch.zeros((3, batch_size), dtype=torch.long, device=device)
        self.inputs[2].fill_(scratch_slot)  # warm-up and capture touch only the scratch slot
        args = (self.inputs[0], self.inputs[1], self.inputs[2], key_positions)
        if dynamic:
            _mark_dynamic(*args)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile + autotune outside the capture
            for _ in range(2):
                step(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step(*args)

    def run(self, packed: torch.Tensor) -> torch.Tensor:
        self.inputs.copy_(packed, non_blocking=True)
        self.graph.replay()
        return self.logits


class CompiledDecode:
    """Runs decode-only steps at padded static shapes; see the module docstring."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: SlotKVCache,
        scratch_slot: int,
        max_batch_size: int,
        mode: str,
        min_key_len: int = 128,
    ):
        if mode not in ("graphs", "inductor"):
            raise ValueError(f"CompiledDecode mode must be graphs or inductor, not {mode!r}")
        if not 0 <= scratch_slot < cache.num_slots:
            raise ValueError("the scratch slot must be one of the cache's slots")
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.mode = mode
        self.scratch_slot = scratch_slot
        self.batch_sizes = _powers_of_two_up_to(1, max_batch_size)
        self.key_lens = _powers_of_two_up_to(min(min_key_len, cache.max_len), cache.max_len)
        self.use_cuda_graphs = self.device.type == "cuda"
        self._key_positions = torch.arange(cache.max_len, device=self.device)
        self._step = self._eager_step
        if mode == "inductor":
            # On a CPU, freezing lets inductor treat the weights as constants and pre-pack
            # them for oneDNN's matmuls (a packed copy beside the model's own), which made
            # the demo model's compiled CPU decode faster (measure it with `ultrafast bench
            # --peers ours-engine-torch,transformers --compile inductor`).
            # The KV cache, written by every step, is not folded. Not measured on CUDA: off.
            # It is inductor's process-wide setting (torch.compile's `options` did not reach
            # the freezing pass: the steps still ran aten::mm), and ours is the only compile.
            if self.device.type == "cpu":
                import torch._inductor.config as inductor_config

                inductor_config.freezing = True
            self._step = torch.compile(self._eager_step, fullgraph=True)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self.num_steps = 0  # decode steps this path ran (tests check it was taken)
        self.disabled_reason: str | None = None  # set when a failure sent us back to eager

    def _eager_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor,
        key_positions: torch.Tensor,
    ) -> torch.Tensor:
        """ids, positions, slots [B]; key_positions [K] -> float32 logits [B, vocab]."""
        attn = _DecodeAttention(self.cache, slot_ids, positions, key_positions)
        hidden = self.model(input_ids, positions, attn)
        return self.model.compute_logits(hidden)

    def accepts(self, seqs: list[ScheduledSeq]) -> bool:
        return (
            self.disabled_reason is None
            and 0 < len(seqs) <= self.batch_sizes[-1]
            and all(s.num_tokens == 1 and s.num_logits == 1 for s in seqs)
        )

    def bucket(self, num_seqs: int, num_keys: int) -> tuple[int, int]:
        """The padded (batch, keys) shape a step of num_seqs reading num_keys positions runs at."""
        batch = next(b for b in self.batch_sizes if b >= num_seqs)
        keys = next(k for k in self.key_lens if k >= num_keys)
        return batch, keys

    def _packed(self, seqs: list[ScheduledSeq], batch_size: int) -> torch.Tensor:
        num_pad = batch_size - len(seqs)
        ids = [s.token_ids[0] for s in seqs] + [0] * num_pad
        positions = [s.start_position for s in seqs] + [0] * num_pad
        slots = [s.slot_id for s in seqs] + [self.scratch_slot] * num_pad
        return torch.tensor([ids, positions, slots], dtype=torch.long)

    def logits(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab] on the device, in plan order."""
        batch, keys = self.bucket(len(seqs), max(s.start_position for s in seqs) + 1)
        packed = self._packed(seqs, batch)
        key_positions = self._key_positions[:keys]
        if self.use_cuda_graphs:
            graph = self._graphs.get((batch, keys))
            if graph is None:
                graph = self._capture(batch, keys)
            out = graph.run(packed)
        else:
            packed = packed.to(self.device)
            inputs = (packed[0], packed[1], packed[2], key_positions)
            if self.mode == "inductor":
                _mark_dynamic(*inputs)
            out = self._step(*inputs)
        self.num_steps += 1
        return out[: len(seqs)]

    def _capture(self, batch: int, keys: int) -> _Graph:
        graph = _Graph(
            self._step,
            self.scratch_slot,
            batch,
            self._key_positions[:keys],
            self._pool,
            dynamic=self.mode == "inductor",
        )
        self._graphs[batch, keys] = graph
        return graph

    def capture(
        self, batch_sizes: list[int] | None = None, key_lens: list[int] | None = None
    ) -> int:
        """Compile/capture the given buckets now (default: all), so no client waits on it."""
        count = 0
        for batch in batch_sizes or self.batch_sizes:
            for keys in key_lens or self.key_lens:
                b, k = self.bucket(batch, keys)
                fake = [
                    ScheduledSeq("capture", self.scratch_slot, [0], k - 1, 1, _CAPTURE_PARAMS, 0, 0)
                ]
                if self.use_cuda_graphs:
                    if (b, k) not in self._graphs:
                        self._capture(b, k)
                else:
                    self.logits(fake * b)  # duplicate scratch rows: harmless
                    self.num_steps -= 1
                count += 1
        return count

    def disable(self, reason: str) -> None:
        log.error("compiled decode disabled, eager from now on: %s", reason)
        self.disabled_reason = reason
        self._graphs.clear()
