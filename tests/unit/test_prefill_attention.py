"""The wide prefill's AMX attention kernel (executors/prefill_attention.py): equal to a float64
causal grouped-query reference to bf16 rounding, on the layouts the wide passes hand it
(strided queries, the mirror's keys); wrong calls refused before C; chosen only where it
builds, agrees with SDPA and beats it, else SDPA with the reason in the status clause."""

from __future__ import annotations

import shutil

import pytest
import torch

from ultrafast.executors import prefill_attention as pa

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))
    pa.load.cache_clear()
    pa.choose.cache_clear()
    yield
    pa.load.cache_clear()
    pa.choose.cache_clear()


def kernel_or_skip() -> pa.Kernel:
    kernel = pa.load()
    if isinstance(kernel, str):
        pytest.skip(f"no AMX prefill attention kernel on this machine: {kernel}")
    return kernel


def reference(q, keys, values) -> torch.Tensor:
    """float64 causal attention: query i (position total - t + i) over keys [0, that]."""
    t, heads, dim = q.shape
    kv_heads, total, _ = keys.shape
    group = heads // kv_heads
    k = keys.double().repeat_interleave(group, 0)
    v = values.double().repeat_interleave(group, 0)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * dim**-0.5
    hidden = torch.arange(total)[None, :] > torch.arange(total - t, total)[:, None]
    weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1).reshape(t, -1)


def problem(t, total, heads=9, kv_heads=3, dim=64, seed=0, spread=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, heads, dim, generator=gen) * spread).to(BF16)
    keys = torch.randn(kv_heads, total, dim, generator=gen).to(BF16)
    values = torch.randn(kv_heads, total, dim, generator=gen).to(BF16)
    return q, keys, values


def assert_close(got, want):
    assert got.dtype == BF16 and got.shape == want.shape
    # bf16 output (8 significant bits) and bf16 probabilities in the P.V product
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max() + 1e-3


@pytest.mark.parametrize(
    "t,total",
    [(1, 1), (5, 5), (16, 16), (17, 17), (100, 100), (17, 40), (64, 65), (488, 1000), (33, 2000)],
)
def test_equal_to_a_float64_reference(t, total):
    kernel = kernel_or_skip()
    q, keys, values = problem(t, total)
    assert_close(pa.attend(kernel, q, keys, values), reference(q, keys, values))


def test_a_call_after_a_longer_one_reads_nothing_of_it():
    """The packed K/V buffer is kept per thread between calls (a fresh one per call was paged
    in anew each time): a shorter call after a longer one, and a longer one after it, each
    equal to the reference (no stale keys past a call's own)."""
    kernel = kernel_or_skip()
    for seed, (t, total) in enumerate([(64, 900), (20, 37), (7, 7), (300, 1200), (16, 100)]):
        q, keys, values = problem(t, total, seed=seed)
        assert_close(pa.attend(kernel, q, keys, values), reference(q, keys, values))


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 1)])
def test_other_query_groupings(heads, kv_heads):
    kernel = kernel_or_skip()
    q, keys, values = problem(70, 150, heads, kv_heads, seed=1)
    assert_close(pa.attend(kernel, q, keys, values), reference(q, keys, values))


def test_large_scores_keep_the_softmax_finite():
    kernel = kernel_or_skip()
    q, keys, values = problem(40, 300, spread=30.0, seed=2)  # scores in the hundreds
    got = pa.attend(kernel, q, keys, values)
    assert torch.isfinite(got.float()).all()
    assert_close(got, reference(q, keys, values))


def test_scores_rising_block_by_block_move_the_max_lazily_and_stay_exact():
    """Keys whose scores climb from one 64-key block to the next, by less than the kernel's
    lazy-max step (2^8) in some blocks and by far more in others: the accumulator is
    rescaled only where a row's max moved, and the result is the reference's."""
    kernel = kernel_or_skip()
    gen = torch.Generator().manual_seed(3)
    direction = torch.nn.functional.normalize(torch.randn(64, generator=gen), dim=0)
    t, total = 48, 640
    q = (direction * 4).expand(t, 9, 64).contiguous().to(BF16)
    rises = [0.0, 5.5, 5.5, 17.0, 5.5, 17.0, 2.0, 30.0, 5.5, 0.0]  # a block's score step x 2
    level = torch.tensor(rises).cumsum(0).repeat_interleave(64)
    ramp = level + torch.rand(total, generator=gen) * 4  # and a spread inside each block
    noise = torch.randn(3, total, 64, generator=gen) * 0.1
    keys = (ramp[None, :, None] * direction + noise).to(BF16)
    values = torch.randn(3, total, 64, generator=gen).to(BF16)
    got = pa.attend(kernel, q, keys, values)
    assert torch.isfinite(got.float()).all()
    assert_close(got, reference(q, keys, values))


def test_the_wide_passes_layouts():
    """Queries as a slice of the fused q|k rows, keys and values a view of the mirror's
    [kv_heads, capacity, d] with rows past the sequence holding garbage it must not read."""
    kernel = kernel_or_skip()
    t, total, heads, kv_heads, dim = 50, 130, 9, 3, 64
    gen = torch.Generator().manual_seed(3)
    qk = torch.randn(t, heads + kv_heads, dim, generator=gen).to(BF16)
    mirror = torch.randn(2, kv_heads, 512, dim, generator=gen).to(BF16)
    mirror_v = torch.randn(2, kv_heads, 512, dim, generator=gen).to(BF16)
    mirror[1, :, total:] = float("nan")
    mirror_v[1, :, total:] = float("nan")
    q, keys, values = qk[:, :heads], mirror[1, :, :total], mirror_v[1, :, :total]
    got = pa.attend(kernel, q, keys, values)
    assert_close(got, reference(q.contiguous(), keys.contiguous(), values.contiguous()))
    # and the rows of a transposed new-token view (no earlier KV)
    own_k, own_v = qk[:, heads:].transpose(0, 1), torch.randn(t, kv_heads, dim).to(BF16)
    got = pa.attend(kernel, q, own_k, own_v.transpose(0, 1))
    assert_close(got, reference(q, own_k, own_v.transpose(0, 1)))


def test_written_into_a_passs_rows_and_nowhere_else():
    """With `out` (a row slice of the pass's [T, heads * d] output) the kernel writes those
    rows in place, the same values as a call with no `out`, and leaves the rest alone; an
    output of another shape, dtype or layout is refused."""
    kernel = kernel_or_skip()
    q, keys, values = problem(40, 90, seed=5)
    passed = torch.full((100, 9 * 64), 7.0, dtype=BF16)
    rows = passed[30:70]
    assert pa.attend(kernel, q, keys, values, rows) is rows
    assert torch.equal(rows, pa.attend(kernel, q, keys, values))
    assert (passed[:30] == 7).all() and (passed[70:] == 7).all()
    for wrong in (
        passed[30:69],
        passed[30:70].float(),
        passed[30:70, : 8 * 64],
        passed.t()[:, :40],
    ):
        with pytest.raises(ValueError):
            pa.attend(kernel, q, keys, values, wrong)


def test_the_same_as_sdpa_where_sdpa_is_the_fallback():
    kernel = kernel_or_skip()
    q, keys, values = problem(200, 700, seed=4)
    ours, theirs = pa.attend(kernel, q, keys, values), pa.sdpa(q, keys, values)
    assert (ours.float() - theirs.float()).abs().max() < 3e-2


def test_wrong_calls_are_refused_before_c():
    kernel = kernel_or_skip()
    q, keys, values = problem(8, 20)
    odd = torch.zeros(8 * 9 * 64 + 1, dtype=BF16)[1:].view(8, 9, 64)  # 2 bytes off
    bad = [
        (q.float(), keys, values),  # queries not bf16
        (q, keys.float(), values),  # keys not bf16
        (q, keys, values[:, :10]),  # mismatched shapes
        (q, keys[:, :5], values[:, :5]),  # fewer keys than queries
        (q[:, :8], keys, values),  # 8 query heads over 3 KV heads
        (q.transpose(1, 2), keys, values),  # a row's heads not contiguous
        (odd, keys, values),  # not 4-byte aligned: the kernel reads dim pairs
    ]
    for args in bad:
        with pytest.raises(ValueError):
            pa.attend(kernel, *args)
    q128, k128, v128 = problem(8, 20, dim=128)
    with pytest.raises(ValueError, match="head size"):
        pa.attend(kernel, q128, k128, v128)


def test_a_build_without_amx_has_no_kernel_and_says_so():
    """The same file compiled for CPUs without tiles (AVX-512 EPYC, AVX2-only)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH: the kernels are not built here")
    for flags in (("-mno-amx-tile", "-mno-amx-bf16"), ("-mno-avx512f", "-mno-amx-tile")):
        assert pa.build(flags) == "this CPU's build has no AMX tiles", flags


def test_without_a_compiler_sdpa_stays_and_says_why(monkeypatch):
    monkeypatch.setattr(
        pa, "build_library", lambda name, flags=(): "no C compiler (cc or gcc) on PATH"
    )
    kernel, status = pa.choose(9, 3, 64)
    assert kernel is None
    assert status == "prefill attention: torch SDPA (no C compiler (cc or gcc) on PATH)"


def test_a_head_size_without_tiles_keeps_sdpa():
    kernel_or_skip()
    kernel, status = pa.choose(4, 2, 128)
    assert kernel is None and "64 only" in status


def test_chosen_by_measurement(monkeypatch):
    kernel_or_skip()
    kernel, status = pa.choose(9, 3, 64)
    if kernel is None:  # the measurement said no: the status says so with the figures
        assert status.startswith("prefill attention: torch SDPA (the amx kernel: ")
    else:
        assert status.startswith("prefill attention: amx C kernel (")
    pa.choose.cache_clear()
    real = pa.attend

    def slow(*args):  # the same numbers, later than SDPA on any machine
        out = real(*args)
        pa.sdpa(*args[1:])
        pa.sdpa(*args[1:])
        return out

    monkeypatch.setattr(pa, "attend", slow)
    kernel, status = pa.choose(9, 3, 64)
    assert kernel is None and status.startswith("prefill attention: torch SDPA (the amx kernel: ")


def test_a_disagreeing_kernel_is_refused(monkeypatch):
    kernel_or_skip()
    monkeypatch.setattr(
        pa,
        "attend",
        lambda kernel, q, k, v: torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=BF16),
    )
    kernel, status = pa.choose(9, 3, 64)
    assert kernel is None and status == "prefill attention: torch SDPA (the amx kernel disagrees)"
