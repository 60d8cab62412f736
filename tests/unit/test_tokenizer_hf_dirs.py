"""HF directories as transformers writes them today: chat_template.jinja, generation_config.json
(EOS id lists, default sampling values), added and special tokens; and chat templates that are
missing, broken, raising or hostile, each a typed error the server answers with a 400.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ultrafast.model.config import ModelLoadError
from ultrafast.tokenizer import ChatTemplateError, NoChatTemplateError, Tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        show_progress=False,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["hello world, user and assistant\n"] * 20, trainer)
    hf.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    hf.save(str(path))
    return path


def make_dir(tmp_path, tokenizer_json, config=None, generation=None, jinja=None):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return Tokenizer.from_dir(tmp_path)


def test_chat_template_jinja_is_read_and_wins(tmp_path, tokenizer_json):
    tok = make_dir(tmp_path, tokenizer_json, {"eos_token": "<|im_end|>"}, jinja=CHATML)
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(USER) == expected
    both = make_dir(
        tmp_path,
        tokenizer_json,
        {"chat_template": "old {{ messages[0].content }}"},
        jinja="new {{ messages[0].content }}",
    )
    assert both.apply_chat_template(USER) == "new hi"


def test_tokenizer_config_template_still_works_and_named_templates(tmp_path, tokenizer_json):
    tok = make_dir(tmp_path, tokenizer_json, {"chat_template": CHATML})
    assert tok.apply_chat_template(USER).startswith("<|im_start|>user")
    named = make_dir(
        tmp_path,
        tokenizer_json,
        {
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "plain {{ messages[0].role }}"},
            ]
        },
    )
    assert named.apply_chat_template(USER) == "plain user"


def test_generation_config_eos_list_and_sampling_defaults(tmp_path, tokenizer_json):
    tok = make_dir(
        tmp_path,
        tokenizer_json,
        {"eos_token": "<|endoftext|>"},
        {
            "eos_token_id": [2, 3],
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 20,
            "do_sample": True,
            "max_length": 99,
        },
    )
    assert tok.eos_token_ids == (0, 2, 3)  # every id ends generation
    assert tok.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    single = make_dir(tmp_path, tokenizer_json, {}, {"eos_token_id": 2, "top_k": "x"})
    assert single.eos_token_ids == (2,) and single.generation_defaults == {}


@pytest.mark.parametrize("generation", ["{not json", '{"eos_token_id": "two"}', "[1, 2]"])
def test_a_broken_generation_config_is_a_load_error(tmp_path, tokenizer_json, generation):
    with pytest.raises(ModelLoadError, match="generation_config.json"):
        make_dir(tmp_path, tokenizer_json, {}, generation)


def test_added_and_special_tokens(tmp_path, tokenizer_json):
    tok = make_dir(tmp_path, tokenizer_json, {"eos_token": "<|im_end|>", "chat_template": CHATML})
    ids = tok.encode("<|im_start|>hello<think>world<|eot|>", add_special_tokens=False)
    im_start, think, eot = (tok._tok.token_to_id(t) for t in ("<|im_start|>", "<think>", "<|eot|>"))
    assert ids[0] == im_start and think in ids and ids[-1] == eot
    assert tok.decode(ids) == "hello<think>world"  # special dropped, user-defined kept
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hello<think>world<|eot|>"


def test_no_template_is_a_typed_error_and_completions_still_work(tmp_path, tokenizer_json):
    tok = make_dir(tmp_path, tokenizer_json, {})
    with pytest.raises(NoChatTemplateError, match="no chat template") as info:
        tok.apply_chat_template(USER)
    assert isinstance(info.value, ChatTemplateError) and isinstance(info.value, ValueError)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_a_template_that_raises_is_a_chat_template_error(tmp_path, tokenizer_json):
    template = (
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('first message must "
        "be system') }}{% endif %}{{ messages[0]['content'] }}{{ 1 / 0 if messages|length"
        " > 1 }}"
    )
    tok = make_dir(tmp_path, tokenizer_json, {"chat_template": template})
    with pytest.raises(ChatTemplateError, match="first message must be system"):
        tok.apply_chat_template(USER)
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        tok.apply_chat_template([{"role": "system", "content": "s"}, *USER])
    assert tok.apply_chat_template([{"role": "system", "content": "s"}]) == "s"
    missing = make_dir(tmp_path, tokenizer_json, {"chat_template": "{{ messages[0].nope }}"})
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        missing.apply_chat_template(USER)


@pytest.mark.parametrize(
    "attack",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set x = messages.append({'role': 'x'}) %}",
    ],
)
def test_sandbox_escapes_are_refused_per_request(tmp_path, tokenizer_json, attack):
    tok = make_dir(tmp_path, tokenizer_json, {"chat_template": attack})
    with pytest.raises(ChatTemplateError) as info:
        tok.apply_chat_template(USER)
    assert "unsafe" in str(info.value) or "UndefinedError" in str(info.value)


def test_a_template_that_does_not_compile_refuses_chat_only(tmp_path, tokenizer_json, caplog):
    tok = make_dir(tmp_path, tokenizer_json, {"chat_template": "{% for m in messages %}"})
    assert "does not compile" in caplog.text
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template(USER)
    assert tok.encode("hello") and tok.eos_token_ids == ()


def test_templates_get_what_hf_templates_expect(tmp_path, tokenizer_json):
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}"
    )
    tok = make_dir(tmp_path, tokenizer_json, {"chat_template": template})
    text = tok.apply_chat_template([{"role": "user", "content": "héllo <b>"}, *USER])
    assert text == '{"role": "user", "content": "héllo <b>"}4'


def test_older_layouts_special_tokens_map_and_config_eos(tmp_path, tokenizer_json):
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>"})
    )
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = make_dir(tmp_path, tokenizer_json, {"add_bos_token": True})
    assert tok.bos_token_id == 1 and tok.encode("hello")[0] == 1
    assert tok.eos_token_ids == (2, 3)
    with_generation = make_dir(tmp_path, tokenizer_json, {}, {"eos_token_id": 0})
    assert with_generation.eos_token_ids == (0, 2)  # generation_config.json wins over config
