"""One request's grammar state, and the model-wide runtime that makes it.

The matcher follows the request's accepted output tokens only: masks for draft positions are
computed by advancing over the drafts and rolling back, so a rejected draft never leaves a
trace, and a preempted request (which keeps its output tokens) needs nothing rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future

import llguidance
import numpy as np

from ultrafast.grammar.cache import GrammarCache, GrammarError
from ultrafast.grammar.mask import num_words, set_bits
from ultrafast.grammar.spec import GrammarSpec
from ultrafast.grammar.tokenizer import build_lltokenizer
from ultrafast.tokenizer import Tokenizer

MAX_FORCED_DRAFTS = 32  # tokens the grammar forces, proposed at once as free drafts


class GrammarMatcher:
    """llguidance's matcher with the request's own end-of-sequence ids: when the grammar
    allows EOS (it is complete), the mask allows every id the request stops on."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        grammar_eos_ids: tuple[int, ...],
        request_eos_ids: tuple[int, ...],
        first_keys: list[int],
    ):
        self._m = matcher
        self._first_keys = first_keys  # see first_byte_keys
        self.vocab_size = vocab_size
        self._grammar_eos = grammar_eos_ids
        self._grammar_eos_token = grammar_eos_ids[0]
        self._request_eos = tuple(t for t in request_eos_ids if 0 <= t < vocab_size)
        self._num_words = num_words(vocab_size)
        # (word, bit) of each grammar EOS id inside the mask
        self._grammar_eos_bits = tuple(
            (t >> 5, t & 31) for t in grammar_eos_ids if 0 <= t < 32 * self._num_words
        )
        words: dict[int, int] = {}  # the same bits as (word, bits of that word)
        for w, b in self._grammar_eos_bits:
            words[w] = words.get(w, 0) | 1 << b
        self._grammar_eos_words = tuple(words.items())
        self._row = np.zeros((1, self._num_words), dtype=np.int32)  # masks([])'s buffer
        self._row_address, self._row_bytes = self._row.ctypes.data, self._row.nbytes
        self._row_fresh = False  # _row holds the mask of the matcher's present state

    def _to_grammar(self, token: int) -> int:
        return self._grammar_eos_token if token in self._request_eos else token

    @property
    def is_error(self) -> bool:
        return self._m.is_error()

    @property
    def error(self) -> str:
        return self._m.get_error()

    @property
    def is_stopped(self) -> bool:
        """Complete: only EOS may follow."""
        return self._m.is_stopped()

    @property
    def accepted(self) -> bool:
        """The output so far (its end-of-sequence included) is a complete match."""
        return self._m.is_stopped() and not self._m.is_error()

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar accepts from here."""
        return self._m.validate_tokens([self._to_grammar(t) for t in token_ids])

    def forced_tokens(self, worth: Callable[[int], int] | None = None) -> list[int]:
        """Tokens the grammar forces next (a draft that costs nothing to propose), as many as
        `worth(n)` says n of them pay for (None: all). The mask of this position comes first
        (its step samples under it anyway): when two allowed tokens begin differently no byte
        is forced, and llguidance's probe is skipped. After a forward pass llguidance's calls
        pay for cold caches, so each costs only where its answer can be used: the forced
        bytes bound how many tokens can be forced (each holds at least one), and when even
        that many would not pay, the forced bytes are never tokenized (the costly part)."""
        m = self._m
        if m.is_stopped() or m.is_error():
            return []
        if not self._may_force(self.masks([])[0]):
            return []
        if worth is None:
            return m.compute_ff_tokens()[:MAX_FORCED_DRAFTS]
        most = min(len(m.compute_ff_bytes()), MAX_FORCED_DRAFTS)
        k = worth(most) if most else 0
        if not k:
            return []
        forced = m.compute_ff_tokens()[:MAX_FORCED_DRAFTS]
        if k > len(forced):  # the best of fewer tokens than the bound: ask again
            k = worth(len(forced)) if forced else 0
        return forced[:k]

    def _may_force(self, row: np.ndarray) -> bool:
        """False when the lowest and highest allowed ids begin with different bytes (or one
        is a special token, or EOS is allowed): then the next byte is not forced. Bytes
        operations only: a step's numpy calls cost several times their warm time once the
        forward pass has emptied the caches."""
        data = row.tobytes()  # little-endian words: byte k holds ids 8k .. 8k + 7
        body = data.lstrip(b"\0")
        if not body:
            return True  # nothing allowed: let llguidance say
        lo_byte = len(data) - len(body)
        hi_byte = len(data.rstrip(b"\0")) - 1
        lo_bits, hi_bits = data[lo_byte], data[hi_byte]
        lowest = 8 * lo_byte + (lo_bits & -lo_bits).bit_length() - 1
        highest = 8 * hi_byte + hi_bits.bit_length() - 1
        keys = self._first_keys
        if highest >= len(keys):
            return True
        return keys[lowest] == keys[highest]

    def consume(self, token_ids: list[int]) -> bool:
        """Advance over accepted tokens; False if the grammar refused one (error state)."""
        self._row_fresh = False
        for t in token_ids:
            if self._m.is_stopped():  # a stop id after completion: nothing left to match
                return True
            if not self._m.consume_token(self._to_grammar(t)):
                return False
        return True

    def masks(self, draft_ids: list[int]) -> np.ndarray:
        """int32[len(draft_ids) + 1, words]: row j allows the tokens that may follow the
        output so far plus draft_ids[:j]. The matcher ends where it started. A plain decode
        step's single row is the matcher's own buffer, rewritten by the next call: the step
        samples from it before the next step asks again; it is computed once per state (the
        forced-token check may have done it this step)."""
        m = self._m
        if not draft_ids:  # a plain decode step: one row, no advance, no rollback
            out = self._row
            if not self._row_fresh:
                if m.is_error():
                    out.fill(0)
                else:
                    m.unsafe_compute_mask_ptr(self._row_address, self._row_bytes)
                self._fix_eos(out[0])
                self._row_fresh = True
            return out
        out = np.zeros((len(draft_ids) + 1, self._num_words), dtype=np.int32)
        consumed = 0
        for j in range(len(draft_ids) + 1):
            row = out[j]
            if not m.is_error():
                m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self._fix_eos(row)
            if j == len(draft_ids) or m.is_stopped():
                break
            consumed += 1  # a refused token still counts for rollback
            if not m.consume_token(self._to_grammar(draft_ids[j])):
                break
        if consumed:
            m.rollback(consumed)
        return out

    def _fix_eos(self, row: np.ndarray) -> None:
        """The grammar's EOS bit stands for all of the request's stop ids; a row with nothing
        allowed (an error, or a stopped grammar) allows only those, so the request ends."""
        eos_set = False
        for w, bits in self._grammar_eos_words:  # row.item: a Python int, no numpy scalar
            if row.item(w) & bits:
                eos_set = True
                break
        if not eos_set and not self._m.is_error():
            return  # the common case: a matcher not in error allows something, EOS not
        words = row.view(np.uint32)
        if not eos_set and words.any():
            return
        if self._request_eos:
            for w, b in self._grammar_eos_bits:
                words[w] &= np.uint32(~(1 << b) & 0xFFFFFFFF)
            set_bits(row, self._request_eos)
        elif not eos_set:  # nothing allowed: the grammar's own EOS ends it
            set_bits(row, self._grammar_eos)


class GrammarRuntime:
    """Per model: the llguidance tokenizer and the compile cache. Thread-safe."""

    def __init__(self, lltokenizer: llguidance.LLTokenizer, vocab_size: int, **cache_caps):
        self.lltokenizer = lltokenizer
        self.vocab_size = vocab_size
        self.cache = GrammarCache(lltokenizer, **cache_caps)
        self._eos = tuple(lltokenizer.eos_tokens) or (lltokenizer.eos_token,)
        self._first_keys, self.max_token_bytes = first_byte_keys(lltokenizer, vocab_size)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int, **cache_caps) -> GrammarRuntime:
        """GrammarUnavailable if llguidance cannot use this vocabulary."""
        return cls(build_lltokenizer(tokenizer, vocab_size), vocab_size, **cache_caps)

    @property
    def compiles_running(self) -> int:
        """Compiles under way now on any thread (a server's compile pool, a caller's)."""
        return self.cache.compiles_running

    def compile(self, spec: GrammarSpec) -> None:
        """Compile (or find) `spec`; GrammarError if it does not compile. Drops the GIL:
        call it off the engine thread."""
        self.cache.compiled(spec)

    def start_compile(self, spec: GrammarSpec, pool: Executor) -> Future:
        """`compile(spec)` on `pool`, or, for a spec in the cache, its outcome at once (a done
        future: the engine then never sees the request as compiling, which would cost its
        steps a core for the thread hop)."""
        if spec in self.cache:
            done: Future = Future()
            try:
                self.compile(spec)
                done.set_result(None)
            except GrammarError as exc:
                done.set_exception(exc)
            return done
        return pool.submit(self.compile, spec)

    def matcher(self, spec: GrammarSpec, request_eos_ids: tuple[int, ...]) -> GrammarMatcher:
        return GrammarMatcher(
            self.cache.new_matcher(spec),
            self.vocab_size,
            self._eos,
            request_eos_ids,
            self._first_keys,
        )


def first_byte_keys(lltokenizer: llguidance.LLTokenizer, vocab_size: int) -> tuple[list[int], int]:
    """Each token's first byte; 256 + id for a special or empty token (it begins like no
    other token). Two allowed tokens with different keys mean the grammar does not force
    the next byte. A list: the step reads two entries, as Python ints. And the longest
    token's bytes (how much text a token budget can hold at most)."""
    keys = list(range(256, 256 + vocab_size))
    longest = 1
    for t in range(min(vocab_size, lltokenizer.vocab_size)):
        if not lltokenizer.is_special_token(t):
            data = lltokenizer.decode_bytes([t])
            if data:
                keys[t] = data[0]
                longest = max(longest, len(data))
    return keys, longest
