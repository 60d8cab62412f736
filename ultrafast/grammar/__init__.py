"""Grammar-constrained decoding (llguidance): specs, tokenizer, compile cache, matchers."""

from ultrafast.grammar.spec import GrammarSpec

__all__ = ["GrammarSpec"]
