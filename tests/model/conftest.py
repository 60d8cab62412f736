"""Tiny random Hugging Face checkpoints (and their GGUF conversions) for the model tests.

Everything is built locally (no model hub): a byte-level BPE tokenizer trained on a few strings,
and transformers models with random weights, scaled so greedy choices are not near-ties. Session
scoped and cached per kind, so each checkpoint is built once per test run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 0, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}"
    "<|eot_id|>{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I'm fine, thanks.",
    "def add(a, b):\n    return a + b\n",
    "Low latency inference: 1, 2, 3, 42, 1000 tokens per second.",
    "Ünïcödé text, émojis 🚀 and tabs\tand  double  spaces.",
] * 4

KINDS = ("llama", "llama_tied", "llama3_rope", "qwen2", "qwen3")


def write_tiny_tokenizer(model_dir: Path, vocab_size: int = 400) -> int:
    """Train and save tokenizer.json + tokenizer_config.json; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TEXTS, trainer)
    # Llama-3 style: BOS comes from the post-processor, not from an add_bos_token flag
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS_ID)]
    )
    tok.save(str(model_dir / "tokenizer.json"))
    tok_config = {
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 256,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    return tok.get_vocab_size()


def _config(kind: str, vocab_size: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=20000.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        initializer_range=0.15,
        tie_word_embeddings=kind == "llama_tied",
    )
    if kind == "llama3_rope":  # small original context so all three frequency bands occur
        common["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    if kind.startswith("llama"):
        return LlamaConfig(**common)
    if kind == "qwen2":
        return Qwen2Config(**common)
    return Qwen3Config(head_dim=16, **common)


def build_tiny_hf_dir(model_dir: Path, kind: str = "llama", seed: int = 0) -> Path:
    """A complete HF checkpoint directory with random weights (float32 safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tiny_tokenizer(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, vocab_size), dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced one shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def tiny_tokenizer_info() -> dict:
    """What the tiny tokenizer promises (tests import nothing from conftest by name)."""
    return {
        "bos_id": BOS_ID,
        "eos_id": EOS_ID,
        "special_tokens": list(SPECIAL_TOKENS),
        "chat_template": CHAT_TEMPLATE,
    }


@pytest.fixture(scope="session")
def make_tiny_hf_dir(tmp_path_factory):
    """make_tiny_hf_dir(kind) -> Path of a cached tiny checkpoint (kind in KINDS)."""
    cache: dict[str, Path] = {}

    def make(kind: str = "llama") -> Path:
        if kind not in cache:
            cache[kind] = build_tiny_hf_dir(tmp_path_factory.mktemp(f"hf_{kind}"), kind)
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def make_tiny_gguf(make_tiny_hf_dir, tmp_path_factory):
    """make_tiny_gguf(kind, outtype) -> Path of the cached GGUF conversion."""
    from ultrafast.convert import convert_hf_to_gguf

    cache: dict[tuple[str, str], Path] = {}

    def make(kind: str = "llama", outtype: str = "f32") -> Path:
        if (kind, outtype) not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{kind}-{outtype}.gguf"
            cache[kind, outtype] = convert_hf_to_gguf(make_tiny_hf_dir(kind), out, outtype)
        return cache[kind, outtype]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(make_tiny_hf_dir) -> Path:
    return make_tiny_hf_dir("llama")


@pytest.fixture(scope="session")
def tiny_llama_gguf_f32(make_tiny_gguf) -> Path:
    return make_tiny_gguf("llama", "f32")


@pytest.fixture(scope="session")
def tiny_hf_model_factory(make_tiny_hf_dir):
    """tiny_hf_model_factory(kind) -> the transformers model (eval, float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def make(kind: str = "llama"):
        if kind not in cache:
            cache[kind] = AutoModelForCausalLM.from_pretrained(
                make_tiny_hf_dir(kind), dtype="float32", attn_implementation="eager"
            ).eval()
        return cache[kind]

    return make


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny matmuls run fastest on one thread, and a busy shared core stalls a second one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
