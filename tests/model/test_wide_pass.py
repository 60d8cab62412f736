"""The wide pass (executors/wide_exec.py): prefill chunks' KV from a bf16 PyTorch forward,
imported into llama.cpp's slots, must give what llama.cpp's own prefill gives.

- the KV chunk layout round-trips byte for byte (flash attention on and off: V plain/transposed);
- the wide KV is close to llama.cpp's, layer by layer;
- greedy tokens: 10 prompts x 32 tokens equal the llama.cpp path's, or diverge only at a
  near-tie (the margin at the divergence is printed), on the demo model, SmolLM2's bf16 GGUF
  (scripts/smollm2_formats.py) and its shipped Q4_1; prompts in one step, and in two chunks
  (the second over KV read back from llama.cpp);
- perplexity of text scored by llama.cpp over wide-computed context within 0.5%.
Where oneDNN's bf16 path is not available on this CPU the tests skip saying why.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from ultrafast.config import DEMO_MODEL_DIR, REPO_ROOT
from ultrafast.core.types import ScheduledSeq, StepPlan
from ultrafast.executors import ggml_kv_rows
from ultrafast.executors.ggml_exec import GgmlExecutor
from ultrafast.request import SamplingParams

DEMO_GGUF = DEMO_MODEL_DIR / "demo-code-f16.gguf"
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
NEAR_TIE = 0.5  # logit margin under which bf16 rounding may flip the greedy choice
NUM_PROMPTS, NEW_TOKENS = 10, 32


def _wide_unavailable() -> str | None:
    import torch

    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    return None  # without oneDNN bf16 kernels the passes multiply in float32 (gemm_dtype)


def wide(gguf, **kwargs):
    why = _wide_unavailable()
    if why:
        pytest.skip(f"wide pass not available: {why}")
    from ultrafast.executors.wide_exec import WideGgmlExecutor

    ex = WideGgmlExecutor(gguf, wide_pass="on", **kwargs)
    ex.wide_min_tokens = 2  # every chunk of 2+ tokens takes the wide path
    return ex


def plain(gguf, **kwargs):
    return GgmlExecutor(gguf, **kwargs)


def smollm2_bf16():
    env = os.environ.get("ULTRAFAST_SMOLLM2_BF16_GGUF")
    path = (
        REPO_ROOT / "runs" / "models" / "smollm2" / "SmolLM2-135M-Instruct.bf16.gguf"
        if not env
        else __import__("pathlib").Path(env)
    )
    if not path.is_file():
        pytest.skip(f"{path} absent: make it with `python scripts/smollm2_formats.py`")
    return path


def smollm2_q4_1():
    from tests.model.gguf_files import require_smollm2

    return require_smollm2()


def prompts(vocab: int, n: int = NUM_PROMPTS) -> list[list[int]]:
    """Deterministic random-token prompts of different lengths (20-65 tokens)."""
    rng = np.random.default_rng(7)
    return [rng.integers(3, vocab, size=20 + 5 * i).tolist() for i in range(n)]


def text_prompts(gguf) -> list[list[int]]:
    """10 pieces of real text (20-65 tokens) from different places of a held-out document:
    random tokens leave the model near-undecided at most steps, text does not."""
    tokens = heldout_tokens(gguf, 400 * NUM_PROMPTS)
    return [tokens[400 * i : 400 * i + 20 + 5 * i] for i in range(NUM_PROMPTS)]


def seq(slot, tokens, start, num_logits=1, full=None, **kw):
    return ScheduledSeq(
        f"r{slot}", slot, tokens, start, num_logits, GREEDY, 0, 0,
        prompt_token_ids=full or [], **kw,
    )  # fmt: skip


def generate(ex, batch: list[list[int]], split: bool = False, margins_of: bool = True):
    """Greedy continuations of every prompt (all in one step; `split`: two chunks each),
    and per prompt the top-2 logit margins of every sampled position (`margins_of`: from
    llama.cpp's rows, so only for an executor whose every step ends in a llama.cpp pass)."""
    if split:
        ex.execute(StepPlan([seq(i, p[: len(p) // 2], 0, 0) for i, p in enumerate(batch)]))
        plan = [seq(i, p[len(p) // 2 :], len(p) // 2) for i, p in enumerate(batch)]
    else:
        plan = [seq(i, p, 0) for i, p in enumerate(batch)]
    out: list[list[int]] = [[] for _ in batch]
    margins: list[list[float]] = [[] for _ in batch]
    for _ in range(NEW_TOKENS):
        result = ex.execute(StepPlan(plan))
        assert not result.errors, result.errors
        if margins_of:
            rows = np.sort(ex.last_logits, axis=-1)
            order = sorted(range(len(plan)), key=lambda j: plan[j].slot_id)  # llama.cpp's order
            for row, j in enumerate(order):
                margins[plan[j].slot_id].append(float(rows[row, -1] - rows[row, -2]))
        for s in plan:
            out[s.slot_id] += result.sampled_token_ids[s.request_id]
        plan = [
            seq(s.slot_id, [out[s.slot_id][-1]], s.start_position + len(s.token_ids)) for s in plan
        ]
    return out, margins


def assert_greedy_parity(gguf, split=False):
    kwargs = dict(num_slots=NUM_PROMPTS, max_model_len=256, flash_attn=True, n_threads=1)
    batch = text_prompts(gguf)
    with plain(gguf, **kwargs) as ref:
        want, margins = generate(ref, batch, split)
    with wide(gguf, **kwargs) as ex:
        got, _ = generate(ex, batch, split, margins_of=False)
    assert_near_ties(want, got, margins)


def assert_near_ties(want, got, margins):
    """Each prompt's tokens equal, or diverge where llama.cpp's top-2 margin was a near-tie."""
    diverged = []
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"prompt {i}: diverges at token {at}, llama.cpp margin {margins[i][at]:.3f}")
            diverged.append(margins[i][at])
    assert all(m < NEAR_TIE for m in diverged), f"divergence beyond a near-tie: {diverged}"


@pytest.mark.parametrize("flash_attn", [True, False])
def test_kv_chunk_layout_round_trips(flash_attn):
    with plain(DEMO_GGUF, num_slots=2, max_model_len=64, flash_attn=flash_attn) as ex:
        ex.execute(StepPlan([seq(1, prompts(ex.vocab_size, 1)[0][:17], 0)]))
        chunk = ex.export_slot(1, 17)
        rows = ggml_kv_rows.parse_chunk(chunk)
        assert rows.num_cells == 17 and rows.v_trans is (not flash_attn)
        assert len(rows.k) == ex.n_layer and rows.k[0].dtype == np.float16
        assert ggml_kv_rows.build_chunk(rows, seq_id=1) == chunk
        ex.import_slot(0, ggml_kv_rows.build_chunk(rows), 17)  # another slot takes it
        assert ex.export_slot(0, 17) == ggml_kv_rows.build_chunk(rows, seq_id=0)


def test_layout_errors_are_clear():
    with pytest.raises(ggml_kv_rows.KVLayoutError):
        ggml_kv_rows.parse_chunk(b"\x02\x00\x00\x00" + b"\x00" * 8)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_wide_kv_matches_llama_cpp(flash_attn):
    batch = prompts(4096, 2)
    kwargs = dict(num_slots=2, max_model_len=128, flash_attn=flash_attn, n_threads=1)
    with plain(DEMO_GGUF, **kwargs) as ref, wide(DEMO_GGUF, **kwargs) as ex:
        for e in (ref, ex):  # one prompt whole, one in two chunks
            e.execute(StepPlan([seq(0, batch[0], 0, 0), seq(1, batch[1][:10], 0, 0)]))
            e.execute(StepPlan([seq(1, batch[1][10:], 10, 0)]))
        for slot, p in enumerate(batch):
            a = ggml_kv_rows.parse_chunk(ref.export_slot(slot, len(p)))
            b = ggml_kv_rows.parse_chunk(ex.export_slot(slot, len(p)))
            assert np.array_equal(a.positions, b.positions)
            for x, y in zip(a.k + a.v, b.k + b.v):
                x, y = x.astype(np.float32), y.astype(np.float32)
                assert np.abs(x - y).max() <= 0.05 * np.abs(x).max() + 1e-2


def test_demo_greedy_parity():
    assert_greedy_parity(DEMO_GGUF)


def test_demo_greedy_parity_in_two_chunks():
    assert_greedy_parity(DEMO_GGUF, split=True)


@pytest.mark.real_model
def test_smollm2_bf16_greedy_parity():
    assert_greedy_parity(smollm2_bf16())


@pytest.mark.real_model
def test_smollm2_q4_1_greedy_parity():
    assert_greedy_parity(smollm2_q4_1(), split=True)


def perplexity(ex, tokens: list[int], window: int) -> float:
    """Each window: its first half prefilled (the path under test), its second half scored by
    llama.cpp (prompt logprobs) over that KV."""
    total, count, half = 0.0, 0, window // 2
    for start in range(0, len(tokens) - window + 1, window):
        w = tokens[start : start + window]
        ex.execute(StepPlan([seq(0, w[:half], 0, 0)]))
        scoring = seq(0, w[half:], half, 0, full=w, num_prompt_logits=window - half - 1)
        result = ex.execute(StepPlan([scoring]))
        scores = result.prompt_logprobs["r0"]
        total -= sum(s.logprob for s in scores)
        count += len(scores)
    return math.exp(total / count)


def heldout_tokens(gguf, limit: int) -> list[int]:
    from ultrafast.model_files import load_tokenizer, resolve_model

    # a frozen copy of an earlier docs/ARCHITECTURE.md: the live file changes with every doc
    # edit, and with it the text (and the perplexity ratios) these tests measure
    text = (Path(__file__).parent / "heldout_text.md").read_text(encoding="utf-8")
    return load_tokenizer(resolve_model(str(gguf))).encode(text)[:limit]


@pytest.mark.parametrize("which", ["demo", "smollm2"])
def test_perplexity_parity(which):
    if which == "smollm2":
        pytest.importorskip("gguf")
        gguf = smollm2_q4_1()
    else:
        gguf = DEMO_GGUF
    # 2,048 tokens (16 windows, 1,008 scored): at 768 the ratio swung by +-0.7% between
    # attention kernels that agree to bf16 rounding (fused SDPA vs two GEMMs around a float32
    # softmax); at 2,048 and at 6,000 tokens they all stay within 0.15% / 0.41% of llama.cpp
    tokens = heldout_tokens(gguf, 2048)
    kwargs = dict(num_slots=1, max_model_len=256, flash_attn=True, n_threads=1)
    with plain(gguf, **kwargs) as ref:
        want = perplexity(ref, tokens, 128)
    with wide(gguf, **kwargs) as ex:
        got = perplexity(ex, tokens, 128)
    print(f"{which}: perplexity llama.cpp {want:.4f}, wide {got:.4f}")
    assert abs(got / want - 1) <= 0.005, (want, got)


def test_crossover_from_two_measured_lengths():
    from ultrafast.executors.wide_route import crossover_tokens

    # wide cheaper at both lengths: from the short one
    assert crossover_tokens({32: (0.05, 0.03), 256: (0.4, 0.1)}) == 32
    # dearer at 32 (fixed cost), cheaper at 256: where the lines cross
    assert crossover_tokens({32: (0.05, 0.07), 256: (0.4, 0.2)}) == 32 + math.ceil(
        224 * 0.02 / 0.22
    )
    # not cheaper at the long length (an AVX2-only CPU, say): never
    assert crossover_tokens({32: (0.05, 0.2), 256: (0.4, 0.9)}) is None


def test_feature_detection_says_why_and_on_refuses():
    """A q8_0 KV cache has no float rows to write: auto stays on llama.cpp saying why, on
    refuses to start."""
    if _wide_unavailable():
        pytest.skip(f"wide pass not available: {_wide_unavailable()}")
    from ultrafast.executors.wide_exec import WideGgmlExecutor

    kwargs = dict(num_slots=1, max_model_len=64, kv_cache_dtype="q8_0", flash_attn=True)
    with WideGgmlExecutor(DEMO_GGUF, wide_pass="auto", **kwargs) as ex:
        assert ex.wide is None and "KV cache is q8_0" in ex.wide_status
    with pytest.raises(ValueError, match="not available: the KV cache is q8_0"):
        WideGgmlExecutor(DEMO_GGUF, wide_pass="on", **kwargs)
    with WideGgmlExecutor(DEMO_GGUF, wide_pass="off", **kwargs) as ex:
        assert ex.wide is None and ex.wide_status.startswith("off (--wide-pass off)")


def test_auto_routes_by_its_measurement():
    if _wide_unavailable():
        pytest.skip(f"wide pass not available: {_wide_unavailable()}")
    from ultrafast.executors.wide_exec import WideGgmlExecutor

    kwargs = dict(num_slots=2, max_model_len=300, flash_attn=True, n_threads=1)
    with WideGgmlExecutor(DEMO_GGUF, wide_pass="auto", **kwargs) as ex:
        print(ex.wide_status)
        if ex.wide is None:
            assert ex.wide_status.startswith("off (measured not faster")
        else:
            assert ex.wide_status.startswith("on (auto)") and 2 <= ex.wide_min_tokens <= 256
        assert ex._slot_lens == [0, 0]  # the measurement left its scratch slot empty


def test_engine_config_off_builds_the_plain_executor():
    from ultrafast.config import EngineConfig
    from ultrafast.llm import build_executor
    from ultrafast.model_files import resolve_model

    config = EngineConfig(str(DEMO_GGUF), num_slots=1, max_model_len=64, wide_pass="off")
    with build_executor(config, resolve_model(str(DEMO_GGUF))) as ex:
        assert type(ex) is GgmlExecutor
    with pytest.raises(ValueError, match="wide_pass"):
        EngineConfig(str(DEMO_GGUF), wide_pass="sometimes")


def test_bad_chunks_fail_alone_with_a_reason():
    """A chunk starting past its slot's KV, or holding an out-of-vocabulary id, fails alone
    with the executor's own message; the good chunk beside it runs on the wide path."""
    kwargs = dict(num_slots=3, max_model_len=64, flash_attn=True, n_threads=1)
    with wide(DEMO_GGUF, **kwargs) as ex:
        good = prompts(ex.vocab_size, 1)[0]
        result = ex.execute(
            StepPlan([seq(0, good, 0), seq(1, good[:8], 10), seq(2, good[:7] + [ex.vocab_size], 0)])
        )
        assert "holds 0 positions, cannot start at 10" in result.errors["r1"]
        assert "out of range" in result.errors["r2"]
        assert len(result.sampled_token_ids["r0"]) == 1
        held = ex.mirror.length(0) if ex.decode_router.on_width else ex._slot_lens[0]
        assert held == len(good)  # in the torch mirror with wide decode on, else in llama.cpp


def test_wide_weights_are_packed_for_onednn_where_supported():
    """The wide forward's matrices and lm_head are packed once at load (packed_linear.py), so no
    GEMM reorders its weight per call; the demo's wide KV parity above runs on them."""
    from ultrafast.executors.packed_linear import pack_support
    from ultrafast.executors.wide_forward import WideForward

    if _wide_unavailable() or pack_support():
        pytest.skip(f"no packed bf16 weights here: {_wide_unavailable() or pack_support()}")
    fw = WideForward(DEMO_GGUF, 64)
    layer = fw.layers[0]
    matrices = (layer.qkv, layer.o, layer.gate_up, layer.down)
    assert all(w.packed.is_mkldnn for w in matrices) and fw.lm_head.packed.is_mkldnn


def test_timed_gemms_keep_other_kernels_only_for_the_row_counts_measured_faster(monkeypatch):
    """warm_gemms builds; time_gemms times each matrix kind on the first layer at the built
    counts (packed_linear.fastest_kernel), giving way when asked, dropping what it timed on
    a busy machine and trying again later, then gives every layer its kind's choice and
    frees the plain copies of the kinds that need none. A pass at the chosen row count runs
    the plain o and the down in halves and computes the same KV."""
    import torch

    from ultrafast.executors import wide_forward as wf
    from ultrafast.executors.packed_linear import pack_support

    if _wide_unavailable() or pack_support():
        pytest.skip(f"no packed bf16 weights here: {_wide_unavailable() or pack_support()}")
    fw = wf.WideForward(DEMO_GGUF, 64)
    first_o = fw.layers[0].o
    timed = []

    first_down = fw.layers[0].down

    streams, head_timed = [], []

    def fastest_kernel(w, rows, bias=None, stream=()):
        if w is fw.lm_head:  # timed at decode steps' counts (<= tile_gemm's rows) only
            head_timed.append(rows)
            return "packed"
        timed.append(rows)
        streams.append((rows, bias is None, [id(m) for m in stream]))
        if rows == 48:
            return {id(first_o): "plain", id(first_down): "halves"}.get(id(w), "packed")
        return "packed"

    monkeypatch.setattr(wf, "fastest_kernel", fastest_kernel)
    fw.warm_gemms([16, 48])
    assert "timed when the engine is next idle" in fw.gemm_status
    asked = iter([False, True])  # a request arrives after the first count
    assert not fw.time_gemms(lambda: next(asked, False))
    assert timed == [16] * 4 and fw.layers[0].o.plain is not None  # nothing decided yet
    assert fw.gemms_untimed == [16, 48] and fw.gemms_due()  # the cut group: timed again

    class Busy:  # another process kept a core busy meanwhile: the verdicts are noise
        def others_busy_cores(self):
            return 1.0

    monkeypatch.setattr(wf, "BusyWindow", Busy)
    assert not fw.time_gemms()
    assert fw.gemms_untimed == [16, 48] and not fw.gemms_due()  # tried again later
    fw._gemms_retry_at = 0.0  # later
    monkeypatch.setattr(wf, "BusyWindow", type("Quiet", (), {"others_busy_cores": lambda s: 0}))
    timed.clear()
    assert fw.gemms_due() and fw.time_gemms()
    assert timed == [16] * 4 + [48] * 4 and head_timed[-1:] == [16]
    # up to tile_gemm's rows (no bias) a kind is timed over every layer's matrix: a decode
    # step streams them all
    kinds = ("qkv", "o", "gate_up", "down")
    for (rows, no_bias, stream), kind in zip(streams[-8:], kinds * 2):
        every = [id(getattr(layer, kind)) for layer in fw.layers]
        assert stream == (every if rows == 16 and no_bias else []), (rows, kind)
    assert all(
        layer.o.rows_of("plain") == {48} and layer.o.plain is not None for layer in fw.layers
    )
    assert all(layer.down.rows_of("halves") == {48} for layer in fw.layers)
    others = [getattr(layer, kind) for layer in fw.layers for kind in ("qkv", "gate_up", "down")]
    assert all(w.plain is None and not w.rows_of("plain") for w in others)
    assert "plain for o at 1 (48-48); halves for down at 1 (48-48)" in fw.gemm_status
    ids, positions = torch.arange(5, 53), torch.arange(48)
    plain_keys, plain_values = fw.kv(ids, positions, [wf.SeqChunk(0, 48, 0)])
    for layer in fw.layers:
        layer.o.choose({})
        layer.down.choose({})
    keys, values = fw.kv(ids, positions, [wf.SeqChunk(0, 48, 0)])
    for got, want in zip(plain_keys + plain_values, keys + values):
        assert torch.allclose(got, want, rtol=0, atol=0.02 * float(want.abs().max()))


def test_a_tied_bf16_head_shares_the_embedding(monkeypatch):
    """A tied lm_head that is the bf16 embedding (a large vocabulary) is not copied to pack it:
    the copy would cost a second embedding's memory."""
    from ultrafast.executors import wide_forward

    if _wide_unavailable():
        pytest.skip(f"wide pass not available: {_wide_unavailable()}")
    monkeypatch.setattr(wide_forward, "_F32_EMBEDDING_MAX_BYTES", 0)  # embed kept bf16
    monkeypatch.setattr(wide_forward, "gemm_dtype", lambda: (torch.bfloat16, "bf16 (test)"))
    fw = wide_forward.WideForward(DEMO_GGUF, 64)
    tied = "output.weight" not in {t.name for t in _gguf_tensor_infos(DEMO_GGUF)}
    if not tied:
        pytest.skip("the demo model has its own lm_head")
    assert fw.lm_head is fw.embed


def test_float32_gemms_multiply_by_the_heads_bf16_values(monkeypatch):
    """Where the GEMMs run in float32 (no fast bf16 product here), the weights are float32
    copies of the bf16-rounded matrices (packed for oneDNN where it packs float32), the head
    too (not the exact float32 embedding), and a pass's activations reach them in float32
    (no bf16 round trip): the bf16 path's weights, whichever product this CPU runs."""
    from ultrafast.executors import packed_linear, wide_forward
    from ultrafast.executors.packed_linear import Weight, linear, pack_support

    f32 = lambda: (torch.float32, "float32 (test)")  # noqa: E731
    monkeypatch.setattr(wide_forward, "gemm_dtype", f32)
    monkeypatch.setattr(packed_linear, "gemm_dtype", f32)
    fw = wide_forward.WideForward(DEMO_GGUF, 64)
    assert fw.embed.dtype == torch.float32 and fw.act == torch.float32
    head = fw.lm_head
    assert isinstance(head, Weight) and head.packed.dtype == torch.float32
    layer = fw.layers[0]
    assert layer.gate_up.packed.dtype == torch.float32
    assert layer.gate_up.packed.is_mkldnn == (pack_support(torch.float32) is None)
    dense = head.packed.to_dense() if head.packed.is_mkldnn else head.packed
    if "output.weight" not in {t.name for t in _gguf_tensor_infos(DEMO_GGUF)}:  # tied
        assert torch.equal(dense, fw.embed.to(torch.bfloat16).float())
    x = torch.randn(3, dense.shape[1]).to(torch.bfloat16)
    want = (x.float() @ dense.T).to(torch.bfloat16)
    torch.testing.assert_close(linear(x, head), want)
    fw.fused = None  # torch's elementwise ops (the fused ones write bf16)
    seen = []
    real = wide_forward.linear
    monkeypatch.setattr(
        wide_forward, "linear", lambda x, w, b=None: seen.append(x.dtype) or real(x, w, b)
    )
    tokens = torch.arange(5)
    fw.kv(tokens, tokens, [wide_forward.SeqChunk(0, 5, 0)])
    assert seen and set(seen) == {torch.float32}
    # a pass that samples (wide decode) rounds its GEMM inputs to bf16: the bf16 path's numbers
    from ultrafast.executors import wide_decode

    seen.clear()
    monkeypatch.setattr(wide_decode, "linear", wide_forward.linear)  # the head's too
    mirror = wide_decode.new_mirror(fw, 64, 2)
    chunk = [wide_forward.SeqChunk(0, 5, 0)]
    wide_decode.step_logits(fw, mirror, (list(range(5)), list(range(5)), chunk, [0]), None, [0])
    assert seen and set(seen) == {torch.bfloat16}


def _gguf_tensor_infos(path):
    from ultrafast.model.gguf_meta import read_gguf_metadata

    return read_gguf_metadata(path).tensors


def spy_gemm_rows(monkeypatch, module) -> list[tuple[int, int]]:
    """(rows, input width) of every GEMM `module.linear` runs from now on (oneDNN builds a
    primitive per row count: the tests of padding and of the load's builds read them)."""
    seen: list[tuple[int, int]] = []
    real = module.linear

    def counted(x, weight, bias=None):
        seen.append((x.shape[0], x.shape[1]))
        return real(x, weight, bias)

    monkeypatch.setattr(module, "linear", counted)
    return seen


def test_prefill_rows_are_padded_to_few_gemm_shapes(monkeypatch):
    """A wide prefill runs its GEMMs on `padded_rows(T)` rows (oneDNN builds a primitive per
    row count: few shapes, few builds), returns exactly T rows, and those equal an unpadded
    pass's up to bf16 rounding."""
    import torch

    from ultrafast.executors import wide_forward as wf

    sizes = (1, 32, 33, 48, 49, 102, 500, 512)
    assert [wf.padded_rows(n) for n in sizes] == [1, 32, 48, 48, 64, 112, 512, 512]
    fw = wf.WideForward(DEMO_GGUF, 256)
    seen = spy_gemm_rows(monkeypatch, wf)
    ids, positions = torch.arange(5, 105), torch.arange(100)
    chunks = [wf.SeqChunk(0, 60, 0), wf.SeqChunk(60, 40, 0)]
    keys, values = fw.kv(ids, positions, chunks)
    assert {rows for rows, _ in seen} == {112} and keys[0].shape[0] == values[0].shape[0] == 100
    monkeypatch.setattr(wf, "padded_rows", lambda n: n)
    exact_keys, exact_values = fw.kv(ids, positions, chunks)
    for got, want in zip(keys + values, exact_keys + exact_values):
        assert torch.allclose(got, want, rtol=0, atol=0.02 * float(want.abs().max()))


def test_a_decode_step_on_the_tile_kernel_computes_onednns_logits():
    """SmolLM2's matrices are read by tile_gemm where oneDNN packed them; a 16-row decode
    step with every kind on TILES gives the logits of the step on oneDNN's products."""
    import torch

    from ultrafast.executors import tile_gemm, wide_decode
    from ultrafast.executors.packed_linear import TILES
    from ultrafast.executors.wide_forward import GEMM_KINDS, SeqChunk, WideForward

    if isinstance(tile_gemm.load(), str) or _wide_unavailable():
        pytest.skip(f"no AMX tile kernel here: {tile_gemm.load()}")
    fw = WideForward(smollm2_q4_1(), 256)
    weights = [getattr(layer, kind) for layer in fw.layers for kind in GEMM_KINDS]
    assert all(w.tile_block in (32, 64) for w in weights)  # every layout recognized
    mirror = wide_decode.new_mirror(fw, 256, 16)
    prompt = list(range(100, 140))
    for slot in range(16):  # 16 slots holding the same 40 positions
        chunk = (prompt, list(range(40)), [SeqChunk(0, 40, 0)], [slot])
        wide_decode.step_logits(fw, mirror, chunk, None)

    def step(kernels: dict[int, str]) -> torch.Tensor:
        for w in weights:
            w.choose(kernels)
        for slot in range(16):
            mirror.lens[slot] = 40
        tokens = list(range(200, 216))
        return wide_decode.step_logits(fw, mirror, None, (tokens, list(range(16)), [40] * 16))

    want = step({})
    got = step({16: TILES})
    assert all(w.kernel_at(16) == TILES for w in weights)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * float(want.abs().max()))
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_memory_check_counts_the_weights_in_the_gemm_dtype(monkeypatch, dtype):
    """The wide path is refused where its weights, at the measured GEMM dtype's size, would
    take more than a quarter of the free memory; float32 weights count twice bf16's."""
    from types import SimpleNamespace

    from ultrafast.executors import wide_route
    from ultrafast.model.gguf_meta import read_gguf_metadata

    params = sum(math.prod(t.shape) for t in read_gguf_metadata(DEMO_GGUF).tensors)
    weight_bytes = dtype.itemsize * params
    monkeypatch.setattr(wide_route, "gemm_dtype", lambda: (dtype, "test"))
    ex = SimpleNamespace(gguf_path=DEMO_GGUF, kv_cache_dtype="f16")
    monkeypatch.setattr(wide_route, "available_memory_bytes", lambda: 4 * weight_bytes + 8)
    assert wide_route.unavailable(ex) is None
    monkeypatch.setattr(wide_route, "available_memory_bytes", lambda: 4 * weight_bytes - 8)
    why = wide_route.unavailable(ex)
    name = "bf16" if dtype == torch.bfloat16 else "f32"
    assert why is not None and f"its {name} weights" in why and "would exceed 25%" in why
