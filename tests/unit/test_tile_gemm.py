"""The few-row AMX product over oneDNN's packed weights (executors/tile_gemm.py): it reads
the layout oneDNN wrote (checked, element by element), and its products are oneDNN's."""

import shutil

import pytest
import torch

from ultrafast.executors import packed_linear, tile_gemm
from ultrafast.executors.packed_linear import pack_support

KERNEL = tile_gemm.load()
needs_tiles = pytest.mark.skipif(
    isinstance(KERNEL, str) or pack_support() is not None,
    reason=f"no AMX tile kernel or no packed weights here: {KERNEL}, {pack_support()}",
)


def _bf16(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 0.1).to(torch.bfloat16)


@needs_tiles
@pytest.mark.parametrize("rows_hint", [16, 1])
@pytest.mark.parametrize("shape", [(192, 96), (576, 1536)])
def test_the_packed_layout_is_read_back_and_a_plain_or_other_matrix_is_not_taken(rows_hint, shape):
    matrix = _bf16(*shape, seed=1)
    packed = packed_linear._reorder(matrix, rows_hint)
    block = tile_gemm.layout_of(packed, matrix)
    assert block in (32, 64)
    assert tile_gemm.layout_of(packed, _bf16(*shape, seed=2)) is None  # not this matrix
    assert tile_gemm.layout_of(matrix, matrix) is None  # a plain tensor


@needs_tiles
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("rows_hint", [16, 1])
def test_products_are_onednns(rows, rows_hint):
    matrix, x = _bf16(3072, 576, seed=3), _bf16(rows, 576, seed=4)
    packed = packed_linear._reorder(matrix, rows_hint)
    block = tile_gemm.layout_of(packed, matrix)
    got = tile_gemm.product(KERNEL, x, packed, block)
    want = packed_linear._packed_linear(x, packed, None)
    assert got.shape == want.shape == (rows, 3072)
    # float32 sums of the same products in the same block order, then rounded to bf16
    torch.testing.assert_close(got.float(), want.float(), rtol=1 / 128, atol=1e-3)
    assert (got == want).float().mean() > 0.99


@needs_tiles
def test_strided_and_batched_inputs_and_the_shapes_it_refuses():
    matrix = _bf16(192, 96, seed=5)
    packed = packed_linear._reorder(matrix)
    block = tile_gemm.layout_of(packed, matrix)
    wide = _bf16(4, 200, seed=6)
    x = wide[:, 10:106]  # rows 200 apart
    want = packed_linear._packed_linear(x.contiguous(), packed, None)
    torch.testing.assert_close(tile_gemm.product(KERNEL, x, packed, block), want)
    batched = tile_gemm.product(KERNEL, x.contiguous().view(2, 2, 96), packed, block)
    assert batched.shape == (2, 2, 192)
    with pytest.raises(ValueError, match="17 rows"):
        tile_gemm.product(KERNEL, _bf16(17, 96), packed, block)
    with pytest.raises(ValueError, match="blocks of 48"):
        tile_gemm.product(KERNEL, _bf16(2, 96), packed, 48)


def test_a_build_without_amx_has_no_kernel_and_says_so():
    """The same file compiled for CPUs without tiles (AVX-512 EPYC, AVX2-only)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH: the kernels are not built here")
    for flags in (("-mno-amx-tile", "-mno-amx-bf16"), ("-mno-avx512f", "-mno-amx-tile")):
        assert tile_gemm.build(flags) == "this CPU's build has no AMX tiles", flags


def test_without_the_kernel_a_weight_offers_no_tiles(monkeypatch):
    monkeypatch.setattr(tile_gemm, "load", lambda: "this CPU's build has no AMX tiles")
    w = packed_linear.weight(_bf16(64, 32, seed=7))
    assert w.tile_block is None and not w.tiles
    w.choose({4: packed_linear.TILES})
    assert w.kernel_at(4) == packed_linear.PACKED  # a choice it cannot run is dropped


@needs_tiles
def test_a_torch_without_the_mkldnn_ops_keeps_onednn(monkeypatch):
    matrix = _bf16(192, 96, seed=8)
    packed = packed_linear._reorder(matrix)

    def missing(*args):
        raise RuntimeError("No such operator mkldnn::_nbytes")

    monkeypatch.setattr(torch.ops.mkldnn, "_nbytes", missing, raising=False)
    assert tile_gemm.layout_of(packed, matrix) is None


@needs_tiles
def test_onednns_products_are_unchanged_after_the_kernel_ran():
    """Both configure the threads' tiles: oneDNN's products at every width, and ours, are the
    same before and after the other ran on those threads."""
    matrix = _bf16(576, 1536, seed=9)
    packed = packed_linear._reorder(matrix)
    block = tile_gemm.layout_of(packed, matrix)
    inputs = {rows: _bf16(rows, 1536, seed=rows) for rows in (1, 16, 64, 300, 1024)}

    def onednn():
        return {rows: packed_linear._packed_linear(x, packed, None) for rows, x in inputs.items()}

    before = onednn()
    ours = tile_gemm.product(KERNEL, inputs[16], packed, block)
    after = onednn()
    assert all(torch.equal(before[rows], after[rows]) for rows in inputs)
    assert torch.equal(tile_gemm.product(KERNEL, inputs[16], packed, block), ours)
