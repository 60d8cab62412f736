"""Output safety filter: a guard checks each choice's text while the engine keeps generating.

The engine runs on its own thread, so while the event loop checks the text so far, the next
tokens are already being computed: the guard runs in parallel with generation and costs only its
own check time per chunk plus the hold-back. Each chunk is withheld until it is cleared, and the
last `hold_back_tokens` tokens are kept back even then, so a pattern spanning up to that many
tokens is caught before its first piece is sent. When the guard fires, the choice ends with
finish_reason "content_filter", its engine request is aborted, and nothing past the last
cleared-and-released chunk is ever sent (streaming or not).

Guards: `PatternGuard` (the default policy: configurable regular expressions),
`ClassifierGuard` (the interface for a model that scores text; its `score` runs off the event
loop; `--guard-classifier module:function` loads one) and `AllGuards` (several, in order). All
implement `OutputGuard.check`.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

CONTENT_FILTER = "content_filter"


class OutputGuard:
    """Decides whether a choice's text so far may be shown. Subclasses implement `check`."""

    async def check(self, text: str, num_checked_chars: int) -> str | None:
        """text: the choice's output so far (its trailing `GuardConfig.window_chars`); the first
        `num_checked_chars` of it were cleared before. Returns None to allow, or a short reason
        (for the log) to cut the stream."""
        raise NotImplementedError


class PatternGuard(OutputGuard):
    """Blocks text matching any of a list of regular expressions (case-insensitive by default).

    Only the new text plus `max_match_chars` of already-cleared context is scanned each time,
    so a long stream costs O(length), not O(length^2); a match longer than `max_match_chars`
    is not guaranteed to be seen.
    """

    def __init__(self, patterns: list[str], ignore_case: bool = True, max_match_chars: int = 256):
        if not patterns:
            raise ValueError("a pattern guard needs at least one pattern")
        flags = re.IGNORECASE if ignore_case else 0
        try:
            self.patterns = [re.compile(p, flags) for p in patterns]
        except re.error as exc:
            raise ValueError(f"bad guard pattern: {exc}") from None
        self.max_match_chars = max_match_chars

    def check_sync(self, text: str, num_checked_chars: int) -> str | None:
        start = max(0, num_checked_chars - self.max_match_chars)
        window = text[start:]
        for pattern in self.patterns:
            if pattern.search(window):
                return f"pattern {pattern.pattern!r}"
        return None

    async def check(self, text: str, num_checked_chars: int) -> str | None:
        return self.check_sync(text, num_checked_chars)  # microseconds: no thread hop

    @classmethod
    def from_file(cls, path: str | Path, extra: Sequence[str] = ()) -> PatternGuard:
        """JSON: {"patterns": [...], "ignore_case": true, "max_match_chars": 256}; `extra`
        patterns (from flags) are added."""
        try:
            spec = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("patterns"), list):
            raise ValueError(f"{path}: expected an object with a `patterns` list")
        return cls(
            [str(p) for p in spec["patterns"]] + list(extra),
            bool(spec.get("ignore_case", True)),
            int(spec.get("max_match_chars", 256)),
        )


class ClassifierGuard(OutputGuard):
    """A model that scores text (0 = fine, 1 = unsafe); scores >= threshold cut the stream.

    `score` is any callable str -> float (a small classifier, a moderation model client). It
    runs on `executor` (a thread pool), never on the event loop; at most `max_context_chars`
    of trailing text are sent to it.
    """

    def __init__(
        self,
        score: Callable[[str], float],
        threshold: float = 0.5,
        executor: Executor | None = None,
        max_context_chars: int = 2048,
    ):
        self.score = score
        self.threshold = threshold
        self.executor = executor
        self.max_context_chars = max_context_chars

    async def check(self, text: str, num_checked_chars: int) -> str | None:
        context = text[-self.max_context_chars :]
        value = await asyncio.get_running_loop().run_in_executor(self.executor, self.score, context)
        return f"classifier score {value:.2f}" if value >= self.threshold else None


class AllGuards(OutputGuard):
    """Runs guards in order (cheap patterns first); the first that fires decides."""

    def __init__(self, guards: list[OutputGuard]):
        self.guards = guards

    async def check(self, text: str, num_checked_chars: int) -> str | None:
        for guard in self.guards:
            reason = await guard.check(text, num_checked_chars)
            if reason is not None:
                return reason
        return None


def load_score_function(spec: str) -> Callable[[str], float]:
    """`package.module:function` (operator configuration, never request input)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--guard-classifier wants module:function, got {spec!r}")
    try:
        score = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load guard classifier {spec!r}: {exc}") from None
    if not callable(score):
        raise ValueError(f"guard classifier {spec!r} is not callable")
    return score


@dataclass(frozen=True)
class GuardConfig:
    guard: OutputGuard
    hold_back_tokens: int = 4  # tokens kept back after clearing; >= the longest pattern's tokens
    window_chars: int = 4096  # trailing text a check sees (>= pattern span, classifier context)

    def __post_init__(self) -> None:
        if self.hold_back_tokens < 0:
            raise ValueError("hold_back_tokens must be >= 0")


class GuardedChoice:
    """One choice's text on its way out: withheld until cleared, then released minus hold-back."""

    def __init__(self, config: GuardConfig):
        self.config = config
        self.text = ""  # the trailing window of what was generated (stop strings applied)
        self.num_checked_chars = 0
        self.held: collections.deque = collections.deque()  # [text, logprobs, num_tokens]
        self.num_held_tokens = 0
        self.blocked_reason: str | None = None

    async def push(
        self, text: str, logprobs: list, num_tokens: int, finished: bool
    ) -> tuple[str, list, int, bool]:
        """Returns the (text, logprobs, number of tokens) now cleared for release, and whether
        the guard fired (then nothing more is ever released)."""
        if self.blocked_reason is not None:
            return "", [], 0, True
        if text or logprobs or num_tokens:
            self.held.append((text, list(logprobs), num_tokens))
            self.num_held_tokens += num_tokens
            self.text += text
            cut = len(self.text) - self.config.window_chars
            if cut > 0:  # bounded: a long stream costs O(window) per chunk, not O(length)
                self.text = self.text[cut:]
                self.num_checked_chars = max(0, self.num_checked_chars - cut)
        if len(self.text) > self.num_checked_chars or finished:
            reason = await self.config.guard.check(self.text, self.num_checked_chars)
            if reason is not None:
                self.blocked_reason = reason
                self.held.clear()
                return "", [], 0, True
            self.num_checked_chars = len(self.text)
        keep = 0 if finished else self.config.hold_back_tokens
        out_text, out_logprobs, num_out = [], [], 0
        while self.held and self.num_held_tokens - self.held[0][2] >= keep:
            piece, piece_logprobs, n = self.held.popleft()
            self.num_held_tokens -= n
            out_text.append(piece)
            out_logprobs.extend(piece_logprobs)
            num_out += n
        return "".join(out_text), out_logprobs, num_out, False
