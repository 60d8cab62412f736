"""Packed oneDNN weights (executors/packed_linear.py): same products as F.linear, any row count,
with and without bias; plain weights where packing is not supported."""

import pytest
import torch
import torch.nn.functional as F

from ultrafast.executors import packed_linear
from ultrafast.executors.packed_linear import linear, pack, pack_support

needs_packing = pytest.mark.skipif(
    pack_support() is not None, reason=f"packed weights unavailable here: {pack_support()}"
)


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 16, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_products_equal_f_linear(rows, with_bias):
    weight, x = _bf16(192, 96, seed=1), _bf16(rows, 96, seed=2)
    bias = _bf16(192, seed=3) if with_bias else None
    packed = pack(weight)
    assert packed.is_mkldnn  # really packed, not the plain fallback
    got, want = linear(x, packed, bias), F.linear(x, weight, bias)
    assert got.shape == want.shape == (rows, 192)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@needs_packing
def test_packed_accepts_strided_and_batched_inputs():
    weight = _bf16(64, 48, seed=4)
    packed = pack(weight)
    strided = _bf16(48, 5, seed=5).t()  # not contiguous
    torch.testing.assert_close(linear(strided, packed).float(), F.linear(strided, weight).float())
    batched = _bf16(2, 3, 48, seed=6)
    torch.testing.assert_close(linear(batched, packed).float(), F.linear(batched, weight).float())


def test_non_bf16_weights_stay_plain():
    weight = torch.randn(8, 4)
    assert pack(weight) is weight
    x = torch.randn(3, 4)
    torch.testing.assert_close(linear(x, weight), F.linear(x, weight))


def test_unsupported_packing_keeps_plain_weights(monkeypatch):
    monkeypatch.setattr(packed_linear, "pack_support", lambda: "no bf16 kernels (test)")
    weight = _bf16(16, 8, seed=7)
    assert pack(weight) is weight
    x = _bf16(4, 8, seed=8)
    assert torch.equal(linear(x, pack(weight)), F.linear(x, weight))


@needs_packing
def test_a_weight_multiplies_its_plain_row_counts_on_the_plain_tensor(monkeypatch):
    """`linear` on a `Weight` takes the plain tensor at the row counts measured faster there
    and the packed one at every other; both give F.linear's products."""
    matrix = _bf16(96, 64, seed=9)
    w = packed_linear.weight(matrix)
    assert w.packed.is_mkldnn and w.plain is None  # no second copy at load
    w.keep_plain_for(frozenset({3}))
    assert w.plain is not None and torch.equal(w.plain, matrix)  # unpacked: the same numbers
    packed_calls = []
    real = packed_linear._packed_linear
    monkeypatch.setattr(
        packed_linear, "_packed_linear", lambda *a: packed_calls.append(1) or real(*a)
    )
    for rows, on_packed in ((3, 0), (4, 1)):
        x = _bf16(rows, 64, seed=rows)
        got = linear(x, w)
        assert len(packed_calls) == on_packed
        torch.testing.assert_close(got.float(), F.linear(x, matrix).float(), rtol=1e-2, atol=1e-2)


def _fake_clock(plain_share: dict[int, float]):
    """A timer for `plain_is_faster`: packed calls take 1 s, plain ones plain_share[rows] s."""

    def seconds_of(call) -> float:
        rows = call.args[0].shape[0]
        return plain_share[rows] if call.func is F.linear else 1.0

    return seconds_of


def test_the_plain_tensor_is_kept_only_where_it_wins_by_the_margin():
    w = packed_linear.Weight(_bf16(32, 16, seed=10), _bf16(32, 16, seed=10))
    shares = {16: 1.2, 48: 0.5, 64: 0.9}  # slower; clearly faster; a near-tie
    clock = _fake_clock(shares)
    faster = {rows for rows in shares if packed_linear.plain_is_faster(w, rows, seconds_of=clock)}
    assert faster == {48}
    w.keep_plain_for(frozenset(faster))
    assert w.plain is not None and w.plain_rows == {48}
    w.keep_plain_for(frozenset())  # no row count needs it: its memory goes
    assert w.plain is None and w.plain_rows == frozenset()


def test_build_runs_both_products_at_every_row_count(monkeypatch):
    w = packed_linear.Weight(_bf16(32, 16, seed=12), _bf16(32, 16, seed=12))
    seen = []
    monkeypatch.setattr(packed_linear, "linear", lambda x, *a: seen.append(("packed", len(x))))
    monkeypatch.setattr(packed_linear.F, "linear", lambda x, *a: seen.append(("plain", len(x))))
    packed_linear.build(w, [1, 48])
    assert seen == [("packed", 1), ("plain", 1), ("packed", 48), ("plain", 48)]


def test_without_a_plain_copy_nothing_is_timed():
    """Where packing is unsupported the weight is plain already: nothing to choose."""
    w = packed_linear.Weight(_bf16(32, 16, seed=11))
    timed = []
    assert not packed_linear.plain_is_faster(w, 16, seconds_of=lambda c: timed.append(c) or 0.0)
    assert timed == []
