"""`--chat-template`: the built-in templates render each family's turn format, a name or a Jinja
file resolves (anything else is refused naming the built-ins), and a tokenizer without a
template refuses chat naming the flag until one is given (chat_templates.py, tokenizer.py)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from ultrafast.chat_templates import BUILTIN, resolve_chat_template
from ultrafast.tokenizer import NoChatTemplateError, Tokenizer

TALK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Capital of France?"},
]

EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nCapital of France?<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "<s>[INST] Be brief.\n\nHi [/INST] Hello.</s>[INST] Capital of France? [/INST]",
    "phi": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
    "<|user|>\nCapital of France?<|end|>\n<|assistant|>\n",
}


def bare_tokenizer(*special: str) -> Tokenizer:
    """A word-level vocabulary with no chat template, and `special` as special tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}
    hf = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    hf.add_special_tokens([AddedToken(t, special=True) for t in special])
    return Tokenizer(hf, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_builtin_renders_its_family_format(name):
    tok = bare_tokenizer()
    template = BUILTIN[name]
    tok.use_chat_template(template.text, template.end_of_turn)
    assert tok.apply_chat_template(TALK) == EXPECTED[name]


def test_the_builtins_are_the_ones_the_flag_promises():
    assert {"chatml", "llama3", "gemma", "mistral", "phi"} <= set(BUILTIN)


def test_no_template_is_refused_naming_the_flag_until_one_is_given():
    tok = bare_tokenizer("<end_of_turn>")
    with pytest.raises(NoChatTemplateError, match="--chat-template") as refused:
        tok.apply_chat_template(TALK)
    assert "gemma" in str(refused.value)  # the built-ins are listed
    eot = tok._tok.token_to_id("<end_of_turn>")
    assert eot not in tok.eos_token_ids
    tok.use_chat_template(BUILTIN["gemma"].text, BUILTIN["gemma"].end_of_turn)
    assert tok.apply_chat_template(TALK).endswith("<start_of_turn>model\n")
    # the format's end of turn now ends a generation too; EOS still does
    assert eot in tok.eos_token_ids and 2 in tok.eos_token_ids


def test_an_end_token_the_vocabulary_lacks_is_ignored():
    tok = bare_tokenizer()
    tok.use_chat_template(BUILTIN["chatml"].text, BUILTIN["chatml"].end_of_turn)
    assert tok.eos_token_ids == (2,)


def test_a_jinja_file_resolves_and_bad_values_are_refused(tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    template = resolve_chat_template(str(path))
    tok = bare_tokenizer()
    tok.use_chat_template(template.text, template.end_of_turn)
    assert tok.apply_chat_template(TALK[1:2]) == "[user]Hi"
    with pytest.raises(ValueError, match="chatml, llama3, gemma, mistral, phi"):
        resolve_chat_template("no-such-template")
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        resolve_chat_template(str(tmp_path / "empty.jinja"))


def test_a_template_that_does_not_compile_refuses_chat_not_the_start(tmp_path):
    tok = bare_tokenizer()
    tok.use_chat_template("{% for m in messages %}")  # unclosed
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template(TALK)
