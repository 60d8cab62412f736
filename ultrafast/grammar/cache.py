"""Compiled grammars, bounded in entries and bytes, keyed by GrammarSpec.key.

A compiled grammar is an llguidance matcher in its start state; each request gets a deep copy
(cheap next to a compile). Compiling drops the GIL, so the server compiles on a worker thread
and the engine thread only copies. Compile failures are cached too, so a bad schema sent in a
loop costs one compile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import numpy as np

from ultrafast.grammar.spec import GrammarSpec


class GrammarError(ValueError):
    """The grammar does not compile (bad schema, unsupported feature, a resource limit)."""


def parser_limits() -> llguidance.LLParserLimits:
    """Caps on what one grammar may cost llguidance; past them it fails with an error instead
    of running long. Lower than llguidance's defaults: client schemas arrive per request."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=500_000,  # regex work while compiling
        step_lexer_fuel=200_000,  # regex work per token mask
        step_max_items=50_000,  # parser work per token mask
        max_lexer_states=50_000,
        max_grammar_size=200_000,
    )


class GrammarCache:
    """LRU of compiled grammars. `max_bytes` bounds the summed grammar text (the compiled
    form grows with it); `max_entries` bounds the count. Safe from any thread."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        max_entries: int = 256,
        max_bytes: int = 32 * 1024 * 1024,
    ):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[llguidance.LLMatcher | None, str, int]] = (
            OrderedDict()
        )
        self._bytes = 0
        self._lock = threading.Lock()
        self.num_compiles = 0
        self._running = 0  # compiles under way now, on any thread
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    @property
    def compiles_running(self) -> int:
        """Compiles under way on any thread (each holds a core until it ends)."""
        return self._running

    def compiled(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The start-state matcher of `spec` (shared: deep-copy it before use).
        GrammarError if it does not compile."""
        key = spec.key
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                self.num_hits += 1
        if hit is None:  # compile outside the lock: another spec may compile meanwhile
            with self._lock:
                self._running += 1
            try:
                hit = self._compile(spec)
            finally:
                with self._lock:
                    self._running -= 1
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = hit
                    self._bytes += hit[2]
                    self._evict()
        matcher, error, _ = hit
        if matcher is None:
            raise GrammarError(error)
        return matcher

    def __contains__(self, spec: GrammarSpec) -> bool:
        """Compiled (or failed) already: compiled() answers without compiling."""
        with self._lock:
            return spec.key in self._entries

    def new_matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher of its own for one request."""
        return self.compiled(spec).deep_copy()

    def _compile(self, spec: GrammarSpec) -> tuple[llguidance.LLMatcher | None, str, int]:
        self.num_compiles += 1
        matcher = llguidance.LLMatcher(
            self.tokenizer, spec.lark, log_level=0, limits=parser_limits()
        )
        size = len(spec.lark.encode()) + 256  # the entry's own overhead
        if matcher.is_error():
            return None, _short_error(matcher.get_error()), size
        # the first mask builds lexer states that every deep copy then shares: built here,
        # on the compile thread, they stay off the engine thread's first step
        scratch = np.zeros((self.tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():  # the grammar admits nothing: llguidance's error says why
            return None, _short_error(matcher.get_error()), size
        return matcher, "", size

    def _evict(self) -> None:
        while self._entries and (
            len(self._entries) > self.max_entries or self._bytes > self.max_bytes
        ):
            _, (_, _, size) = self._entries.popitem(last=False)
            self._bytes -= size


def _short_error(message: str) -> str:
    """llguidance's first line (the rest echoes the grammar text back)."""
    first = message.strip().splitlines()[0] if message.strip() else "the grammar does not compile"
    return first[:300]
