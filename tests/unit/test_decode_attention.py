"""The wide decode step's C attention kernel (executors/decode_attention.py): its float
builds (AVX-512, portable) exact to float rounding against a float32 reference, its bf16
build (AVX512-BF16) exact to the rounding of its bf16 probabilities against the same reference
over queries rounded as it rounds them, for the head sizes and groups it serves; wrong calls
refused before they reach C; without a compiler the step keeps torch's SDPA and says why."""

from __future__ import annotations

import pytest
import torch

from ultrafast.cpu_info import matrix_features
from ultrafast.executors import decode_attention as da


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRAFAST_CACHE_DIR", str(tmp_path))


def kernel_or_skip(extra_flags=()) -> da.Kernel:
    kernel = da.build(tuple(extra_flags))
    if isinstance(kernel, str):
        pytest.skip(f"no decode attention kernel here: {kernel}")
    return kernel


def problem(heads: int, kv_heads: int, dim: int, lens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    capacity, n_rows = max(lens) + 7, len(lens) + 3
    keys = torch.randn(n_rows, kv_heads, capacity, dim, generator=gen).to(torch.bfloat16)
    values = torch.randn(n_rows, kv_heads, capacity, dim, generator=gen).to(torch.bfloat16)
    wide = torch.randn(len(lens), heads + kv_heads, dim, generator=gen) * 3  # a q|k row
    rows = torch.randperm(n_rows, generator=gen)[: len(lens)].tolist()  # scattered, any order
    return wide[:, :heads], keys, values, da.rows_of(rows, lens)


def reference(q, keys, values, at: da.Rows) -> torch.Tensor:
    """float32 attention of each row's query heads over its own positions (GQA by groups)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    rows, lens = at.rows, at.lens
    out = []
    for b in range(len(rows)):
        k = keys[rows[b], :, : lens[b]].float().repeat_interleave(heads // kv_heads, 0)
        v = values[rows[b], :, : lens[b]].float().repeat_interleave(heads // kv_heads, 0)
        scores = (q[b][:, None, :] @ k.transpose(-1, -2))[:, 0] * q.shape[-1] ** -0.5
        out.append(scores.softmax(-1)[:, None, :].bmm(v)[:, 0])
    return torch.stack(out)


SHAPES = [(9, 3, 64), (8, 8, 64), (32, 4, 128), (14, 2, 64)]  # SmolLM2, MHA, 8-group, 7-group
LENS = [1, 63, 64, 65, 300, 7]  # around the kernel's 64-row blocks and 16-lane tails


VARIANTS = {  # name -> the build's extra flags, the kind it must report
    "native": ((), None),
    "float-avx512": (("-mno-avx512bf16",), "avx512"),
    "portable": (("-mno-avx512f",), "portable"),
}


def rounded_queries(q: torch.Tensor) -> torch.Tensor:
    """The queries as the bf16 build sees them: scaled to base-2 scores, rounded to bf16."""
    to_base2 = q.shape[-1] ** -0.5 * 1.4426950408889634
    return (q * to_base2).to(torch.bfloat16).float() / to_base2


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float_attention(shape, variant):
    flags, kind = VARIANTS[variant]
    if flags and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("not an x86 CPU: -mno-avx512* are no flags here")
    if kind == "avx512" and not matrix_features()["avx512"]:
        pytest.skip("this CPU has no AVX-512: no float AVX-512 build to test")
    kernel = kernel_or_skip(flags)
    if kind is not None:
        assert kernel.kind == kind
    q, keys, values, rows = problem(*shape, LENS)
    got = da.attend(kernel, q, keys, values, rows)
    if kernel.kind == "avx512-bf16":
        # its probabilities are bf16 (8 significant bits): errors of ~2^-9 of a value,
        # averaging out over the keys; the queries' rounding is the reference's too
        want = reference(rounded_queries(q), keys, values, rows)
        assert (got - want).abs().max() <= 2e-3 * want.abs().max()
        assert (got - want).abs().mean() <= 2e-4 * want.abs().max()
        # and against queries kept whole: the queries' rounding alone (~5e-3 here)
        exact = reference(q, keys, values, rows)
        assert (got - exact).abs().max() <= 2e-2 * exact.abs().max()
    else:
        want = reference(q, keys, values, rows)
        assert (got - want).abs().max() <= 2e-5 * want.abs().max() + 1e-6
    assert got.shape == (len(rows.rows), shape[0], shape[2])


def test_the_native_build_uses_the_widest_instructions_the_cpu_has():
    features = matrix_features()
    if not features["avx512"]:
        pytest.skip("this CPU has no AVX-512: the native build is the portable one")
    want = "avx512-bf16" if features["avx512_bf16"] else "avx512"
    assert kernel_or_skip().kind == want


def test_wrong_calls_are_refused_before_c():
    kernel = kernel_or_skip()
    q, keys, values, rows = problem(9, 3, 64, [5, 9])
    bad = [
        (q.to(torch.bfloat16), keys, values, rows),  # queries not float32
        (q, keys.float(), values, rows),  # keys not bf16
        (q, keys, values[:, :, :4], rows),  # mismatched shapes
        (q, keys, values, da.rows_of([0, keys.shape[0]], [5, 9])),  # a row outside the mirror
        (q, keys, values, da.rows_of([0, -1], [5, 9])),
        (q, keys, values, da.rows_of([0, 1], [5, keys.shape[2] + 1])),  # past the capacity
        (q, keys, values, da.rows_of([0, 1], [0, 9])),  # nothing to attend
        (q, keys, values, da.rows_of([0], [5])),  # a row missing
    ]
    for args in bad:
        with pytest.raises(ValueError):
            da.attend(kernel, *args)
    with pytest.raises(ValueError):
        da.rows_of([0, 1], [5])
    q, keys, values, rows = problem(9, 3, 32, [5, 9])  # head_dim 32: no kernel
    with pytest.raises(ValueError, match="no kernel"):
        da.attend(kernel, q, keys, values, rows)


def test_without_a_compiler_the_step_keeps_sdpa_and_says_why(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    assert da.build() == "no C compiler (cc or gcc) on PATH"
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert da.build().startswith("the kernel did not compile")
    monkeypatch.setattr(da, "load", da.build)
    kernel, status = da.choose(9, 3, 64, lambda *a: 1.0)
    assert kernel is None and status.startswith("decode attention: torch SDPA (the kernel did")


def test_the_choice_is_by_measurement(monkeypatch):
    kernel_or_skip()
    kernel, status = da.choose(9, 3, 64, lambda *a: 1e-9)  # an SDPA faster than anything
    assert kernel is None and "torch SDPA" in status and "kernel" in status
    kernel, status = da.choose(9, 3, 64, lambda *a: 10.0)
    assert kernel is not None and status.startswith(f"decode attention: {kernel.kind} C kernel")
    kernel, status = da.choose(9, 3, 48, lambda *a: 10.0)
    assert kernel is None and "head_dim 48" in status


def test_a_build_is_reused(tmp_path):
    kernel_or_skip()
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    kernel_or_skip()
    assert [p.stat().st_mtime_ns for p in (tmp_path / "kernels").glob("*.so")] == [stamp]
