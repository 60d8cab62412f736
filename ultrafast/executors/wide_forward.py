"""The wide pass: a PyTorch forward of a GGUF's weights that computes prefill chunks' KV.

Why: on CPUs with bf16 matrix units (AMX, AVX512-BF16) oneDNN's bf16 GEMM runs a many-row
pass several times faster than llama.cpp's kernels (docs/ARCHITECTURE.md "Wide passes"). This
module's `kv` only produces KV: the chunk's last token then runs in llama.cpp over that KV
(wide_exec.py), so a prefill's logits stay llama.cpp's; wide decode steps (wide_decode.py) use
the same weights plus the final norm and lm_head kept here.

Layout: the residual stream is float32; each linear layer takes its input in the GEMMs' dtype
(bf16 against bf16 weights where that product is the faster, else float32 against float32
copies: packed_linear.gemm_dtype; a pass that samples rounds its inputs to bf16 either way,
`run_layers`) (q/k/v and gate/up fused: one GEMM each; packed once into oneDNN's layout where
that works, packed_linear.py); norms and RoPE run in float32 (fused C kernels where they win,
fused_ops.py); attention runs per sequence and layer over the slot's earlier KV (from
llama.cpp or the torch mirror) plus the chunk (`_causal_attention`): on AMX tiles where that
kernel wins (prefill_attention.py), else torch's fused SDPA. The last layer stops after
its K/V: nothing reads its output. Keys come out in llama.cpp's layout
(interleaved RoPE pairs for the "llama" arch, whose q/k rows converters permute).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ultrafast.cpu_contention import BusyWindow
from ultrafast.executors import fused_ops, prefill_attention
from ultrafast.executors.packed_linear import (
    COPIED,
    HALF,
    HALF_ROWS,
    HALVES,
    PACKED,
    TILES,
    Weight,
    build,
    fastest_kernel,
    gemm_dtype,
    linear,
    weight,
)
from ultrafast.executors.tile_gemm import MAX_ROWS as TILE_ROWS
from ultrafast.executors.wide_weights import (
    BF16,
    GEMM_KINDS,
    Layer,
    layer_weights,
    model_weights,
)
from ultrafast.model.config import ModelConfig
from ultrafast.model.gguf_meta import read_gguf_metadata
from ultrafast.model.gguf_weights import GGUF_ARCHITECTURES, gguf_model_config
from ultrafast.model.llama import rope_tables

_F32_EMBEDDING_MAX_BYTES = 512 << 20  # exact f32 rows (as llama.cpp's get_rows) below this


@dataclass
class SeqChunk:
    """One sequence of a wide pass: its new tokens' rows [start, start + n) of the flat batch,
    the positions they take, and the slot's earlier KV per layer ([kv_heads, P, head_dim] bf16
    in HF layout) or None when the chunk starts at position 0."""

    start: int
    num_tokens: int
    position: int
    prior_k: list[torch.Tensor] | None = None
    prior_v: list[torch.Tensor] | None = None

    @property
    def end(self) -> int:
        """The position after the chunk's last token."""
        return self.position + self.num_tokens


def padded_rows(rows: int) -> int:
    """The row count a prefill pass runs on: exact up to 32, above it the next multiple of 16
    (at most 15 wasted rows: +10% at 102 tokens, +3% at 500), so a few dozen GEMM shapes
    cover every chunk length."""
    return rows if rows <= 32 else -(-rows // 16) * 16


HEAD = "head"  # the lm_head's row counts in `_kernels` (timed up to TILE_ROWS: decode steps)
GEMM_GROUP_S = 0.3  # GEMM row counts timed together, then checked for a quiet machine
QUIET_BUSY_CORES = 0.25  # other processes' cores busy above which a group's timings are noise
GEMM_RETRY_S = 5.0
WARM_ROWS_MAX = 2048  # row counts built at load at most: a longer pass pays a few % once


def gemm_row_counts(max_tokens: int, max_decodes: int) -> list[int]:
    """Every row count a wide pass can run its GEMMs on, for steps of at most `max_tokens`
    prompt tokens beside at most `max_decodes` decodes (padded_rows' values), up to
    WARM_ROWS_MAX."""
    top = min(padded_rows(max_tokens + max_decodes), WARM_ROWS_MAX)
    return sorted({padded_rows(n) for n in range(1, top + 1)})


def unsupported(config: ModelConfig) -> str | None:
    """Why this forward cannot compute the model's KV, or None."""
    if any(w is not None for w in config.layer_sliding_windows):
        return "the model has sliding-window layers"
    if config.o_proj_bias or config.mlp_bias:
        return "the model has o_proj / MLP biases"
    return None


class WideForward:
    def __init__(self, gguf_path: str | Path, max_positions: int):
        meta = read_gguf_metadata(gguf_path)
        self.config = config = gguf_model_config(meta)
        why = unsupported(config)
        if why:
            raise ValueError(why)
        self.interleaved = GGUF_ARCHITECTURES[meta.architecture][1]
        tensors = dict(model_weights(meta, config))
        self.layers = [layer_weights(tensors, i) for i in range(config.num_hidden_layers)]
        embed = tensors.pop("model.embed_tokens.weight")
        small = embed.numel() * 4 <= _F32_EMBEDDING_MAX_BYTES
        self.embed = embed.float() if small else embed.to(BF16)
        # the final norm and the bf16 lm_head serve wide decode steps (wide_decode.py)
        self.norm: torch.Tensor | None = tensors.pop("model.norm.weight", None)
        lm_head = tensors.pop("lm_head.weight", None)
        # packed (a copy in oneDNN's layout), except a tied head beside a bf16 embedding (a
        # large vocabulary) with bf16 GEMMs: the two share one tensor, as a second copy costs
        # more memory than the packing saves time. With float32 GEMMs (gemm_dtype) the head
        # is a float32 copy of the bf16-rounded matrix all the same: the exact float32
        # embedding as the head moved SmolLM2 Q4_1's decode perplexity 0.67% from llama.cpp's
        # (0.40% with the rounded one, as the bf16 path gives; 2-core AVX2 EPYC)
        tied_bf16 = lm_head is None and self.embed.dtype == BF16 == gemm_dtype()[0]
        head = embed if lm_head is None else lm_head
        self.lm_head = self.embed if tied_bf16 else weight(head.to(BF16))
        # the activations of KV passes (`kv`): float32 where the GEMMs are, without a bf16
        # round trip a product (on the AVX2 EPYC the copies were 4% of a 1,024-token pass,
        # bf16 SDPA 15% slower). Passes that sample (wide decode) round to bf16 whatever the
        # GEMM dtype: float32 activations moved SmolLM2 Q4_1's decode perplexity 0.54% from
        # llama.cpp's (0.40% rounded: llama.cpp's own activations are 8-bit there)
        self.act = gemm_dtype()[0]
        cos, sin = rope_tables(config, max_positions)
        self.cos, self.sin = cos, sin  # float32 [positions, head_dim]
        self.eps = config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        # the fused elementwise ops (fused_ops.py) where they win here; None: torch's ops
        self.fused, self.fused_status = fused_ops.choice(
            config.hidden_size, config.intermediate_size, self.heads + self.kv_heads, self.head_dim
        )
        # the AMX prefill attention kernel (prefill_attention.py) where it wins (it takes bf16
        # rows); None: SDPA
        self.prefill_kernel, self.prefill_status = (
            prefill_attention.choose(self.heads, self.kv_heads, self.head_dim)
            if self.act == BF16
            else (None, "prefill attention: torch SDPA (float32 activations)")
        )
        self.gemms_untimed: list[int] = []  # row counts built, not timed yet
        self.gemm_rows: list[int] = []  # the row counts warm_gemms built (timed or cached)
        self.gemms_cached = False  # the kernels came from an earlier start's timing
        # per matrix kind, the row counts measured faster on another kernel than the packed
        # weight's, and that kernel (packed_linear.fastest_kernel: a copy's or halves;
        # time_gemms)
        self._kernels: dict[str, dict[int, str]] = {}
        self._gemms_retry_at = 0.0  # after a group timed on a busy machine: not before

    @torch.inference_mode()
    def warm_gemms(self, row_counts: list[int]) -> None:
        """Build one layer's GEMMs at each row count, on every kernel: oneDNN builds a
        primitive per row count (~0.3 ms a GEMM at 16 rows, ~4 ms at 528, AMX Xeon) and keeps
        it for every layer and thread, so a served step never pays one (a new count had cost
        a step 10-20 ms; halves run counts built here). Which kernel runs each count is timed
        later, on an idle engine (`time_gemms`): the load runs beside serving passes, and
        timed there the choice came out different on every start. ~1 s for a 1,024-token
        budget, off the engine thread."""
        first = self.layers[0]
        for kind in GEMM_KINDS:
            getattr(first, kind).unpack()  # the first layer's other copies: built and timed
            build(getattr(first, kind), row_counts, first.qkv_bias if kind == "qkv" else None)
        if min(row_counts, default=HALF_ROWS + 1) <= HALF_ROWS:
            # float16 copies of every layer's (and the head's) weights, timed as a decode step
            # streams them (`_stream`); `time_gemms` frees those no row count chose
            for w in [getattr(layer, kind) for layer in self.layers for kind in GEMM_KINDS]:
                w.copy_for(HALF)
            if isinstance(self.lm_head, Weight):
                self.lm_head.copy_for(HALF)
        self.gemms_untimed = list(row_counts)
        self.gemm_rows = list(row_counts)

    def gemms_due(self) -> bool:
        """Are GEMM row counts left to time, and is it time to try (time_gemms)?"""
        return bool(self.gemms_untimed) and time.monotonic() >= self._gemms_retry_at

    @torch.inference_mode()
    def time_gemms(self, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Per matrix kind, the row counts whose product runs faster on another kernel than
        the packed weight's (packed_linear.fastest_kernel: the plain weight's, the one-row
        packing's, or in halves; on the first layer: a kind has one shape in every layer), for
        the counts `warm_gemms` built, smallest first (halves run the smaller counts'
        choices); True once all are timed, the choice given to every layer (a copy made where
        a count needs it, the first layer's freed where none does). Gives way (False) when
        `should_stop()`, timed on from where it stopped at the next call. Counts are timed in
        groups of ~GEMM_GROUP_S; a group during which other processes kept more than
        QUIET_BUSY_CORES busy is dropped and tried again GEMM_RETRY_S later: beside a peer's
        start the verdicts scattered (down plain at 64-128 rows, not at 224-544). A last group
        shorter than BusyWindow's window is kept as is."""
        first = self.layers[0]
        while self.gemms_untimed:
            window, started, group = BusyWindow(), time.monotonic(), list[int]()
            found: dict[str, dict[int, str]] = {}
            while self.gemms_untimed and time.monotonic() - started < GEMM_GROUP_S:
                if should_stop():
                    self.gemms_untimed[:0] = group
                    self._choose(first, keep_copies=True)
                    return False
                rows = self.gemms_untimed.pop(0)  # one count: ~1-30 ms
                group.append(rows)
                for kind in GEMM_KINDS:
                    w, bias = getattr(first, kind), first.qkv_bias if kind == "qkv" else None
                    kernel = fastest_kernel(w, rows, bias, stream=self._stream(kind, rows, bias))
                    if kernel != PACKED:
                        found.setdefault(kind, {})[rows] = kernel
                        w.choose({**self._kernels.get(kind, {}), **found[kind]})
                        w.unpack()  # still timed at the next counts
                head = self.lm_head
                if isinstance(head, Weight) and rows <= max(TILE_ROWS, HALF_ROWS):  # decodes
                    kernel = fastest_kernel(head, rows, stream=[head])  # HALF too
                    if kernel != PACKED:
                        found.setdefault(HEAD, {})[rows] = kernel
            busy = window.others_busy_cores()
            if busy is not None and busy > QUIET_BUSY_CORES:
                self.gemms_untimed[:0] = group
                self._choose(first, keep_copies=True)
                self._gemms_retry_at = time.monotonic() + GEMM_RETRY_S
                return False
            for kind, kernels in found.items():
                self._kernels.setdefault(kind, {}).update(kernels)
        self._choose_everywhere()
        return True

    def kernel_choices(self) -> dict[str, dict[str, str]]:
        """The timed choices as JSON keeps them (kind -> row count -> kernel), for the
        start-cost cache (wide_lazy.py): a later start on this CPU, file and flags takes them
        instead of ~60 s of timing (SmolLM2, 2-core AVX2 EPYC)."""
        assert not self.gemms_untimed, "time_gemms first"
        return {kind: {str(r): k for r, k in rows.items()} for kind, rows in self._kernels.items()}

    def use_kernel_choices(self, choices: object) -> bool:
        """Take an earlier start's `kernel_choices` for the counts warm_gemms built (every
        layer and the head chosen, the copies no count needs freed, nothing left to time);
        False, with nothing changed, where the record is not such a choice."""
        kinds = {*GEMM_KINDS, HEAD}
        known = {*COPIED, HALVES, TILES, HALF, PACKED}
        if not isinstance(choices, dict) or not set(choices) <= kinds:
            return False
        kernels: dict[str, dict[int, str]] = {}
        for kind, rows in choices.items():
            if not isinstance(rows, dict) or not set(rows.values()) <= known:
                return False
            try:
                kernels[kind] = {int(r): k for r, k in rows.items()}
            except ValueError:
                return False
        self._kernels, self.gemms_untimed, self.gemms_cached = kernels, [], True
        self._choose_everywhere()
        return True

    def _stream(self, kind: str, rows: int, bias: torch.Tensor | None) -> list[Weight]:
        """Where TILES or HALF may take `rows` rows: the kind's matrix of every layer, timed
        in turn (packed_linear._calls). Timed on the first layer alone, its weight sat in the
        cache and TILES won 0-16 of the 16 counts by kind; a decode step streams every
        layer's (16 rows: the step's GEMMs 14.5 -> 10.2 ms with TILES, 2-core AMX Xeon)."""
        if rows > max(TILE_ROWS if bias is None else 0, HALF_ROWS):
            return []
        return [getattr(layer, kind) for layer in self.layers]

    def _choose_everywhere(self) -> None:
        """Every layer and the head take the kinds' choices (timed, or from the cache)."""
        for layer in self.layers:
            self._choose(layer)
        if isinstance(self.lm_head, Weight):
            self.lm_head.choose(self._kernels.get(HEAD, {}))

    def _choose(self, layer: Layer, keep_copies: bool = False) -> None:
        """`layer`'s weights take the kinds' accepted choices (`keep_copies`: the first
        layer's other copies stay for the counts still to time)."""
        for kind in GEMM_KINDS:
            w = getattr(layer, kind)
            w.choose(self._kernels.get(kind, {}))
            if keep_copies:
                w.unpack()

    @property
    def kernels_status(self) -> str:
        """Which native kernels the passes use, and why: the status line's clauses."""
        return f"{self.fused_status}; {self.prefill_status}; {self.gemm_status}"

    @property
    def gemm_status(self) -> str:
        """Where the GEMMs leave oneDNN's packed weights for another kernel (warm_gemms)."""
        if self.gemms_untimed:
            return "GEMMs: packed weights (other kernels timed when the engine is next idle)"
        parts = []
        for kernel in (*COPIED, HALVES, TILES, HALF):
            kinds = [
                f"{kind} at {len(rows)} ({min(rows)}-{max(rows)})"
                for kind, kernels in self._kernels.items()
                if (rows := [r for r, k in kernels.items() if k == kernel])
            ]
            if kinds:
                parts.append(f"{kernel} for {', '.join(kinds)}")
        cached = " (cached)" if self.gemms_cached else ""
        if not parts:
            return f"GEMMs: packed weights at every row count{cached}"
        return f"GEMMs: measured faster than packed weights: {'; '.join(parts)} row counts{cached}"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)  # one fused op, same numbers

    def norm_for_gemm(self, x: torch.Tensor, weight: torch.Tensor, act=BF16) -> torch.Tensor:
        """The RMS norm of float32 rows as the input of the next GEMM: bf16 from the fused
        ops, else in `act` (bf16, or float32 where a pass keeps float32 activations)."""
        if self.fused is not None:
            return fused_ops.norm_bf16(self.fused, x, weight, self.eps)
        return self._norm(x, weight).to(act)

    def add_norm_for_gemm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, act=BF16):
        """x += y in place (the residual stream and a branch's output), then the RMS norm of
        the sum as the next GEMM's input: one fused pass where the add and the norm each
        read x."""
        if self.fused is not None and y.dtype == BF16:
            return fused_ops.add_norm_bf16(self.fused, x, y, weight, self.eps)
        return self.norm_for_gemm(x.add_(y), weight, act)

    def run_layers(
        self,
        x: torch.Tensor,
        attend: Callable[[int, torch.Tensor], torch.Tensor | None],
        act: torch.dtype = BF16,
    ) -> None:
        """Every decoder layer over float32 rows x, in place, the GEMMs' inputs in `act`
        (bf16: the bf16 path's numbers whatever the GEMM dtype; float32 where the GEMMs are
        float32 and nothing samples from the pass, `kv`). `attend(i, h)` takes layer i's
        q|k|v projection h ([T, (heads + 2 kv_heads) * d]) to the attention's output
        [T, heads * d], or None to stop there (nothing reads the rest). Each residual add
        runs fused with the norm that reads the sum (`add_norm_for_gemm`)."""
        xn = self.norm_for_gemm(x, self.layers[0].attn_norm, act)
        for i, layer in enumerate(self.layers):
            attended = attend(i, linear(xn, layer.qkv, layer.qkv_bias))
            if attended is None:
                return
            xn = self.add_norm_for_gemm(x, linear(attended, layer.o), layer.ffn_norm, act)
            out = self.mlp(xn, layer)
            if i + 1 < len(self.layers):
                xn = self.add_norm_for_gemm(x, out, self.layers[i + 1].attn_norm, act)
            else:
                x.add_(out)

    def mlp(self, xn: torch.Tensor, layer: Layer) -> torch.Tensor:
        """The MLP's output (before the residual add) for its normed bf16 input rows xn."""
        h = linear(xn, layer.gate_up)
        if self.fused is not None:
            act = fused_ops.silu_mul(self.fused, h)
        else:
            act = fused_ops.torch_silu_mul(h)
        return linear(act, layer.down)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    @torch.inference_mode()
    def kv(
        self, token_ids: torch.Tensor, positions: torch.Tensor, seqs: list[SeqChunk]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of every token per layer, float32 [T, kv_heads * head_dim], K in the GGUF's
        own (llama.cpp) layout.

        The pass runs on a row count rounded up to `padded_rows` (zero rows no sequence reads,
        dropped from the result): oneDNN builds a GEMM primitive per row count, 4-11 ms a shape
        the first time, so a server whose every prefill step had a new length paid it on
        nearly every step (4 shapes a layer, the cache holding 1,024)."""
        rows = len(token_ids)
        extra = padded_rows(rows) - rows
        if extra:
            token_ids, positions = F.pad(token_ids, (0, extra)), F.pad(positions, (0, extra))
        x = self.embed[token_ids].float()
        cos, sin = self.cos[positions], self.sin[positions]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []

        def attend(i: int, h: torch.Tensor) -> torch.Tensor | None:
            qk, v = self.rope_qk(h, self.layers[i], cos, sin)
            keys.append(self._to_gguf_keys(qk[:, self.heads :]))
            values.append(v.float().reshape(v.shape[0], -1))
            if i == len(self.layers) - 1:  # the last token's pass in llama.cpp reads no more
                return None
            qk = qk.to(self.act)
            return self._attend(i, qk[:, : self.heads], qk[:, self.heads :], v.to(self.act), seqs)

        self.run_layers(x, attend, self.act)
        if extra:
            return [k[:rows] for k in keys], [v[:rows] for v in values]
        return keys, values

    def stores_rope(self, layer: Layer) -> bool:
        """Can fused_ops.rope_store take this layer's projection straight to bf16 queries and
        the mirror's K/V rows (the fused ops, no q/k norms)?"""
        return self.fused is not None and layer.q_norm is None

    def rope_qk(self, h: torch.Tensor, layer: Layer, cos: torch.Tensor, sin: torch.Tensor):
        """The query and key heads after RoPE as one float32 [T, heads + kv_heads, d] (queries
        first), and the values bf16 [T, kv_heads, d], from the projection h. One RoPE over q
        and k together: a decode step is a thousand small ops, each a parallel region a busy
        core can stall."""
        num_tokens, d, heads = h.shape[0], self.head_dim, self.heads
        k_end = (heads + self.kv_heads) * d
        v = h[:, k_end:].view(num_tokens, self.kv_heads, d)
        if self.fused is not None and layer.q_norm is None:  # one fused pass: bf16 -> RoPE'd
            return fused_ops.rope(self.fused, h, heads + self.kv_heads, d, cos, sin), v
        qk = h[:, :k_end].float().view(num_tokens, heads + self.kv_heads, d)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = self._norm(qk[:, :heads], layer.q_norm), self._norm(qk[:, heads:], layer.k_norm)
            qk = torch.cat([q, k], dim=1)
        return self._rope(qk, cos, sin), v

    def _to_gguf_keys(self, k: torch.Tensor) -> torch.Tensor:
        if self.interleaved:  # halves (x_i, x_{i+d/2}) back to llama.cpp's pairs (x_2i, x_2i+1)
            k = k.view(k.shape[0], self.kv_heads, 2, self.head_dim // 2).transpose(-1, -2)
        return k.reshape(k.shape[0], -1)

    def from_gguf_keys(self, k: np.ndarray) -> torch.Tensor:
        """llama.cpp's K rows [P, kv_heads * head_dim] -> [kv_heads, P, head_dim] (HF) in the
        attention's dtype (`act`)."""
        t = torch.from_numpy(np.array(k)).view(-1, self.kv_heads, self.head_dim)  # a writable copy
        if self.interleaved:
            t = t.view(-1, self.kv_heads, self.head_dim // 2, 2).transpose(-1, -2)
            t = t.reshape(-1, self.kv_heads, self.head_dim)
        return t.to(self.act).transpose(0, 1).contiguous()

    def from_gguf_values(self, v: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(v)).view(-1, self.kv_heads, self.head_dim)
        return t.to(self.act).transpose(0, 1).contiguous()

    def _attend(self, layer: int, q, k, v, seqs: list[SeqChunk]) -> torch.Tensor:
        """[T, heads * head_dim] in q's dtype: each sequence's queries over its earlier KV + its
        own."""
        out = torch.zeros(q.shape[0], self.heads * self.head_dim, dtype=q.dtype)  # padding: 0
        for s in seqs:
            rows = slice(s.start, s.start + s.num_tokens)
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            if s.prior_k is not None and s.prior_v is not None:
                ks = torch.cat([s.prior_k[layer], ks], dim=1)
                vs = torch.cat([s.prior_v[layer], vs], dim=1)
            out[rows] = self._causal_attention(q[rows], ks, vs)
        return out

    def _causal_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ):
        """One sequence's T queries [T, heads, d] over its P + T keys and values
        [kv_heads, P + T, d] (the last T its own, causal): [T, heads * d] bf16. The AMX kernel
        where it was chosen, else torch's fused SDPA (`mask`: causal_mask(T, P + T), built
        once per pass by the caller, or here): both without a [T, P + T] score matrix in
        memory, both grouping query heads instead of expanding K/V. Written into `out` (the
        pass's rows) where given, and returned."""
        if self.prefill_kernel is not None:
            return prefill_attention.attend(self.prefill_kernel, q, k, v, out)
        attended = prefill_attention.sdpa(q, k, v, mask)
        return attended if out is None else out.copy_(attended)
