"""Wide decode steps (executors/wide_decode.py): many 1-token decodes as one torch step over a
KV mirror, with the KV moved between the mirror and llama.cpp's slots as steps change width.

- greedy tokens: 10 prompts x 32 tokens from a schedule that switches between wide steps (all
  10 slots, torch) and narrow ones (2 slots, llama.cpp), so every slot's KV moves both ways
  many times, equal the plain llama.cpp path's or diverge only at a near-tie (the margin is
  printed), on the demo model, SmolLM2's bf16 GGUF and its shipped Q4_1;
- perplexity of held-out text fed token by token through wide decode steps within 0.5% of
  llama.cpp's;
- the router's hysteresis and the measured threshold; a slot exported after torch decodes
  holds them; a bad decode fails alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.model.test_wide_pass import (
    DEMO_GGUF,
    NEW_TOKENS,
    NUM_PROMPTS,
    assert_near_ties,
    generate,
    heldout_tokens,
    plain,
    seq,
    smollm2_bf16,
    smollm2_q4_1,
    spy_gemm_rows,
    text_prompts,
    wide,
)
from ultrafast.core.types import StepPlan
from ultrafast.executors import ggml_kv_rows, wide_decode, wide_decode_route
from ultrafast.executors.wide_decode_route import DecodeRouter, from_positions, on_width

KWARGS = dict(num_slots=NUM_PROMPTS, max_model_len=256, flash_attn=True, n_threads=1)


def wide_decoder(gguf, on: int = 4, **kwargs):
    ex = wide(gguf, **kwargs)
    ex.decode_router = DecodeRouter(on)  # steps of >= 4 decodes in torch, < 3 on llama.cpp
    return ex


def counting_moves(monkeypatch) -> dict[str, int]:
    counts = {"pull": 0, "push": 0}
    for name in counts:
        real = getattr(wide_decode, name)

        def counted(*args, _real=real, _name=name):
            counts[_name] += 1
            return _real(*args)

        monkeypatch.setattr(wide_decode, name, counted)
    return counts


def generate_switching(ex, batch: list[list[int]]) -> list[list[int]]:
    """Greedy continuations where every third step runs only two slots (llama.cpp) and the
    others all unfinished slots (torch)."""
    ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))  # prefill + 1st token
    out = [[] for _ in batch]
    first = ex.execute(StepPlan([seq(i, p[-1:], len(p) - 1) for i, p in enumerate(batch)]))
    for i in range(len(batch)):
        out[i] += first.sampled_token_ids[f"r{i}"]
    step = 0
    while any(len(o) < NEW_TOKENS for o in out):
        step += 1
        todo = [i for i, o in enumerate(out) if len(o) < NEW_TOKENS]
        if step % 3 == 0:
            todo = todo[step % len(todo) :][:2] or todo[:2]
        plan = [seq(i, out[i][-1:], len(batch[i]) + len(out[i]) - 1) for i in todo]
        result = ex.execute(StepPlan(plan))
        assert not result.errors, result.errors
        for i in todo:
            out[i] += result.sampled_token_ids[f"r{i}"]
    return out


def assert_switching_parity(gguf, monkeypatch):
    batch = text_prompts(gguf)
    with plain(gguf, **KWARGS) as ref:
        want, margins = generate(ref, batch)
    moves = counting_moves(monkeypatch)
    with wide_decoder(gguf, **KWARGS) as ex:
        got = generate_switching(ex, batch)
    assert moves["pull"] >= NUM_PROMPTS and moves["push"] >= 2, moves  # both directions ran
    assert_near_ties(want, got, margins)


@pytest.fixture(params=["kernel", "sdpa"])
def attention(request, monkeypatch):
    """Each decode attention path in turn (decode_attention.py): the C kernel where it builds
    here, torch's SDPA path (its fallback) always."""
    if request.param == "kernel":
        kernel, status = wide_decode.attention_choice.__wrapped__(9, 3, 64)
        if kernel is None:
            pytest.skip(f"no C kernel here: {status}")
        monkeypatch.setattr(wide_decode, "attention_choice", lambda *a: (kernel, status))
    else:
        monkeypatch.setattr(wide_decode, "attention_choice", lambda *a: (None, "sdpa"))
    return request.param


def test_demo_switching_greedy_parity(monkeypatch, attention):
    assert_switching_parity(DEMO_GGUF, monkeypatch)


@pytest.mark.real_model
def test_smollm2_bf16_switching_greedy_parity(monkeypatch):
    assert_switching_parity(smollm2_bf16(), monkeypatch)


@pytest.mark.real_model
def test_smollm2_q4_1_switching_greedy_parity(monkeypatch):
    assert_switching_parity(smollm2_q4_1(), monkeypatch)


def decode_perplexity(ex, tokens: list[int], logits_of, window: int = 96) -> float:
    """NUM_PROMPTS windows of held-out text: the first quarter prefilled, every later token fed
    as a decode of all windows in one step; the NLL of each next token from that step's rows."""
    windows = [tokens[i * window : (i + 1) * window] for i in range(NUM_PROMPTS)]
    first = window // 4
    ex.execute(StepPlan([seq(i, w[:first], 0, 0) for i, w in enumerate(windows)]))
    total, count = 0.0, 0
    for position in range(first, window - 1):
        ex.execute(StepPlan([seq(i, [w[position]], position) for i, w in enumerate(windows)]))
        rows = logits_of(ex).astype(np.float64)
        for i, w in enumerate(windows):
            row = rows[i] - rows[i].max()
            total -= row[w[position + 1]] - math.log(np.exp(row).sum())
            count += 1
    return math.exp(total / count)


@pytest.mark.parametrize("which", ["demo", "smollm2"])
def test_decode_perplexity_parity(which):
    gguf = DEMO_GGUF if which == "demo" else smollm2_q4_1()
    tokens = heldout_tokens(gguf, 96 * NUM_PROMPTS)
    with plain(gguf, **KWARGS) as ref:
        want = decode_perplexity(ref, tokens, lambda e: e.last_logits)
    with wide_decoder(gguf, **KWARGS) as ex:
        got = decode_perplexity(ex, tokens, lambda e: e.last_decode_logits)
        assert ex.mirror.length(0) == 96 - 1  # the decodes ran in torch
    print(f"{which}: decode perplexity llama.cpp {want:.4f}, torch {got:.4f}")
    assert abs(got / want - 1) <= 0.005, (want, got)


def test_export_after_torch_decodes_holds_them():
    """llama.cpp's slot receives the torch rows before anything reads it: an export right
    after wide decodes covers every position, and those rows are close to llama.cpp's own."""
    batch = text_prompts(DEMO_GGUF)[:4]
    kwargs = dict(KWARGS, num_slots=4)
    exported = []
    for ex in (plain(DEMO_GGUF, **kwargs), wide_decoder(DEMO_GGUF, **kwargs)):
        with ex:
            ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
            for k in range(3):  # fixed tokens: both executors write the same positions
                ex.execute(StepPlan([seq(i, [5 + k], len(p) + k) for i, p in enumerate(batch)]))
            n = len(batch[2]) + 3
            exported.append(ggml_kv_rows.parse_chunk(ex.export_slot(2, n)))
            if hasattr(ex, "mirror"):
                assert ex._slot_lens[2] == n and ex.mirror.length(2) == n
    a, b = exported
    assert np.array_equal(np.sort(a.positions), np.sort(b.positions))
    for x, y in zip(a.k + a.v, b.k + b.v):
        x, y = x.astype(np.float32), y.astype(np.float32)
        assert np.abs(x - y).max() <= 0.05 * np.abs(x).max() + 1e-2


def run_schedule(ex, batch: list[list[int]], steps: int = 8, margins_of: bool = True):
    """Slots 0-1 prefill alone (2 last tokens: a narrow step, on llama.cpp), then the others
    prefill beside their decodes (a wide step), then every slot decodes: the tokens, and per
    slot the top-2 margins from llama.cpp's rows (meaningful for the plain executor only)."""
    out: list[list[int]] = [[] for _ in batch]
    margins: list[list[float]] = [[] for _ in batch]
    plan = [seq(i, batch[i], 0) for i in (0, 1)]
    plans = [plan]
    for step in range(steps):
        result = ex.execute(StepPlan(plans[-1]))
        assert not result.errors, result.errors
        rows = np.sort(ex.last_logits, axis=-1) if margins_of else None
        for row, s in enumerate(sorted(plans[-1], key=lambda s: s.slot_id)):
            if rows is not None:
                margins[s.slot_id].append(float(rows[row, -1] - rows[row, -2]))
        for s in plans[-1]:
            out[s.slot_id] += result.sampled_token_ids[s.request_id]
        started = [i for i in range(len(batch)) if out[i]]
        decodes = [seq(i, out[i][-1:], len(batch[i]) + len(out[i]) - 1) for i in started]
        new = [seq(i, batch[i], 0) for i in range(2, len(batch))] if step == 0 else []
        plans.append(decodes + new)
    return out, margins


def test_a_narrow_prefill_runs_wholly_in_torch(monkeypatch):
    """With wide decode on, a step of prefills alone (too narrow for torch decodes) runs every
    chunk token in torch, its first token sampled from the same pass: no push, no llama.cpp
    pass; a schedule from there gives tokens equal to llama.cpp's or diverging at a near-tie,
    and a torch step after llama.cpp steps pulls only the rows llama.cpp computed since."""
    batch = text_prompts(DEMO_GGUF)[:6]
    kwargs = dict(KWARGS, num_slots=6)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want, margins = run_schedule(ref, batch)
    moves = counting_moves(monkeypatch)
    pulled: list[int] = []
    real_pull = wide_decode.pull

    def pull(ex, slot, end):
        pulled.append(end - ex.mirror.length(slot))
        return real_pull(ex, slot, end)

    monkeypatch.setattr(wide_decode, "pull", pull)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        moves.update(pull=0, push=0)
        result = ex.execute(StepPlan([seq(i, batch[i], 0) for i in (0, 1)]))
        assert [ex.mirror.length(i) for i in (0, 1)] == [len(batch[0]), len(batch[1])]
        assert [ex._slot_lens[i] for i in (0, 1)] == [0, 0]
        assert moves == {"pull": 0, "push": 0} and len(result.sampled_token_ids) == 2
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        pulled.clear()
        got, _ = run_schedule(ex, batch, margins_of=False)
        assert max(pulled, default=0) <= 1, pulled  # no prompt came back from llama.cpp
    assert_near_ties(want, got, margins)


def test_few_decodes_ride_along_a_prefill_pass(monkeypatch):
    """Two decodes (under the on width of 8) beside a prefill chunk join its torch pass: no
    llama.cpp pass and no push in that step, which says it ran as one pass; the same two
    alone run on llama.cpp, after one push per slot; the tokens equal llama.cpp's or diverge
    at a near-tie."""
    from ultrafast.executors.ggml_exec import GgmlExecutor

    batch = text_prompts(DEMO_GGUF)[:3]
    kwargs = dict(KWARGS, num_slots=3)
    ggml_passes: list[list[int]] = []
    real_execute = GgmlExecutor.execute

    def ggml_execute(self, plan):
        ggml_passes.append(sorted(s.slot_id for s in plan.seqs))
        return real_execute(self, plan)

    def schedule(ex, moves=None):
        first = ex.execute(StepPlan([seq(i, batch[i], 0) for i in (0, 1)]))
        out = [first.sampled_token_ids[f"r{i}"] for i in (0, 1)] + [[]]
        ggml_passes.clear()
        if moves is not None:
            moves.update(pull=0, push=0)
        plan = [seq(i, out[i], len(batch[i])) for i in (0, 1)] + [seq(2, batch[2], 0)]
        result = ex.execute(StepPlan(plan))  # 2 decodes + a prefill: one torch pass
        if moves is not None:
            assert ggml_passes == [] and moves == {"pull": 0, "push": 0}, (ggml_passes, moves)
            assert result.num_passes == 1  # mixed lengths in one pass: the step costs learn it
        for s in plan:
            out[s.slot_id] += result.sampled_token_ids[s.request_id]
        plan = [seq(i, out[i][-1:], len(batch[i]) + 1) for i in (0, 1)]
        result = ex.execute(StepPlan(plan))  # the 2 decodes alone: narrow, on llama.cpp
        if moves is not None:
            assert ggml_passes == [[0, 1]] and moves["push"] == 2, (ggml_passes, moves)
            assert result.num_passes is None  # llama.cpp's pass: its caps tell
        for s in plan:
            out[s.slot_id] += result.sampled_token_ids[s.request_id]
        return out

    monkeypatch.setattr(GgmlExecutor, "execute", ggml_execute)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want = schedule(ref)
    moves = counting_moves(monkeypatch)
    with wide_decoder(DEMO_GGUF, on=8, **kwargs) as ex:
        got = schedule(ex, moves)
    assert want == got  # the demo model decides these tokens by wide margins


def narrow_decodes(ex, slot: int, out: list[int], prompt_len: int, steps: int) -> list[int]:
    """`steps` 1-token decodes of `slot` (request r<slot>) after its prompt and `out`, each
    a step of its own (narrow: on llama.cpp): `out` and the new tokens."""
    for _ in range(steps):
        step = [seq(slot, out[-1:], prompt_len + len(out) - 1)]
        out = out + ex.execute(StepPlan(step)).sampled_token_ids[f"r{slot}"]
    return out


def assert_copy_continues_as_on_llama_cpp(monkeypatch, schedule, slot_1_len: int) -> None:
    """`schedule` (given a second argument, the move counts, on the wide decoder) gives
    llama.cpp's tokens on a wide decoder, which pushed slot 1's rows to llama.cpp once."""
    kwargs = dict(KWARGS, num_slots=2)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want = schedule(ref)
    moves = counting_moves(monkeypatch)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        got = schedule(ex, moves)
        assert moves["push"] == 1 and ex._slot_lens[1] == slot_1_len
    assert want == got  # the demo model decides these tokens by wide margins


def test_a_prefix_held_only_by_the_mirror_is_copied_there(monkeypatch):
    """A prefix-cache hit whose source slot was prefilled in torch copies the prefix within
    the mirror (no push of the source slot to llama.cpp); the continuation's tokens equal
    llama.cpp's or diverge at a near-tie, and llama.cpp gets the rows when it runs the slot."""
    from ultrafast.core.types import KVCopy

    first, second = text_prompts(DEMO_GGUF)[:2]
    shared = 12
    other = first[:shared] + second[shared:]  # the same first 12 tokens, then its own

    def schedule(ex, moves=None):
        ex.execute(StepPlan([seq(0, first, 0)]))
        if moves is not None:
            moves.update(pull=0, push=0)
        copy = KVCopy(src_slot_id=0, dst_slot_id=1, num_tokens=shared)
        plan = StepPlan([seq(1, other[shared:], shared)], kv_copies=[copy])
        out = ex.execute(plan).sampled_token_ids["r1"]
        if moves is not None:
            assert moves == {"pull": 0, "push": 0}, moves
            assert ex.mirror.length(1) == len(other) and ex._slot_lens[1] == 0
        return narrow_decodes(ex, 1, out, len(other), 3)  # slot 1's rows pushed once

    assert_copy_continues_as_on_llama_cpp(monkeypatch, schedule, len(other) + 3)


def test_a_prefix_both_sides_hold_is_copied_in_the_mirror_alone(monkeypatch):
    """A prefix-cache hit whose source slot both the mirror and llama.cpp hold (prefilled in
    torch, then decoded on llama.cpp) copies it within the mirror only while torch passes run
    over the mirror: llama.cpp's copy (a state export and import) is skipped, and llama.cpp
    gets the rows by one push when it next runs the slot. Tokens equal llama.cpp's."""
    from ultrafast.core.types import KVCopy
    from ultrafast.executors.ggml_exec import GgmlExecutor

    first, second = text_prompts(DEMO_GGUF)[:2]
    shared = 12
    other = first[:shared] + second[shared:]
    ggml_copies = []
    real_copy = GgmlExecutor._copy_prefix

    def counted_copy(self, *args):
        ggml_copies.append(args)
        return real_copy(self, *args)

    def schedule(ex, moves=None):
        out0 = ex.execute(StepPlan([seq(0, first, 0)])).sampled_token_ids["r0"]
        out0 = narrow_decodes(ex, 0, out0, len(first), 2)  # slot 0 pushed: both hold it
        if moves is not None:
            assert ex._slot_lens[0] >= shared and ex.mirror.length(0) >= shared
            moves.update(pull=0, push=0)
            monkeypatch.setattr(GgmlExecutor, "_copy_prefix", counted_copy)
        copy = KVCopy(src_slot_id=0, dst_slot_id=1, num_tokens=shared)
        plan = StepPlan([seq(1, other[shared:], shared)], kv_copies=[copy])
        out = ex.execute(plan).sampled_token_ids["r1"]
        if moves is not None:
            assert ggml_copies == [] and moves == {"pull": 0, "push": 0}, (ggml_copies, moves)
            assert ex.mirror.length(1) == len(other) and ex._slot_lens[1] == 0
        return out0, narrow_decodes(ex, 1, out, len(other), 3)  # slot 1's rows pushed once

    assert_copy_continues_as_on_llama_cpp(monkeypatch, schedule, len(other) + 3)


def test_a_prefix_only_llama_cpp_holds_is_pulled_once_for_every_copy(monkeypatch):
    """Copies of a prefix that only llama.cpp's slot holds (a slot it filled: a shared system
    prompt) pull it into the source slot's mirror once; every later copy is a mirror copy,
    not a pull into each new slot. The continuations equal llama.cpp's."""
    from ultrafast.core.types import KVCopy

    prompts = text_prompts(DEMO_GGUF)[:3]
    shared = 12
    others = [prompts[0][:shared] + p[shared:] for p in prompts[1:]]
    kwargs = dict(KWARGS, num_slots=3)
    with plain(DEMO_GGUF, **kwargs) as ref:
        ref.execute(StepPlan([seq(0, prompts[0], 0)]))
        payload = ref.export_slot(0, len(prompts[0]))

    def schedule(ex, moves=None):
        ex.import_slot(0, payload, len(prompts[0]))  # slot 0: llama.cpp's rows only
        if moves is not None:
            moves.update(pull=0, push=0)
        outs = []
        for dst, other in enumerate(others, start=1):
            copy = KVCopy(src_slot_id=0, dst_slot_id=dst, num_tokens=shared)
            plan = StepPlan([seq(dst, other[shared:], shared)], kv_copies=[copy])
            outs.append(ex.execute(plan).sampled_token_ids[f"r{dst}"])
            if moves is not None:
                assert ex.mirror.length(dst) == len(other)  # the chunk ran in torch
        return outs

    with plain(DEMO_GGUF, **kwargs) as ref:
        want = schedule(ref)
    moves = counting_moves(monkeypatch)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        got = schedule(ex, moves)
        assert moves == {"pull": 1, "push": 0}, moves
        assert ex.mirror.length(0) == shared
    assert want == got  # the demo model decides these tokens by wide margins


def test_prefill_last_tokens_decode_in_torch_beside_wide_decodes(monkeypatch):
    """A step whose 1-token rows run in torch takes the wide prefills' last tokens too: their
    KV goes to the mirror, not through llama.cpp (no llama.cpp pass, no import), the first
    tokens equal llama.cpp's or diverge at a near-tie, and an export afterwards holds the
    prompt's KV close to llama.cpp's own prefill."""
    from ultrafast.executors.ggml_exec import GgmlExecutor

    batch = text_prompts(DEMO_GGUF)[:4]
    kwargs = dict(KWARGS, num_slots=4)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want, margins = generate(ref, batch)
    with plain(DEMO_GGUF, **kwargs) as ref:  # the prompt's KV alone (and its first token's)
        ref.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        ref_rows = ggml_kv_rows.parse_chunk(ref.export_slot(1, len(batch[1])))
    passes = {"ggml": 0, "import": 0}
    real_execute, real_import = GgmlExecutor.execute, GgmlExecutor.import_slot

    def ggml_execute(self, plan):
        passes["ggml"] += 1
        return real_execute(self, plan)

    def ggml_import(self, *args):
        passes["import"] += 1
        return real_import(self, *args)

    monkeypatch.setattr(GgmlExecutor, "execute", ggml_execute)
    monkeypatch.setattr(GgmlExecutor, "import_slot", ggml_import)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        passes.update({"ggml": 0, "import": 0})  # the start-up timing ran passes
        first = ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        assert passes == {"ggml": 0, "import": 0}  # prefill and first tokens all in torch
        assert [ex.mirror.length(i) for i in range(4)] == [len(p) for p in batch]
        got = [first.sampled_token_ids[f"r{i}"] for i in range(4)]
        assert_near_ties([w[:1] for w in want], got, margins)
        rows = ggml_kv_rows.parse_chunk(ex.export_slot(1, len(batch[1])))  # pushed on demand
    assert np.array_equal(np.sort(rows.positions), np.sort(ref_rows.positions))
    for x, y in zip(ref_rows.k + ref_rows.v, rows.k + rows.v):
        x, y = x.astype(np.float32), y.astype(np.float32)
        assert np.abs(x - y).max() <= 0.05 * np.abs(x).max() + 1e-2


def test_short_chunks_ride_along_a_torch_step(monkeypatch):
    """A prefill chunk shorter than the wide path's threshold joins a step that runs in torch
    anyway (its KV goes to the mirror, its last token decodes with the others): no llama.cpp
    pass in that step, and every token equals llama.cpp's or diverges at a near-tie. Alone
    (no torch pass in the step) it stays on llama.cpp."""
    from ultrafast.executors.ggml_exec import GgmlExecutor

    batch = text_prompts(DEMO_GGUF)[:5]
    kwargs = dict(KWARGS, num_slots=5)
    ggml_passes = []
    real_execute = GgmlExecutor.execute

    def ggml_execute(self, plan):
        ggml_passes.append(sorted(s.slot_id for s in plan.seqs))
        return real_execute(self, plan)

    def schedule(ex):
        """Slots 0-3 prefill alone; then slot 4's whole prompt beside their 4 decodes."""
        first = ex.execute(StepPlan([seq(i, batch[i], 0) for i in range(4)]))
        out = [first.sampled_token_ids[f"r{i}"] for i in range(4)] + [[]]
        ggml_passes.clear()
        plan = [seq(i, out[i][-1:], len(batch[i])) for i in range(4)] + [seq(4, batch[4], 0)]
        for _ in range(4):
            result = ex.execute(StepPlan(plan))
            assert not result.errors, result.errors
            for s in plan:
                out[s.slot_id] += result.sampled_token_ids[s.request_id]
            plan = [seq(i, out[i][-1:], len(batch[i]) + len(out[i]) - 1) for i in range(5)]
        return out

    monkeypatch.setattr(GgmlExecutor, "execute", ggml_execute)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want = schedule(ref)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        ex.wide_min_tokens = 1 + max(len(p) for p in batch)  # no chunk routes on its own
        got = schedule(ex)
        assert ggml_passes == [], ggml_passes  # slot 4's prompt and first token in torch
        assert ex.mirror.length(4) == len(batch[4]) + 3
        assert ex._slot_lens[4] == 0  # llama.cpp never ran it
    assert [len(o) for o in got] == [len(o) for o in want]
    for w, g in zip(want, got):  # a divergence may only follow a near-tie; the demo model
        assert w[:2] == g[:2]  # decides its first tokens by wide margins
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        ex.wide_min_tokens = 1 + max(len(p) for p in batch)
        ggml_passes.clear()
        ex.execute(StepPlan([seq(4, batch[4], 0)]))  # alone: nothing runs in torch
        assert ggml_passes == [[4]] and ex.mirror.length(4) == 0


def test_bad_decode_fails_alone():
    kwargs = dict(KWARGS, num_slots=5)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        batch = text_prompts(DEMO_GGUF)[:4]
        ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        plan = [seq(i, [5], len(p)) for i, p in enumerate(batch)] + [seq(4, [5], 30)]
        result = ex.execute(StepPlan(plan))
        assert "holds 0 positions, cannot start at 30" in result.errors["r4"]
        assert all(len(result.sampled_token_ids[f"r{i}"]) == 1 for i in range(4))
        assert ex.mirror.length(0) == len(batch[0]) + 1  # the four ran in torch


def test_router_hysteresis():
    router = DecodeRouter(8)
    assert router.off_width == 6
    widths = [4, 8, 7, 6, 5, 7, 8, 0, 7, 16, 2]  # 0: a step with a prefill and no decodes
    assert [router.wide(w) for w in widths] == [0, 1, 1, 1, 0, 0, 1, 0, 1, 1, 0]
    assert not DecodeRouter(0).wide(64)
    forced = DecodeRouter(2)  # steps of 1-2 decodes stay on llama.cpp whatever was measured
    assert forced.off_width == 3 and [forced.wide(w) for w in (2, 3, 1)] == [0, 1, 0]


def test_router_at_longer_contexts():
    """Where torch wins only at longer contexts: a step goes wide from its width's measured
    positions per slot (the widest measured width up to it), and stays wide down to
    STAY_SHARE of them."""
    router = DecodeRouter(0, {4: 300, 16: 100})
    assert router.enabled and not DecodeRouter(0).enabled
    assert router.positions_needed(3) is None and router.positions_needed(12) == 300
    steps = [(4, 4 * 299), (4, 4 * 300), (4, 4 * 230), (4, 4 * 200), (8, 8 * 250), (16, 1600)]
    assert [router.wide(w, p) for w, p in steps] == [0, 1, 1, 0, 0, 1]
    assert not router.wide(2, 2 * 5000)  # 1-2 decodes stay on llama.cpp
    both = DecodeRouter(16, {4: 300})  # wide from 16 at any context, from 4 at >= 300
    assert both.wide(16, 16) and both.wide(4, 4 * 400) and not both.wide(8, 8 * 100)


def test_positions_from_the_two_lines():
    short = {4: (0.020, 0.030), 8: (0.030, 0.020), 16: (0.050, 0.060)}
    # llama.cpp's step grows by 10 us a slot-position, torch's by 2: 4 wide cross 312.5
    # positions past CONTEXT_TOKENS, 16 wide 78.1; 8 wide is torch's already
    found = from_positions(short, (1e-5, 2e-6), 512)
    assert found == {
        4: wide_decode_route.CONTEXT_TOKENS + 313,
        16: wide_decode_route.CONTEXT_TOKENS + 79,
    }
    assert from_positions(short, (2e-6, 2e-6), 512) == {}  # torch's slope not the smaller
    assert from_positions(short, (1e-5, 2e-6), 64) == {16: wide_decode_route.CONTEXT_TOKENS + 79}


def test_the_narrowest_width_is_timed_again_at_a_longer_context(monkeypatch):
    """Torch slower at every width at CONTEXT_TOKENS, faster per position: the router goes
    wide at longer contexts, and the status says from where."""
    from types import SimpleNamespace

    contexts = []

    def measure(ex, slots, should_stop=lambda: False, context=wide_decode_route.CONTEXT_TOKENS):
        contexts.append((len(slots), context))
        extra = len(slots) * (context - wide_decode_route.CONTEXT_TOKENS)
        return 0.01 * len(slots) + 1e-5 * extra, 0.012 * len(slots) + 2e-6 * extra

    monkeypatch.setattr(wide_decode_route, "measure_decode", measure)
    ex = SimpleNamespace(num_slots=16, max_model_len=2048, max_num_batched_tokens=256)
    status = wide_decode_route.plan_wide_decode(ex, "auto")
    assert contexts == [(4, 64), (8, 64), (16, 64), (4, wide_decode_route.LONG_CONTEXT)]
    assert ex.decode_router.on_width == 0 and ex.decode_router.enabled
    # (0.012 - 0.01) w / (8e-6 w) = 250 positions past 64, at every width
    assert ex.decode_router.from_positions == {4: 314, 8: 314, 16: 314}
    assert "4 wide from 314 positions a slot" in status
    short = SimpleNamespace(num_slots=16, max_model_len=128, max_num_batched_tokens=256)
    contexts.clear()
    assert "decode steps on llama.cpp" in wide_decode_route.plan_wide_decode(short, "auto")
    assert contexts == [(4, 64), (8, 64), (16, 64)]  # no room for a longer context


def test_a_step_goes_wide_by_its_slots_positions(monkeypatch):
    kwargs = dict(KWARGS, num_slots=4)
    with wide_decoder(DEMO_GGUF, on=0, **kwargs) as ex:
        batch = text_prompts(DEMO_GGUF)[:4]
        ex.wide_min_tokens = 1 + max(len(p) for p in batch)  # no chunk routes on its own
        # the slots' positions reach 4x this at the fourth decode step (step 3), not before
        ex.decode_router = DecodeRouter(0, {4: (sum(len(p) for p in batch) + 12) // 4})
        ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        assert ex.mirror.length(0) == 0
        for step in range(4):  # the first steps short of the positions: llama.cpp
            ex.execute(StepPlan([seq(i, [5], len(p) + step) for i, p in enumerate(batch)]))
            in_torch = ex.mirror.length(0) > 0
            assert in_torch == (step >= 3), step


def test_on_width_from_measurements():
    # torch cheaper from 4 on: 4
    assert on_width({4: (0.04, 0.03), 8: (0.06, 0.04), 16: (0.1, 0.05)}) == 4
    # a dearer width above a cheaper one: from the width past it
    assert on_width({4: (0.02, 0.01), 8: (0.04, 0.05), 16: (0.06, 0.04)}) == 16
    # never cheaper at the widest: none
    assert on_width({4: (0.02, 0.03), 16: (0.1, 0.2)}) is None


def test_start_measures_decode_widths_and_leaves_slots_empty(monkeypatch):
    """The start times decode steps of 4, 8 and 16 slots (their contexts prefilled a slot a
    step, within a small step budget) on both paths (the torch one really in torch: the
    router is not on yet while it is timed), says what it measured, and leaves every slot
    empty."""
    torch_widths: list[int] = []
    real = wide_decode.step_logits

    def spy(fw, mirror, prefill, decodes, *args):
        torch_widths.append(0 if decodes is None else len(decodes[1]))
        return real(fw, mirror, prefill, decodes, *args)

    monkeypatch.setattr(wide_decode, "step_logits", spy)
    kwargs = dict(num_slots=16, max_model_len=128, max_num_batched_tokens=128, n_threads=1)
    with wide(DEMO_GGUF, flash_attn=True, **kwargs) as ex:
        print(ex.wide_status)
        assert {4, 8, 16} <= set(torch_widths), torch_widths
        assert "16 wide" in ex.wide_status and "decode steps of >= " in ex.wide_status
        assert ex.decode_router.on_width in (4, 8, 16)
        assert ex._slot_lens == [0] * 16 and all(n == 0 for n in ex.mirror.lens.values())


def test_masks_and_kept_rows_work_on_torch_decodes():
    """A grammar mask applies to a torch decode's row, and a deferred row is kept and later
    sampled (sample_kept) like llama.cpp's: the same StepResult contract on both paths."""
    from ultrafast.grammar.mask import num_words, set_bits

    batch = text_prompts(DEMO_GGUF)[:4]
    kwargs = dict(KWARGS, num_slots=4)
    with plain(DEMO_GGUF, **kwargs) as ref:
        ref.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        want = ref.execute(StepPlan([seq(i, [5], len(p)) for i, p in enumerate(batch)]))
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        mask = np.zeros((1, num_words(ex.vocab_size)), dtype=np.int32)
        set_bits(mask[0], [42])
        plan = [seq(i, [5], len(p)) for i, p in enumerate(batch)]
        plan[1].token_mask, plan[2].defer_sample = mask, True
        result = ex.execute(StepPlan(plan))
        assert ex.mirror.length(0) == len(batch[0]) + 1  # the step ran in torch
        assert result.sampled_token_ids["r1"] == [42]
        assert "r2" not in result.sampled_token_ids and "r2" in result.kept_logits
        kept = ex.sample_kept(plan[2], result.kept_logits["r2"])
        for rid, tokens in [
            ("r0", result.sampled_token_ids["r0"]),
            ("r2", kept.sampled_token_ids["r2"]),
        ]:
            assert tokens == want.sampled_token_ids[rid]


@pytest.mark.parametrize("slots", [[1, 3, 4], [0, 6]])  # a range with a gap; a wide scatter
def test_decode_rows_do_not_depend_on_where_the_slots_lie(slots, attention):
    """A step over scattered slots (attended as a masked range, or gathered) gives each row the
    logits and KV the same step gives over slots side by side."""
    import torch

    from ultrafast.executors.wide_forward import BF16, WideForward

    fw = WideForward(DEMO_GGUF, 64)
    gen = torch.Generator().manual_seed(0)
    lengths, tokens = [9, 14, 5][: len(slots)], [7, 11, 13][: len(slots)]
    prior = [
        [torch.randn(fw.kv_heads, n, fw.head_dim, generator=gen).to(BF16) for _ in fw.layers]
        for n in lengths
    ]
    rows = []
    for placement in (list(range(len(slots))), slots):
        mirror = wide_decode.new_mirror(fw, 64, 8)
        for slot, kv in zip(placement, prior):
            mirror.put_rows(slot, 0, kv, [t.flip(-1) for t in kv])
        logits = wide_decode.decode_logits(fw, mirror, tokens, placement, lengths)
        new_k = mirror.rows(placement[-1], lengths[-1], lengths[-1] + 1)[0][3]
        rows.append((logits, new_k))
    (a, ka), (b, kb) = rows
    assert torch.allclose(a, b, atol=1e-4, rtol=0), (a - b).abs().max()
    assert torch.equal(ka, kb)


def test_the_kernel_step_agrees_with_the_sdpa_step(monkeypatch):
    """The C kernel's decode step and the SDPA path's give close logits and the same KV rows
    (SDPA rounds the queries to bf16, the kernel keeps them float32)."""
    import torch

    from ultrafast.executors.wide_forward import BF16, WideForward

    fw = WideForward(DEMO_GGUF, 64)
    kernel, status = wide_decode.attention_choice.__wrapped__(fw.heads, fw.kv_heads, fw.head_dim)
    if kernel is None:
        pytest.skip(f"no C kernel here: {status}")
    gen = torch.Generator().manual_seed(1)
    lengths, slots, tokens = [9, 30, 17, 1], [0, 2, 3, 5], [7, 11, 13, 17]
    prior = [
        [torch.randn(fw.kv_heads, n, fw.head_dim, generator=gen).to(BF16) for _ in fw.layers]
        for n in lengths
    ]
    out = []
    for choice in ((kernel, status), (None, "sdpa")):
        monkeypatch.setattr(wide_decode, "attention_choice", lambda *a, c=choice: c)
        mirror = wide_decode.new_mirror(fw, 64, 8)
        for slot, kv in zip(slots, prior):
            mirror.put_rows(slot, 0, kv, [t.flip(-1) for t in kv])
        logits = wide_decode.decode_logits(fw, mirror, tokens, slots, lengths)
        out.append((logits, [mirror.rows(s, 0, n + 1)[0][0] for s, n in zip(slots, lengths)]))
    (a, ka), (b, kb) = out
    scale = b.abs().max()
    assert (a - b).abs().max() <= 0.02 * scale, ((a - b).abs().max(), scale)
    assert (a.argmax(-1) == b.argmax(-1)).all()
    assert all(torch.equal(x, y) for x, y in zip(ka, kb))  # layer 0's K: before attention


def test_long_prefills_first_tokens_come_from_torch_in_a_narrow_step(monkeypatch):
    """Long prompts in a narrow step: their first tokens come from the torch pass that
    computed their KV (no push before them); llama.cpp gets each slot's rows by one push at
    its first pass over the slot (the 2-wide decodes after), and every token equals
    llama.cpp's or diverges at a near-tie."""
    tokens = heldout_tokens(DEMO_GGUF, 400)
    batch = [tokens[:150], tokens[200:350]]
    kwargs = dict(KWARGS, num_slots=2)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want, margins = generate(ref, batch)
    moves = counting_moves(monkeypatch)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        moves.update(pull=0, push=0)
        result = ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        assert moves == {"pull": 0, "push": 0}
        assert [ex.mirror.length(i) for i in range(2)] == [150, 150]  # last tokens in torch
        got = [result.sampled_token_ids[f"r{i}"] for i in range(2)]
        for _ in range(NEW_TOKENS - 1):  # 2-wide decodes: narrow, on llama.cpp
            plan = [seq(i, got[i][-1:], len(batch[i]) + len(got[i]) - 1) for i in range(2)]
            result = ex.execute(StepPlan(plan))
            assert not result.errors, result.errors
            for i in range(2):
                got[i] += result.sampled_token_ids[f"r{i}"]
        assert moves == {"pull": 0, "push": 2}
        assert [ex._slot_lens[i] for i in range(2)] == [150 + NEW_TOKENS - 1] * 2
    assert_near_ties(want, got, margins)


def test_narrow_decodes_over_long_mirror_only_slots_stay_in_torch(monkeypatch):
    """Two decodes (under the on width) whose slots' rows live in the mirror alone, at least
    STAY_ROWS of them together, stay in torch: no push, no llama.cpp pass (pushing two slots of
    1,123 rows cost 210 ms served, and llama.cpp's narrow step was no faster at that length);
    the tokens equal llama.cpp's or diverge at a near-tie. The same slots under the threshold
    are pushed and decode on llama.cpp (the test above)."""
    from ultrafast.executors import wide_exec
    from ultrafast.executors.ggml_exec import GgmlExecutor

    monkeypatch.setattr(wide_exec, "STAY_ROWS", 300)  # two 150-token prompts reach it
    tokens = heldout_tokens(DEMO_GGUF, 400)
    batch = [tokens[:150], tokens[200:350]]
    kwargs = dict(KWARGS, num_slots=2)
    with plain(DEMO_GGUF, **kwargs) as ref:
        want, margins = generate(ref, batch)
    ggml_passes: list[int] = []
    real_execute = GgmlExecutor.execute

    def ggml_execute(self, plan):
        ggml_passes.append(len(plan.seqs))
        return real_execute(self, plan)

    monkeypatch.setattr(GgmlExecutor, "execute", ggml_execute)
    moves = counting_moves(monkeypatch)
    with wide_decoder(DEMO_GGUF, **kwargs) as ex:
        ggml_passes.clear()  # (the start's own timing ran llama.cpp passes)
        moves.update(pull=0, push=0)
        result = ex.execute(StepPlan([seq(i, p, 0) for i, p in enumerate(batch)]))
        got = [result.sampled_token_ids[f"r{i}"] for i in range(2)]
        for _ in range(NEW_TOKENS - 1):  # 2-wide decodes: narrow, yet over 300 mirror rows
            plan = [seq(i, got[i][-1:], len(batch[i]) + len(got[i]) - 1) for i in range(2)]
            result = ex.execute(StepPlan(plan))
            assert not result.errors, result.errors
            for i in range(2):
                got[i] += result.sampled_token_ids[f"r{i}"]
        assert moves["push"] == 0 and ggml_passes == []
        assert [ex.mirror.length(i) for i in range(2)] == [150 + NEW_TOKENS - 1] * 2
    assert_near_ties(want, got, margins)


def test_a_mixed_pass_pads_its_whole_row_count(monkeypatch):
    """Chunks + decodes run their GEMMs on padded_rows(chunk rows + decodes) rows, a row count
    oneDNN has a primitive for (a new count cost ~10-20 ms a step, served), and give the
    logits an unpadded pass gives, to bf16 rounding."""
    import torch

    from ultrafast.executors import wide_forward as wf

    fw = wf.WideForward(DEMO_GGUF, 256)

    def mixed_pass() -> torch.Tensor:
        mirror = wide_decode.new_mirror(fw, 256, 8)
        for slot in range(3):  # three slots hold 20 positions each, then decode
            ids = list(range(10 + slot, 30 + slot))
            chunk = [wf.SeqChunk(0, 20, 0)]
            wide_decode.step_logits(fw, mirror, (ids, list(range(20)), chunk, [slot]), None)
        seen.clear()
        head.clear()
        prefill = (list(range(40, 80)), list(range(40)), [wf.SeqChunk(0, 40, 0)], [3])
        return wide_decode.step_logits(
            fw, mirror, prefill, ([5, 6, 7], [0, 1, 2], [20, 20, 20]), logits_of=[0]
        )

    seen = spy_gemm_rows(monkeypatch, wf)  # the layers' GEMMs (WideForward.run_layers)
    head = spy_gemm_rows(monkeypatch, wide_decode)  # the lm_head's
    padded = mixed_pass()
    assert {r for r, _ in seen} == {wf.padded_rows(43)} == {48}
    assert [r for r, _ in head] == [4]  # the chunk's last row and the 3 decodes
    monkeypatch.setattr(wide_decode, "padded_rows", lambda n: n)
    exact = mixed_pass()
    assert {r for r, _ in seen} == {43}
    assert padded.shape == exact.shape == (4, fw.lm_head.packed.shape[0])
    assert torch.allclose(padded, exact, rtol=0, atol=0.02 * float(exact.abs().max()))
