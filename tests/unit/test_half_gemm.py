"""The few-row product over an exact float16 copy of a weight (executors/half_gemm.py): only
exact copies are made, its products are float32 sums of the same products, and packed_linear
offers it (HALF) as a timed per-row-count choice that keeps its copy only where chosen."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from ultrafast.executors import half_gemm, packed_linear
from ultrafast.executors.packed_linear import HALF, HALF_ROWS, PACKED, linear, pack_support

KERNEL = half_gemm.load()
needs_kernel = pytest.mark.skipif(
    isinstance(KERNEL, str), reason=f"no float16 product kernel here: {KERNEL}"
)
needs_packing = pytest.mark.skipif(
    pack_support(torch.float32) is not None,
    reason=f"packed float32 weights unavailable here: {pack_support(torch.float32)}",
)


def _halfable(*shape, seed=0) -> torch.Tensor:
    """float32 values a float16 holds exactly (as a bf16 GGUF's weights)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 0.1).to(torch.float16).float()


def test_only_exact_copies_are_made():
    matrix = _halfable(32, 24, seed=1)
    packed = half_gemm.pack(matrix)
    assert packed is not None and packed.shape == (2, 24, 16) and packed.dtype == torch.float16
    # block b, input column i, output o of the block: matrix[16 b + o, i]
    assert torch.equal(packed[1, 5, 3].float(), matrix[19, 5])
    assert torch.equal(packed.transpose(1, 2).reshape(32, 24).float(), matrix)
    tiny, huge = matrix.clone(), matrix.clone()
    tiny[3, 4] = 1e-7  # below float16's subnormals' precision: rounds
    huge[0, 0] = 70000.0  # past float16's largest value
    assert half_gemm.pack(tiny) is None and half_gemm.pack(huge) is None
    assert half_gemm.pack(_halfable(40, 24)) is None  # 40 outputs: not whole blocks
    bf16 = _halfable(32, 24).to(torch.bfloat16)  # a bf16 matrix round-trips as bf16
    assert half_gemm.pack(bf16) is not None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_are_float32_sums_of_the_same_products(rows, with_bias):
    """Every row remainder of the kernel's 6-row blocks, with and without bias."""
    matrix, x = _halfable(96, 200, seed=2), torch.randn(rows, 200)
    bias = torch.randn(96) if with_bias else None
    got = half_gemm.product(KERNEL, x, half_gemm.pack(matrix), bias)
    want = F.linear(x.double(), matrix.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_strided_batched_and_bf16_inputs():
    matrix = _halfable(48, 64, seed=3)
    packed = half_gemm.pack(matrix)
    wide = torch.randn(4, 100)
    x = wide[:, 10:74]  # rows 100 apart
    torch.testing.assert_close(half_gemm.product(KERNEL, x, packed), F.linear(x, matrix))
    batched = half_gemm.product(KERNEL, x.contiguous().view(2, 2, 64), packed)
    assert batched.shape == (2, 2, 48)
    rows = torch.randn(3, 64).to(torch.bfloat16)  # widened to float32 first
    got = packed_linear.half(rows, packed)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, F.linear(rows.float(), matrix).to(torch.bfloat16))
    assert half_gemm.product(KERNEL, torch.empty(0, 64), packed).shape == (0, 48)


def test_a_build_without_f16c_has_no_kernel_and_says_so():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH: the kernels are not built here")
    assert half_gemm.build(("-mno-f16c",)) == half_gemm.REASONS[-1]


@needs_kernel
@needs_packing
def test_a_weight_multiplies_the_chosen_row_counts_on_its_float16_copy(monkeypatch):
    w = packed_linear.Weight(packed_linear.pack(_halfable(64, 32, seed=4)))
    seen = []
    real = half_gemm.product
    monkeypatch.setattr(
        half_gemm, "product", lambda *a, **k: seen.append(len(a[1])) or real(*a, **k)
    )
    w.choose({4: HALF})
    assert HALF in w.copies
    x4, x5 = torch.randn(4, 32), torch.randn(5, 32)
    bias = torch.randn(64)
    torch.testing.assert_close(linear(x4, w, bias), F.linear(x4, w.packed.to_dense(), bias))
    linear(x5, w)  # packed: its count has no choice
    assert seen == [4]
    w.choose({})
    assert HALF not in w.copies  # no count needs it: freed


@needs_kernel
@needs_packing
def test_an_inexact_weight_offers_no_float16_copy():
    matrix = _halfable(64, 32, seed=5)
    matrix[0, 0] = 1e-7
    w = packed_linear.Weight(packed_linear.pack(matrix))
    w.unpack()
    assert HALF not in w.copies
    w.choose({4: HALF})
    assert w.kernel_at(4) == PACKED  # a choice it cannot run is dropped


@needs_kernel
@needs_packing
def test_half_is_timed_over_every_layer_up_to_its_row_limit():
    layers = [packed_linear.Weight(packed_linear.pack(_halfable(64, 32, seed=s))) for s in (6, 7)]
    for w in layers:
        w.copy_for(HALF)
    calls = packed_linear._calls(layers[0], 8, None, stream=layers)
    assert set(calls) == {PACKED, HALF}
    assert calls[HALF].args[2] == [w.copies[HALF] for w in layers]

    def clock(call) -> float:
        return 0.5 if call.func.__name__ == "_each" and call.args[0] is packed_linear.half else 1.0

    assert packed_linear.fastest_kernel(layers[0], 8, seconds_of=clock, stream=layers) == HALF
    assert set(packed_linear._calls(layers[0], HALF_ROWS + 1, None, stream=layers)) == {PACKED}
    assert HALF not in packed_linear._calls(layers[0], 8, None)  # never on one layer alone
    del layers[1].copies[HALF]  # one layer without a copy: not offered
    assert set(packed_linear._calls(layers[0], 8, None, stream=layers)) == {PACKED}
