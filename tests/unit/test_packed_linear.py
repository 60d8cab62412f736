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
