"""Packed oneDNN weights (executors/packed_linear.py): same products as F.linear, any row count,
with and without bias; plain weights where packing is not supported."""

import time

import pytest
import torch
import torch.nn.functional as F

from ultrafast.executors import packed_linear
from ultrafast.executors.packed_linear import (
    PACKED_ONE_ROW,
    PLAIN,
    gemm_dtype,
    linear,
    pack,
    pack_support,
)

# the tests on `weight()` run in this CPU's measured GEMM dtype (float32 where bf16 is slow)
needs_packing = pytest.mark.skipif(
    pack_support(gemm_dtype()[0]) is not None,
    reason=f"packed weights unavailable here: {pack_support(gemm_dtype()[0])}",
)
BF16, F32 = torch.bfloat16, torch.float32


def _skip_unless_packable(dtype: torch.dtype) -> None:
    if pack_support(dtype) is not None:
        pytest.skip(f"packed {dtype} weights unavailable here: {pack_support(dtype)}")


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rows", [1, 2, 16, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_products_equal_f_linear(rows, with_bias, dtype):
    _skip_unless_packable(dtype)
    weight, x = _bf16(192, 96, seed=1).to(dtype), _bf16(rows, 96, seed=2).to(dtype)
    bias = _bf16(192, seed=3).to(dtype) if with_bias else None
    packed = pack(weight)
    assert packed.is_mkldnn and packed.dtype == dtype  # really packed, not the plain fallback
    got, want = linear(x, packed, bias), F.linear(x, weight, bias)
    assert got.shape == want.shape == (rows, 192) and got.dtype == dtype
    tolerance = 1e-2 if dtype == BF16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_packed_accepts_strided_and_batched_inputs(dtype):
    _skip_unless_packable(dtype)
    weight = _bf16(64, 48, seed=4).to(dtype)
    packed = pack(weight)
    strided = _bf16(48, 5, seed=5).to(dtype).t()  # not contiguous
    torch.testing.assert_close(linear(strided, packed).float(), F.linear(strided, weight).float())
    batched = _bf16(2, 3, 48, seed=6).to(dtype)
    torch.testing.assert_close(linear(batched, packed).float(), F.linear(batched, weight).float())


def test_other_dtypes_stay_plain():
    weight = torch.randn(8, 4, dtype=torch.float64)
    assert pack(weight) is weight
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))


def test_unsupported_packing_keeps_plain_weights(monkeypatch):
    monkeypatch.setattr(packed_linear, "pack_support", lambda dtype=BF16: "no kernels (test)")
    for dtype in (BF16, F32):
        weight = _bf16(16, 8, seed=7).to(dtype)
        assert pack(weight) is weight
        x = _bf16(4, 8, seed=8).to(dtype)
        assert torch.equal(linear(x, pack(weight)), F.linear(x, weight))


@needs_packing
@pytest.mark.parametrize("kernel", [PLAIN, PACKED_ONE_ROW])
def test_a_weight_multiplies_a_kernels_row_counts_on_that_kernels_copy(monkeypatch, kernel):
    """`linear` on a `Weight` takes the copy of the kernel chosen for a row count (the plain
    tensor, or oneDNN's packing for a one-row batch) and the packed one at every other; all
    give F.linear's products."""
    matrix = _bf16(96, 64, seed=9)
    w = packed_linear.weight(matrix)
    assert w.packed.is_mkldnn and w.copies == {}  # no second copy at load
    w.choose({3: kernel})
    assert list(w.copies) == [kernel] and w.kernel_at(3) == kernel and w.kernel_at(4) == "packed"
    if kernel == PLAIN:
        assert torch.equal(w.plain, matrix.to(w.packed.dtype))  # unpacked: the same numbers
    else:
        assert w.copies[kernel].is_mkldnn  # a second packing, not the plain tensor
    used = []
    real = packed_linear._packed_linear
    monkeypatch.setattr(
        packed_linear, "_packed_linear", lambda x, t, b: used.append(t) or real(x, t, b)
    )
    for rows, want_tensor in ((3, w.copies[kernel]), (4, w.packed)):
        x = _bf16(rows, 64, seed=rows)
        got = linear(x, w)
        assert used[-1:] == ([want_tensor] if want_tensor.is_mkldnn else [])
        torch.testing.assert_close(got.float(), F.linear(x, matrix).float(), rtol=1e-2, atol=1e-2)


@needs_packing
def test_the_one_row_packing_gives_f_linears_products_at_every_row_count():
    matrix, bias = _bf16(192, 96, seed=15), _bf16(192, seed=16)
    w = packed_linear.weight(matrix)
    w.copy_for(PACKED_ONE_ROW)
    for rows in (1, 16, 100, 1024):
        x = _bf16(rows, 96, seed=rows)
        got = linear(x, w.copies[PACKED_ONE_ROW], bias)
        want = F.linear(x, matrix, bias)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(
    pack_support(BF16) is not None and pack_support(F32) is not None,
    reason="no packed weights of either dtype here",
)
def test_support_checks_both_packings(monkeypatch):
    """A build whose one-row packing fails is reported unsupported, not found mid-serve."""
    real = packed_linear._reorder

    def reorder(weight, rows_hint=packed_linear.ROWS_HINT):
        if rows_hint == 1:
            raise RuntimeError("no such layout (test)")
        return real(weight, rows_hint)

    for dtype in (BF16, F32):
        if pack_support(dtype) is None:
            monkeypatch.setattr(packed_linear, "_reorder", reorder)
            assert "no such layout" in packed_linear.pack_support.__wrapped__(dtype)
            monkeypatch.setattr(packed_linear, "_reorder", real)


def _weight_with_copies(seed: int = 10) -> packed_linear.Weight:
    """A Weight holding a plain and a 'one-row' copy (plain tensors: the clock is fake)."""
    copies = {PLAIN: _bf16(32, 16, seed=seed), PACKED_ONE_ROW: _bf16(32, 16, seed=seed)}
    return packed_linear.Weight(_bf16(32, 16, seed=seed), copies)


def _fake_clock(w, shares: dict[str, dict[int, float]]):
    """A timer for `fastest_kernel`: packed calls take 1 s, another kernel's at `rows` rows
    shares[kernel][rows] s (1 s where not given)."""

    def seconds_of(call) -> float:
        rows = call.args[0].shape[0]
        if call.func is packed_linear.halves:
            kernel = "halves"
        else:
            kernel = next((k for k, t in w.copies.items() if call.args[1] is t), "packed")
        return shares.get(kernel, {}).get(rows, 1.0)

    return seconds_of


def test_another_kernel_wins_only_by_the_margin():
    w = _weight_with_copies()
    plain = {16: 1.2, 48: 0.5, 64: 0.9, 256: 0.8, 512: 0.7}  # slower; clearly faster; near-ties
    one_row = {48: 0.6, 512: 0.4}  # slower than plain at 48; the fastest at 512
    halves = {256: 0.6}  # under the margin, and faster than plain there
    clock = _fake_clock(w, {PLAIN: plain, PACKED_ONE_ROW: one_row, "halves": halves})
    kernels = {rows: packed_linear.fastest_kernel(w, rows, seconds_of=clock) for rows in plain}
    assert kernels == {16: "packed", 48: "plain", 64: "packed", 256: "halves", 512: PACKED_ONE_ROW}
    w.choose(kernels)
    assert w.plain is not None and w.rows_of("plain") == {48} and w.rows_of("halves") == {256}
    assert w.rows_of(PACKED_ONE_ROW) == {512}
    w.choose({256: "halves"})  # no row count needs the copies: their memory goes
    assert w.copies == {} and w.rows_of("plain") == frozenset() and w.rows_of("halves") == {256}


def test_a_near_tie_of_the_two_copies_goes_to_the_one_row_packing():
    """Plain faster by under COPY_TIE keeps the one-row packing (one copy a kind, not two);
    plain clearly faster, or the one-row packing not under the margin, keeps plain."""
    w = _weight_with_copies()
    plain = {48: 0.50, 64: 0.50, 80: 0.80}
    one_row = {48: 0.54, 64: 0.60, 80: 0.86}  # near tie; plain clearly faster; over margin
    clock = _fake_clock(w, {PLAIN: plain, PACKED_ONE_ROW: one_row})
    kernels = {rows: packed_linear.fastest_kernel(w, rows, seconds_of=clock) for rows in plain}
    assert kernels == {48: PACKED_ONE_ROW, 64: PLAIN, 80: PLAIN}


def test_halves_are_not_timed_under_the_split_minimum():
    w = _weight_with_copies()
    timed = []
    clock = _fake_clock(w, {PLAIN: {64: 0.5, 128: 0.5}})
    for rows in (64, 128):
        packed_linear.fastest_kernel(w, rows, seconds_of=lambda c: timed.append(c) or clock(c))
    kinds = {(c.args[0].shape[0], c.func.__name__) for c in timed}
    assert (64, "halves") not in kinds and (128, "halves") in kinds


@needs_packing
def test_a_product_in_halves_is_its_two_halves_by_their_own_choices(monkeypatch):
    """`linear` at a split row count makes two calls, the first of half the rows rounded up to
    16, each by its own count's kernel (plain at 64 here, packed at 48); the rows come back
    in order, the products F.linear's."""
    matrix = _bf16(96, 64, seed=13)
    w = packed_linear.weight(matrix)
    w.choose({112: "halves", 64: "plain"})
    seen = []
    real_packed, real_plain = packed_linear._packed_linear, packed_linear.F.linear
    monkeypatch.setattr(
        packed_linear,
        "_packed_linear",
        lambda x, *a: seen.append(("packed", x.shape[0])) or real_packed(x, *a),
    )
    monkeypatch.setattr(
        packed_linear.F,
        "linear",
        lambda x, *a: seen.append(("plain", x.shape[0])) or real_plain(x, *a),
    )
    x = _bf16(112, 64, seed=14)
    got = linear(x, w)
    assert seen == [("plain", 64), ("packed", 48)]
    assert w.plain is not None  # the first half: the plain product in the weight's dtype
    assert torch.equal(got[:64], real_plain(x[:64].to(w.plain.dtype), w.plain).to(x.dtype))
    torch.testing.assert_close(got.float(), real_plain(x, matrix).float(), rtol=1e-2, atol=1e-2)
    assert packed_linear.half_rows(112) == 64 and packed_linear.half_rows(1024) == 512


def test_build_runs_every_kernels_product_at_every_row_count(monkeypatch):
    w = _weight_with_copies(seed=12)
    names = {id(w.packed): "packed", **{id(t): k for k, t in w.copies.items()}}
    seen = []
    monkeypatch.setattr(
        packed_linear, "linear", lambda x, t, b=None: seen.append((names[id(t)], len(x)))
    )
    packed_linear.build(w, [1, 48])
    kernels = ["packed", PLAIN, PACKED_ONE_ROW]
    assert seen == [(k, 1) for k in kernels] + [(k, 48) for k in kernels]


def test_without_a_plain_copy_nothing_is_timed():
    """Where packing is unsupported the weight is plain already: nothing to choose."""
    w = packed_linear.Weight(_bf16(32, 16, seed=11))
    timed = []
    kernel = packed_linear.fastest_kernel(w, 16, seconds_of=lambda c: timed.append(c) or 0.0)
    assert kernel == "packed" and timed == []


def _tiled_weight(monkeypatch, seed: int = 13) -> packed_linear.Weight:
    """A Weight TILES can multiply (the kernel faked present: the clock is fake too)."""
    monkeypatch.setattr(packed_linear.tile_gemm, "load", lambda: object())
    return packed_linear.Weight(_bf16(64, 32, seed=seed), tile_block=32)


def test_tiles_win_by_their_own_margin_and_only_at_their_row_counts(monkeypatch):
    """TILES hold no copy: under TILES_MARGIN of packed's time is enough; above MAX_ROWS
    they are not timed."""
    w = _tiled_weight(monkeypatch)
    timed = []

    def clock(call) -> float:
        timed.append((call.func.__name__, call.args[0].shape[0]))
        return {4: 0.90, 8: 0.97}[call.args[0].shape[0]] if call.func.__name__ == "tiles" else 1.0

    assert packed_linear.TILES_MARGIN > packed_linear.RIVAL_MARGIN
    assert packed_linear.fastest_kernel(w, 4, seconds_of=clock) == packed_linear.TILES
    assert packed_linear.fastest_kernel(w, 8, seconds_of=clock) == packed_linear.PACKED
    rows = packed_linear.tile_gemm.MAX_ROWS + 1
    assert packed_linear.fastest_kernel(w, rows, seconds_of=lambda c: 1.0) == "packed"
    assert ("tiles", rows) not in timed and ("tiles", 4) in timed


def test_a_streamed_timing_runs_every_layers_matrix_and_no_copy(monkeypatch):
    layers = [_tiled_weight(monkeypatch, seed=s) for s in (14, 15, 16)]
    layers[0].copies[PLAIN] = _bf16(64, 32, seed=14)
    calls = packed_linear._calls(layers[0], 8, None, split=True, stream=layers)
    assert set(calls) == {packed_linear.PACKED, packed_linear.TILES}
    assert calls[packed_linear.PACKED].args[2] == [w.packed for w in layers]
    assert calls[packed_linear.TILES].args[2] == layers
    layers[2].tile_block = None  # one layer TILES cannot read: not offered
    assert set(packed_linear._calls(layers[0], 8, None, stream=layers)) == {"packed"}


def test_a_weight_multiplies_its_tiles_row_counts_on_the_tile_kernel(monkeypatch):
    w = _tiled_weight(monkeypatch)
    seen = []
    monkeypatch.setattr(
        packed_linear.tile_gemm,
        "product",
        lambda kernel, x, packed, block: seen.append((len(x), block)) or F.linear(x, packed),
    )
    w.choose({4: packed_linear.TILES})
    x4, x5 = _bf16(4, 32, seed=17), _bf16(5, 32, seed=18)
    torch.testing.assert_close(linear(x4, w), F.linear(x4, w.packed))
    linear(x5, w)  # packed: its count has no choice
    bias = _bf16(64, seed=19)
    torch.testing.assert_close(linear(x4, w, bias), F.linear(x4, w.packed, bias))  # no bias
    assert seen == [(4, 32)]


def test_gemm_dtype_is_the_measured_faster_one(monkeypatch):
    """The wide passes' GEMM dtype is whichever product measured faster, both timings in its
    status: bf16 where the float32 product is made slow, float32 where the bf16 one is."""
    from ultrafast.executors.packed_linear import gemm_dtype

    real = packed_linear.linear

    def slowed(dtype):
        def linear_(x, w, bias=None):
            if w.dtype == dtype:
                time.sleep(0.02)
            return real(x, w, bias)

        return linear_

    try:
        for slow, want in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
            gemm_dtype.cache_clear()
            monkeypatch.setattr(packed_linear, "linear", slowed(slow))
            dtype, status = gemm_dtype()
            assert dtype == want
            assert status.startswith({torch.bfloat16: "bf16", torch.float32: "f32"}[want])
            assert "bf16" in status and "f32" in status and " ms" in status
    finally:
        gemm_dtype.cache_clear()  # the tests after this one measure for real


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_weights_multiply_bf16_rows_in_float32(with_bias, packed):
    """A float32 weight (float32 GEMMs), plain or packed, takes bf16 rows (the fused ops'):
    the float32 product, rounded once to bf16 as the bf16 product's output is."""
    if packed:
        _skip_unless_packable(F32)
    plain = _bf16(40, 24, seed=9).float()
    weight = pack(plain) if packed else plain
    x = _bf16(5, 24, seed=10)
    bias = _bf16(40, seed=11) if with_bias else None
    got = linear(x, weight, bias)
    want = F.linear(x.float(), plain, None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16
    if packed:  # oneDNN's own summation order: within one bf16 rounding of the plain product
        torch.testing.assert_close(got.float(), want.to(BF16).float(), rtol=8e-3, atol=1e-3)
    else:
        assert torch.equal(got, want.to(BF16))
