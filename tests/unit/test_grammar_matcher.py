"""Matcher, compile cache and masks on the demo model's vocabulary (no model weights)."""

import numpy as np
import pytest
import torch

from ultrafast.config import DEMO_MODEL_DIR
from ultrafast.core.types import ScheduledSeq
from ultrafast.engine.speculation import best_draft_length
from ultrafast.grammar import GrammarSpec
from ultrafast.grammar.cache import GrammarError
from ultrafast.grammar.mask import allowed_ids
from ultrafast.grammar.matcher import GrammarRuntime
from ultrafast.request import SamplingParams
from ultrafast.sampling.sampler import sample_plan
from ultrafast.tokenizer import Tokenizer

COLOR = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def runtime(tok):
    return GrammarRuntime.for_tokenizer(tok, tok.vocab_size)


def decoded(tok, ids):
    return [tok.decode([i], skip_special_tokens=False) for i in ids]


def test_spec_key_is_stable_and_property_order_is_kept():
    a = GrammarSpec.from_json_schema({"properties": {"b": {}, "a": {}}})
    b = GrammarSpec.from_json_schema({"properties": {"b": {}, "a": {}}})
    c = GrammarSpec.from_json_schema({"properties": {"a": {}, "b": {}}})
    assert a.key == b.key != c.key and a.lark.index('"b"') < a.lark.index('"a"')
    assert GrammarSpec.json_object().source == "json_object" and a.source == "json_schema"


def test_masks_follow_drafts_and_leave_the_matcher_where_it_was(runtime, tok):
    m = runtime.matcher(GrammarSpec.from_json_schema(COLOR), tok.eos_token_ids)
    text = '{"color":"red"}'
    ids = tok.encode(text, add_special_tokens=False)
    assert m.valid_prefix(ids + list(tok.eos_token_ids[:1]) + ids) == len(ids) + 1
    masks = m.masks(ids)
    assert masks.shape[0] == len(ids) + 1
    for j, t in enumerate(ids):  # each draft token is allowed at its own row
        assert t in allowed_ids(masks[j], tok.vocab_size)
    # the last row: the object is complete, only the request's EOS ids remain
    assert allowed_ids(masks[-1], tok.vocab_size) == sorted(tok.eos_token_ids)
    # nothing was consumed: row 0 again, and a wrong token is not allowed there
    again = m.masks([])
    assert (again[0] == masks[0]).all()
    assert tok.encode("x", add_special_tokens=False)[0] not in allowed_ids(again[0], tok.vocab_size)
    assert m.consume(ids) and m.is_stopped


def test_a_single_row_ends_the_request_on_its_own_stop_ids(runtime, tok):
    """The plain decode row (the matcher's reused buffer, with the EOS test on one bit): a
    complete grammar allows the request's stop ids only, even ones the grammar does not know;
    a matcher in error allows only them too, so the request ends instead of sampling garbage."""
    spec = GrammarSpec.from_json_schema(COLOR)
    ids = tok.encode('{"color":"red"}', add_special_tokens=False)
    m = runtime.matcher(spec, (7, 11))
    first = m.masks([]).copy()
    assert ids[0] in allowed_ids(first[0], tok.vocab_size)
    assert not set(allowed_ids(first[0], tok.vocab_size)) & {7, 11}
    assert m.consume(ids) and m.is_stopped
    assert allowed_ids(m.masks([])[0], tok.vocab_size) == [7, 11]
    bad = runtime.matcher(spec, (7,))
    assert not bad.consume(tok.encode("x", add_special_tokens=False)) and bad.is_error
    assert allowed_ids(bad.masks([])[0], tok.vocab_size) == [7]


def test_forced_tokens_are_what_the_grammar_leaves_no_choice_about(runtime, tok):
    m = runtime.matcher(GrammarSpec.from_json_schema(COLOR), tok.eos_token_ids)
    m.consume(tok.encode("{", add_special_tokens=False))
    forced = tok.decode(m.forced_tokens())
    assert forced and '"color":"'.startswith(forced)


@pytest.mark.parametrize(
    "schema",
    [
        COLOR,
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}},
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "ok"],
        },
        {"type": "object"},
    ],
)
def test_the_forced_token_check_skips_the_probe_only_where_nothing_is_forced(runtime, tok, schema):
    """Random walks through the grammar: wherever forced_tokens() skips llguidance's probe
    (two allowed tokens begin differently), the probe would have found nothing; and the
    mask it computed on the way is the one the step then samples under."""
    spec = GrammarSpec.from_json_schema(schema)
    rng = np.random.default_rng(len(str(schema)))
    skipped = probed = 0
    for _ in range(6):
        m = runtime.matcher(spec, tok.eos_token_ids)
        walked: list[int] = []
        for _ in range(60):
            if m.is_stopped or m.is_error:
                break
            forced = m.forced_tokens()
            row = m.masks([])[0].copy()
            fresh = runtime.matcher(spec, tok.eos_token_ids)  # same state, no shortcuts
            fresh.consume(walked)
            assert np.array_equal(fresh.masks([])[0], row)
            if m._may_force(row):
                probed += 1
                assert forced == m._m.compute_ff_tokens()[:32]
            else:
                skipped += 1
                assert forced == [] and m._m.compute_ff_tokens() == []
            allowed = [t for t in allowed_ids(row, tok.vocab_size) if t not in tok.eos_token_ids]
            if not allowed:
                break
            t = int(rng.choice(forced[:1] or allowed))
            walked.append(t)
            assert m.consume([t])
    assert probed and (skipped or schema is COLOR)  # COLOR's two words begin alike: g, gr


class _CountingMatcher:
    """llguidance's matcher, counting the forced-token probes (the tokenizing call)."""

    def __init__(self, inner):
        self.inner, self.probes = inner, 0

    def compute_ff_tokens(self):
        self.probes += 1
        return self.inner.compute_ff_tokens()

    def __getattr__(self, name):
        return getattr(self.inner, name)


# what riding n forced tokens is worth under three step-cost profiles (the engine's own rule):
# a 2-token pass at 2.4x a 1-token one with wide passes cheap per token (the demo model on
# this CPU), at 1.6x (SmolLM2), and passes that grow by a full step per token (never worth it)
_WORTH = {
    "wide passes pay": lambda n: best_draft_length(1.0, n, 0.6, 0.05, 0.0, (None, 1.0, 2.4)),
    "one pays": lambda n: best_draft_length(1.0, n, 0.6, 0.4, 0.0, (None, 1.0, 1.6)),
    "none pays": lambda n: best_draft_length(1.0, n, 0.0, 1.0),
}


@pytest.mark.parametrize("profile", sorted(_WORTH))
@pytest.mark.parametrize("schema", [COLOR, {"type": "array", "items": {"enum": ["abc", "b"]}}])
def test_forced_tokens_ride_as_the_costs_say_and_are_tokenized_only_when_they_can(
    runtime, tok, profile, schema
):
    """forced_tokens(worth) keeps the tokens worth(len(forced)) says pay, as a probe of every
    forced token would; and when the forced bytes bound the run below what pays, llguidance
    never tokenizes them."""
    worth = _WORTH[profile]
    spec = GrammarSpec.from_json_schema(schema)
    rng = np.random.default_rng(7)
    skipped = 0
    for _ in range(6):
        m = runtime.matcher(spec, tok.eos_token_ids)
        counting = m._m = _CountingMatcher(m._m)
        for _ in range(40):
            if m.is_stopped or m.is_error:
                break
            before = counting.probes
            forced = m.forced_tokens(worth)
            probed = counting.probes > before
            every = counting.inner.compute_ff_tokens()[:32]
            assert forced == every[: worth(len(every))]
            if every and not probed:
                skipped += 1
                assert worth(len(every)) == 0
            row = m.masks([])[0]
            allowed = [t for t in allowed_ids(row, tok.vocab_size) if t not in tok.eos_token_ids]
            if not allowed:
                break
            assert m.consume([int(rng.choice(every[:1] or allowed))])
    # a profile where nothing pays tokenizes nothing forced
    assert skipped or profile != "none pays"


def test_the_cache_is_bounded_in_entries_and_bytes(tok):
    rt = GrammarRuntime.for_tokenizer(tok, tok.vocab_size, max_entries=3, max_bytes=10_000)
    specs = [
        GrammarSpec.from_json_schema(
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        )
        for i in range(6)
    ]
    for spec in specs:
        rt.compile(spec)
    assert len(rt.cache) == 3 and rt.cache.num_compiles == 6
    rt.compile(specs[-1])
    assert rt.cache.num_compiles == 6 and rt.cache.num_hits == 1
    big = GrammarSpec.from_json_schema({"enum": ["x" * 3000, "y" * 3000]})
    rt.compile(big)
    rt.compile(GrammarSpec.from_json_schema({"enum": ["z" * 3000, "w" * 3000]}))
    assert rt.cache.num_bytes <= 10_000


def test_a_compile_error_is_a_grammar_error_and_is_cached(runtime):
    bad = GrammarSpec.from_json_schema({"type": "string", "format": "no-such-format"})
    for _ in range(2):
        with pytest.raises(GrammarError, match="format"):
            runtime.compile(bad)
    assert runtime.cache.num_hits >= 1


def seq(mask, num_logits=1, params=None, tokens=(1,), **kw):
    return ScheduledSeq(
        "r",
        0,
        list(tokens),
        0,
        num_logits,
        params or SamplingParams(temperature=0.0),
        1,
        0,
        token_mask=mask,
        **kw,
    )


def only(vocab, *ids):
    mask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
    for t in ids:
        mask.view(np.uint32)[0, t >> 5] |= np.uint32(1 << (t & 31))
    return mask


@pytest.mark.parametrize("as_numpy", [True, False])
def test_the_sampler_masks_greedy_sampled_and_logprobs(as_numpy):
    vocab = 100
    logits = np.linspace(0, 1, vocab, dtype=np.float32)[None, :].copy()  # 99 is the best
    rows = logits if as_numpy else torch.from_numpy(logits.copy())
    assert sample_plan([seq(only(vocab, 3, 70))], rows).sampled_token_ids["r"] == [70]
    sampled = SamplingParams(temperature=1.5, seed=5, logprobs=True, top_logprobs=5)
    for _ in range(5):
        rows = logits.copy() if as_numpy else torch.from_numpy(logits.copy())
        result = sample_plan([seq(only(vocab, 3, 70), params=sampled)], rows)
        assert result.sampled_token_ids["r"][0] in (3, 70)
        lp = result.logprobs["r"][0]
        # logprobs after masking: two tokens share all the probability, nothing else listed
        assert {t for t, _ in lp.top} == {3, 70}
        assert np.isclose(sum(np.exp(v) for _, v in lp.top), 1.0)


def test_verify_uses_one_mask_row_per_draft_position():
    vocab = 64
    logits = np.zeros((3, vocab), dtype=np.float32)
    logits[:, 9] = 5.0  # unmasked, 9 would win every position
    mask = np.concatenate([only(vocab, 4), only(vocab, 7), only(vocab, 1)])
    s = seq(mask, num_logits=3, tokens=(2, 4, 7))
    assert sample_plan([s], logits).sampled_token_ids["r"] == [4, 7, 1]
    free = seq(None, num_logits=1, tokens=(2,))
    free.request_id = "free"
    both = np.zeros((2, vocab), dtype=np.float32)
    both[:, 9] = 5.0
    out = sample_plan([seq(only(vocab, 4)), free], both).sampled_token_ids
    assert out == {"r": [4], "free": [9]}  # constrained and free rows in one step
