"""Tokenizer wrapper: incremental detokenizing (incl. split UTF-8), stop strings, chat templates."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ultrafast.tokenizer import StopStringMatcher, Tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["def f(x):\n    return x + 1\n", "héllo wörld ✓ 日本語"] * 50, trainer)
    d = tmp_path_factory.mktemp("tok")
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
        )
    )
    return Tokenizer.from_dir(d)


@pytest.mark.parametrize("text", ["def f(x):\n    return x + 1", "héllo wörld ✓ 日本語 🙂 ok"])
def test_incremental_detokenizer_equals_full_decode(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # never emits half a character


def test_detokenizer_with_prompt_context_keeps_spaces(tok):
    prompt = tok.encode("return")
    ids = tok.encode("return x + 1")[len(prompt) :]
    detok = tok.detokenizer(prompt)
    assert (
        "".join(detok.push([i]) for i in ids) + detok.flush()
        == tok.decode(prompt + ids)[len("return") :]
    )


def test_stop_string_split_across_deltas():
    m = StopStringMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.push("O") == ("", False)
    assert m.push("Pxyz") == ("", True)


def test_partial_match_that_fails_is_released():
    m = StopStringMatcher(["\n\n"])
    assert m.push("a\n") == ("a", False)
    assert m.push("b") == ("\nb", False)
    assert m.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher([""])


def test_chat_template_renders_sandboxed(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == (tok._tok.token_to_id("<|im_end|>"),)


def test_template_cannot_reach_python_internals(tmp_path, tok):
    evil = Tokenizer(tok._tok, {"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"})
    with pytest.raises(Exception) as info:
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    assert "unsafe" in str(info.value).lower() or "undefined" in type(info.value).__name__.lower()


def test_templates_may_test_tools_bare_as_transformers_defines_it(tok):
    """Qwen 2.5's template opens with `{%- if tools %}`: with no tools in the request it must
    render (transformers passes tools=None), not fail on an undefined name."""
    qwen_like = Tokenizer(
        tok._tok, {"chat_template": "{% if tools %}T{% endif %}{{ messages[0].content }}"}
    )
    assert qwen_like.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    assert qwen_like.apply_chat_template([{"role": "user", "content": "x"}], tools=[1]) == "Tx"


def test_warm_up_builds_the_literal_twin_before_the_first_request():
    """Start-up warms it beside the engine's warm-up (server/build.py): the first chat
    request then finds it built, and it encodes as one built on first use."""
    from ultrafast.config import DEMO_MODEL_DIR

    warm, cold = Tokenizer.from_dir(DEMO_MODEL_DIR), Tokenizer.from_dir(DEMO_MODEL_DIR)
    assert warm._literal_tok is None
    warm.warm_up()
    assert warm._literal_tok is not None
    text = "<|im_start|>user hi<|im_end|>"
    assert warm.encode_literal(text) == cold.encode_literal(text)
