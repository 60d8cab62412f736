"""bf16 weights packed once into oneDNN's own blocked layout for the wide passes' GEMMs.

Why: `F.linear` on bf16 CPU tensors calls oneDNN, which reorders the weight into its blocked
(AMX / AVX-512) layout on every call. At a wide decode step's 16 rows the reorder costs about as
much as the product itself (2-core AMX Xeon, one thread, best of 40: gate/up [3072 x 576] 420 ->
267 us, the lm_head [49152 x 576] 8.7 -> 6.9 ms; 1,770 vs 2,064 us at 256 rows). mkldnn's
`_reorder_linear_weight` does the reorder once, at load (the op PyTorch's inductor uses when it
freezes weights); the packed tensor is the same size and its products are the same numbers.

Where the op is missing or its products differ from `F.linear`'s (a build without mkldnn, a
oneDNN without bf16 kernels on this CPU), weights stay plain tensors and `linear` is `F.linear`:
`pack_support()` says which, once, for the wide path's start-up line.

The packed kernel is not the faster one at every row count: on the AMX Xeon the plain weight's
kernel ran a prefill step's 512-row products with 576 outputs (attention output, MLP down)
~1.4x faster (o 0.30 vs 0.45 us a row, down 0.83 vs 1.2), and twice slower at 496 and 528
rows, while the packed one won every shape at 16-256 rows. So a `Weight` keeps both where a
measurement (`fastest_kernel`, interleaved, best of several, on an idle engine) found row
counts the plain kernel wins by a clear margin, and `linear` picks by the row count.

Some shapes neither kernel splits between the cores: on the same Xeon with 2 threads both ran
MLP down [576 x 1,536] at 576-1,024 rows on one thread (1.31 ms at 1,024 rows, the same as with
one thread, while the other core waited) and packed q/k/v at 768-1,024. Two calls of half the
rows each, each by its own row count's choice, are a third candidate ("halves": down 1.31 ->
0.89 ms at 1,024, 0.78 -> 0.61 at 576).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROWS_HINT = 16  # oneDNN picks its blocking for this many rows; every row count works


@functools.cache
def pack_support() -> str | None:
    """None when packed weights work here (checked against F.linear), else why not."""
    mkldnn = torch.backends.mkldnn
    if not mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bf16 kernels for this CPU"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    for rows in (1, 16, 40):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        try:
            got = _packed_linear(x, _reorder(weight), bias)
        except RuntimeError as exc:  # an op this build lacks
            return f"packing failed ({exc})"
        want = F.linear(x, weight, bias)
        if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
            return "packed products differ from F.linear's"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's layout when that works here, else `weight` itself."""
    if weight.dtype != torch.bfloat16 or pack_support() is not None:
        return weight
    return _reorder(weight.contiguous())


@dataclass(eq=False)
class Weight:
    """One matrix [out, in]: `packed` (oneDNN's layout where pack_support(), else the plain
    tensor) and, while `plain_rows` names row counts whose product runs faster on the plain
    tensor's kernel, `plain`: unpacked from `packed` (an exact copy) only where a row count
    needs it, so the load holds no second copy of every matrix. `split_rows`: the row counts
    multiplied in two halves (`halves`)."""

    packed: torch.Tensor
    plain: torch.Tensor | None = None
    plain_rows: frozenset[int] = frozenset()
    split_rows: frozenset[int] = frozenset()

    def unpack(self) -> None:
        """Hold the plain tensor too (to time it, or where a row count needs it)."""
        if self.plain is None and self.packed.is_mkldnn:
            self.plain = self.packed.to_dense()

    def keep_plain_for(self, rows: frozenset[int]) -> None:
        """Use the plain tensor at these row counts only; without any, free it."""
        if rows:
            self.unpack()
        self.plain_rows = rows if self.plain is not None else frozenset()
        if not self.plain_rows:
            self.plain = None

    def choose(self, kernels: dict[int, str]) -> None:
        """Each row count's kernel (`fastest_kernel`'s names; counts not named: packed)."""
        self.split_rows = frozenset(r for r, k in kernels.items() if k == HALVES)
        self.keep_plain_for(frozenset(r for r, k in kernels.items() if k == PLAIN))


def weight(matrix: torch.Tensor) -> Weight:
    """`matrix` packed (no plain copy kept: `Weight.unpack` makes one by need)."""
    return Weight(pack(matrix))


def linear(x: torch.Tensor, weight: torch.Tensor | Weight, bias: torch.Tensor | None = None):
    """x @ weight.T + bias for a packed or a plain weight, or a `Weight` by x's row count."""
    if isinstance(weight, Weight):
        rows = x.numel() // x.shape[-1]
        if rows in weight.split_rows:
            return halves(x, weight, bias)
        if weight.plain is not None and rows in weight.plain_rows:
            return F.linear(x, weight.plain, bias)
        weight = weight.packed
    if weight.is_mkldnn:
        return _packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def half_rows(rows: int) -> int:
    """The first half's rows: half of `rows` rounded up to a multiple of 16 (a row count the
    wide passes also run whole, so its own choice and oneDNN primitive exist)."""
    return -(-rows // 32) * 16


def halves(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias in two calls of about half the rows each, each by its own row count's
    choice (`linear`); the same numbers as those two calls."""
    flat = x.reshape(-1, x.shape[-1])
    split = half_rows(flat.shape[0])
    out = torch.cat((linear(flat[:split], w, bias), linear(flat[split:], w, bias)))
    return out.view(*x.shape[:-1], out.shape[-1])


PACKED, PLAIN, HALVES = "packed", "plain", "halves"
PLAIN_MARGIN = 0.85  # another kernel must take under this share of the packed one's time
TIMING_ROUNDS = 5
SPLIT_MIN_ROWS = 128  # fewer rows are not timed in halves (each half would be under 64)


def _calls(
    w: Weight, rows: int, bias: torch.Tensor | None, split: bool = False
) -> dict[str, Callable[[], object]]:
    """The packed product at `rows` rows, the plain one where `w` keeps it, and (`split`,
    at SPLIT_MIN_ROWS rows or more) the product in halves."""
    x = torch.zeros(rows, w.packed.shape[1], dtype=torch.bfloat16)
    calls: dict[str, Callable[[], object]] = {PACKED: functools.partial(linear, x, w.packed, bias)}
    if w.plain is not None:
        calls[PLAIN] = functools.partial(F.linear, x, w.plain, bias)
    if split and rows >= SPLIT_MIN_ROWS:
        calls[HALVES] = functools.partial(halves, x, w, bias)
    return calls


def build(w: Weight, row_counts: Iterable[int], bias: torch.Tensor | None = None) -> None:
    """Run `w`'s products once at every row count: oneDNN builds a primitive per row count
    (~0.3 ms a GEMM at 16 rows, ~4 ms at 528 on the AMX Xeon), which a served step must not
    pay; the plain tensor's too, where kept. (Halves run counts built here.)"""
    for rows in row_counts:
        for call in _calls(w, rows, bias).values():
            call()


def fastest_kernel(
    w: Weight,
    rows: int,
    bias: torch.Tensor | None = None,
    seconds_of: Callable[[Callable[[], object]], float] | None = None,
) -> str:
    """Which kernel multiplies `rows` rows by `w` fastest: PACKED (the default), PLAIN (`w`'s
    plain tensor, where kept) or HALVES (two calls by `w`'s current choices at the halves'
    counts: time the smaller counts first). TIMING_ROUNDS interleaved rounds (after `build`),
    best of each; another kernel wins under PLAIN_MARGIN of packed's best (drift hits all
    alike, and a near-tie keeps the default). Run it on an idle machine: beside busy threads
    the verdicts scatter. `seconds_of` times one call (tests give their own)."""
    calls = _calls(w, rows, bias, split=True)
    if len(calls) == 1:
        return PACKED
    time_call = seconds_of or _timer(calls[PACKED])
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(TIMING_ROUNDS):
        best = {name: min(best[name], time_call(call)) for name, call in calls.items()}
    rival = min((name for name in best if name != PACKED), key=best.__getitem__)
    return rival if best[rival] < PLAIN_MARGIN * best[PACKED] else PACKED


MIN_SAMPLE_S = 2e-4  # a timed sample repeats a call this long at least: a 1-row product
# takes ~10 us, where a single call's jitter picked plain weights at random row counts


def _timer(probe: Callable[[], object]) -> Callable[[Callable[[], object]], float]:
    """Seconds of one call, each sample repeating it to last MIN_SAMPLE_S (from `probe`)."""
    started = time.perf_counter()
    probe()
    once = max(time.perf_counter() - started, 1e-7)
    repeats = max(1, min(100, round(MIN_SAMPLE_S / once)))

    def seconds_of(call: Callable[[], object]) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        return (time.perf_counter() - started) / repeats

    return seconds_of


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
