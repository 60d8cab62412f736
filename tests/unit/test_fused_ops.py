"""The wide passes' fused elementwise ops (executors/fused_ops.py): each agrees with a float64
reference to bf16 rounding (and with torch's ops) on row counts and widths around the
kernel's 16-lane tails and its one-thread / OpenMP split, on strided rows, in the AVX-512 and
portable builds; RoPE stored to bf16 queries and the mirror's K/V rows equals RoPE rounded,
written only where asked; NaN stays NaN; wrong calls are refused before they reach C; without a
compiler, or where torch is faster, the passes keep torch's ops and say why."""

from __future__ import annotations

import pytest
import torch

from ultrafast.executors import fused_ops as fo

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))


@pytest.fixture(params=["native", "portable"])
def ops(request) -> fo.FusedOps:
    flags = () if request.param == "native" else ("-mno-avx512f",)
    if request.param == "portable" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("not an x86 CPU: -mno-avx512f is no flag here")
    built = fo.build(flags)
    if isinstance(built, str):
        pytest.skip(f"no fused ops here: {built}")
    if request.param == "portable":
        assert built.kind == "portable"
    return built


def bf16_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 rounding of the float64 value (2^-8 relative), plus a float epsilon."""
    return bool(((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-6).all())


ROWS = [1, 3, 16, 300]  # 300 x 576 and more: over the grain, the OpenMP split
DIMS = [576, 40, 17]  # 16-lane multiples and tails


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_norm_is_the_rms_norm_rounded_once(ops, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    wide = torch.randn(rows, dim + 5, generator=gen) * 4
    x = wide[:, 2 : 2 + dim]  # strided rows
    weight = torch.rand(dim, generator=gen) + 0.5
    got = fo.norm_bf16(ops, x, weight, 1e-5)
    xd = x.double()
    want = xd * (xd.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt() * weight.double()
    assert got.dtype == BF16 and got.shape == (rows, dim)
    assert bf16_close(got, want)
    assert torch.allclose(got.float(), fo.torch_norm_bf16(x, weight, 1e-5).float(), rtol=1e-2)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", DIMS)
def test_add_norm_adds_in_place_then_norms_the_sum(ops, rows, dim):
    """x += y exactly as torch adds, and the norm of the sum bit-equal to norm_bf16's: the
    fused residual add changes no number of the pass."""
    gen = torch.Generator().manual_seed(rows * dim + 1)
    wide = torch.randn(rows, dim + 5, generator=gen) * 4
    x = wide[:, 1 : 1 + dim]  # strided rows, updated in place
    y = (torch.randn(rows, dim + 3, generator=gen) * 3).to(BF16)[:, :dim]
    weight = torch.rand(dim, generator=gen) + 0.5
    want_x = x + y.float()
    untouched = wide[:, 0].clone(), wide[:, 1 + dim :].clone()
    got = fo.add_norm_bf16(ops, x, y, weight, 1e-5)
    assert torch.equal(x, want_x)
    assert torch.equal(wide[:, 0], untouched[0]) and torch.equal(wide[:, 1 + dim :], untouched[1])
    assert torch.equal(got, fo.norm_bf16(ops, want_x, weight, 1e-5))
    assert got.dtype == BF16 and got.shape == (rows, dim)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [1536, 40, 17])
def test_silu_mul_is_one_rounding_of_the_float_product(ops, rows, n):
    gen = torch.Generator().manual_seed(rows + n)
    wide = (torch.randn(rows, 2 * n + 3, generator=gen) * 6).to(BF16)
    h = wide[:, : 2 * n]
    got = fo.silu_mul(ops, h)
    gate, up = h.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert got.dtype == BF16 and got.shape == (rows, n)
    assert bf16_close(got, want)
    tolerance = fo.torch_silu_mul(h).float().abs() * 2**-7 + 1e-6  # torch rounds twice
    assert ((got.float() - fo.torch_silu_mul(h).float()).abs() <= tolerance).all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,dim", [(12, 64), (5, 128), (3, 40)])
def test_rope_turns_each_head_by_its_rows_angles(ops, rows, heads, dim):
    gen = torch.Generator().manual_seed(rows * heads)
    h = (torch.randn(rows, heads * dim + 64, generator=gen) * 3).to(BF16)  # v columns after
    angles = torch.rand(rows, dim // 2, generator=gen, dtype=torch.float64) * 100
    cos = torch.cat([angles.cos()] * 2, 1)
    sin = torch.cat([angles.sin()] * 2, 1)
    got = fo.rope(ops, h, heads, dim, cos.float(), sin.float())
    x = h[:, : heads * dim].double().view(rows, heads, dim)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    want = x * cos[:, None] + rotated * sin[:, None]
    assert got.dtype == torch.float32 and got.shape == (rows, heads, dim)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    reference = fo.torch_rope(h, heads, dim, cos.float(), sin.float())
    assert torch.allclose(got, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 128), (3, 1, 40)])
def test_rope_store_is_rope_rounded_with_k_and_v_written_in_place(ops, rows, heads, kv_heads, dim):
    """The queries are rope's rounded to bf16; the keys (rope's k heads, rounded) and the
    values (copied) land in the mirror's rows of the chunk, nowhere else."""
    gen = torch.Generator().manual_seed(rows * heads + dim)
    width = (heads + 2 * kv_heads) * dim
    h = (torch.randn(rows, width + 8, generator=gen) * 3).to(BF16)[:, :width]  # strided rows
    angles = torch.rand(rows, dim // 2, generator=gen) * 100
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    keys = torch.full((3, kv_heads, rows + 20, dim), 7.0, dtype=BF16)  # [slots, heads, pos, d]
    values = torch.full_like(keys, 7.0)
    at = slice(5, 5 + rows)  # the chunk's positions in slot 1
    q = fo.rope_store(ops, h, heads, dim, cos, sin, keys[1, :, at], values[1, :, at])
    turned = fo.rope(ops, h, heads + kv_heads, dim, cos, sin).to(BF16)
    assert q.dtype == BF16 and q.shape == (rows, heads, dim)
    assert torch.equal(q, turned[:, :heads])
    assert torch.equal(keys[1, :, at], turned[:, heads:].transpose(0, 1))
    v = h[:, (heads + kv_heads) * dim :].reshape(rows, kv_heads, dim)
    assert torch.equal(values[1, :, at], v.transpose(0, 1))
    for t in (keys, values):  # nothing outside the chunk's rows changed
        untouched = torch.ones_like(t, dtype=torch.bool)
        untouched[1, :, at] = False
        assert (t[untouched] == 7.0).all()


def test_nan_stays_nan_and_rounding_is_to_nearest_even(ops):
    x = torch.ones(2, 32)
    x[1, 3] = float("nan")
    got = fo.norm_bf16(ops, x, torch.ones(32), 0.0)
    assert torch.isnan(got[1]).all() and not torch.isnan(got[0]).any()
    # rows of ones normalize to exactly 1: the weight is the value rounded to bf16
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8] * 8)  # halfway between two bf16 values
    got = fo.norm_bf16(ops, torch.ones(1, 16), ties, 0.0)[0, :2].float()
    assert got.tolist() == [1.0, 1 + 2**-6]  # to the even neighbour, not always up or down


def test_wrong_calls_are_refused_before_c(ops):
    x = torch.randn(4, 32)
    with pytest.raises(ValueError):
        fo.norm_bf16(ops, x.to(BF16), torch.ones(32), 1e-5)  # bf16 rows
    with pytest.raises(ValueError):
        fo.norm_bf16(ops, x, torch.ones(31), 1e-5)  # a weight of another width
    with pytest.raises(ValueError):
        fo.norm_bf16(ops, x.t(), torch.ones(4), 1e-5)  # columns, not rows
    y = torch.randn(4, 32).to(BF16)
    with pytest.raises(ValueError):
        fo.add_norm_bf16(ops, x, y.float(), torch.ones(32), 1e-5)  # a float branch
    with pytest.raises(ValueError):
        fo.add_norm_bf16(ops, x, y[:3], torch.ones(32), 1e-5)  # a branch a row short
    with pytest.raises(ValueError):
        fo.add_norm_bf16(ops, x, y, torch.ones(32, dtype=torch.float64), 1e-5)  # the weight
    with pytest.raises(ValueError):
        fo.silu_mul(ops, torch.randn(4, 33).to(BF16))  # odd: no gate | up split
    h = torch.randn(4, 128).to(BF16)
    cos = sin = torch.ones(4, 64)
    with pytest.raises(ValueError):
        fo.rope(ops, h, 3, 64, cos, sin)  # 3 heads of 64 > 128 columns
    with pytest.raises(ValueError):
        fo.rope(ops, h, 2, 64, torch.ones(3, 64), sin)  # a cos row short
    with pytest.raises(ValueError):
        fo.rope(ops, h, 2, 64, torch.ones(64, 4).t(), sin)  # not contiguous
    qkv = torch.randn(4, 192).to(BF16)  # one q, one k and one v head of 64
    mirror = torch.zeros(2, 1, 8, 64, dtype=BF16)  # [slots, kv heads, positions, d]
    keys, values = mirror[0, :, :4], mirror[1, :, :4]
    fo.rope_store(ops, qkv, 1, 64, cos, sin, keys, values)  # the call the refusals vary
    with pytest.raises(ValueError):
        fo.rope_store(ops, qkv, 1, 64, cos, sin, keys, values[:, :3])  # a destination short
    with pytest.raises(ValueError):
        fo.rope_store(ops, qkv, 1, 64, cos, sin, keys, values.float())  # float destinations
    columns = torch.zeros(1, 64, 4, dtype=BF16).transpose(1, 2)  # [1, 4, 64], dims strided
    with pytest.raises(ValueError):
        fo.rope_store(ops, qkv, 1, 64, cos, sin, keys, columns)  # rows not contiguous
    apart = torch.zeros(1, 4, 64, dtype=BF16)  # right shape, another head stride than keys
    with pytest.raises(ValueError):
        fo.rope_store(ops, qkv, 1, 64, cos, sin, keys, apart)
    with pytest.raises(ValueError):
        fo.rope_store(ops, qkv, 2, 64, cos, sin, keys, values)  # 2 + 1 + 1 heads of 64 > 192


def test_without_a_compiler_the_passes_keep_torch_and_say_why(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    ops, status = fo.choice.__wrapped__(64, 128, 6, 32)
    assert ops is None and status == "elementwise: torch (no C compiler (cc or gcc) on PATH)"


def test_the_choice_is_by_measurement(monkeypatch):
    if isinstance(fo.build(), str):
        pytest.skip("no fused ops here")
    monkeypatch.setattr(fo, "_time_both", lambda pairs: (2.0, 1.0))  # torch faster
    ops, status = fo.choice.__wrapped__(64, 128, 6, 32)
    assert ops is None and status.startswith("elementwise: torch (the ")
    monkeypatch.setattr(fo, "_time_both", lambda pairs: (1.0, 2.0))
    ops, status = fo.choice.__wrapped__(64, 128, 6, 32)
    assert ops is not None and status.startswith(f"elementwise: {ops.kind} fused C ops")


def test_a_disagreeing_op_is_not_used(monkeypatch):
    if isinstance(fo.build(), str):
        pytest.skip("no fused ops here")
    monkeypatch.setattr(fo, "torch_silu_mul", lambda h: fo.F.silu(h.chunk(2, -1)[1]))
    ops, status = fo.choice.__wrapped__(64, 128, 6, 32)
    assert ops is None and "fused silu_mul disagrees" in status


def test_a_shape_the_ops_refuse_keeps_torch():
    if isinstance(fo.build(), str):
        pytest.skip("no fused ops here")
    ops, status = fo.choice.__wrapped__(64, 128, 6, 33)  # an odd head size: no RoPE halves
    assert ops is None and status.startswith("elementwise: torch (the fused rope: ")
