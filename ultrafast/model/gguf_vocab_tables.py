"""What llama.cpp decides from a GGUF vocabulary's names and texts (src/llama-vocab.cpp), as data:
the pre-tokenizer regexes per `tokenizer.ggml.pre` family, the token texts it treats as
end-of-generation or fill-in-the-middle control tokens whatever their stored type, and its
defaults. Kept apart from the tokenizer code so the tables read as tables.
"""

from __future__ import annotations

from dataclasses import dataclass

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]  # applied in turn, each splitting every piece ("isolated")
    ignore_merges: bool = False  # a piece that is itself a token skips the merges
    add_bos: bool = False  # the default when the file has no add_bos_token key


# fmt: off
_FAMILIES = [
    (("default",),
     PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "mpt", "olmo", "jais", "trillion",
      "granite-docling", "exaone4"),
     PreTokenizer((GPT2_REGEX,))),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
      "mellum2"),
     PreTokenizer((r"\p{N}", GPT2_REGEX))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     PreTokenizer((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"),
     PreTokenizer((LLAMA3_REGEX,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan",
      "solar-open"),
     PreTokenizer((QWEN2_REGEX,))),
    (("falcon",),
     PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2_REGEX, r"[0-9][0-9][0-9]"))),
]
# fmt: on
PRE_TOKENIZERS = {name: pre for names, pre in _FAMILIES for name in names}

# GGUF token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# fmt: off
# texts llama.cpp treats as end-of-generation control tokens whatever their stored type
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
# end-of-turn candidates, in llama.cpp's order (the first found is the eot token)
EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
# fill-in-the-middle roles: the first of each list found is a control token; pad/repo/separator
# also end generation (a code model that emits them has left the file it was writing)
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# fmt: on
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
GPT2_DEFAULT_SPECIAL_ID = 11  # llama.cpp's bos/eos for a "gpt2" vocab that names neither

# the GGUF keys llama.cpp reads for default sampling values -> our parameter names
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
}
