"""The output guard on its own: hold-back, a pattern split over chunks, nothing released past the
cut, the classifier interface, and that a guard that never fires releases exactly the input."""

import asyncio
import json

import pytest

from ultrafast.server.guard import ClassifierGuard, GuardConfig, GuardedChoice, PatternGuard


def run(choice: GuardedChoice, pieces: list[str], tokens_per_piece: int = 1):
    """Feeds pieces (the last one finishes); returns (released pieces, blocked)."""

    async def go():
        out = []
        for i, piece in enumerate(pieces):
            text, _, _, blocked = await choice.push(
                piece, [], tokens_per_piece, i == len(pieces) - 1
            )
            if blocked:
                return out, True
            out.append(text)
        return out, False

    return asyncio.run(go())


def test_hold_back_withholds_the_last_n_tokens_until_the_end():
    choice = GuardedChoice(GuardConfig(PatternGuard(["never-matches"]), hold_back_tokens=2))
    out, blocked = run(choice, ["a", "b", "c", "d", "e"])
    assert not blocked
    assert out == ["", "", "a", "b", "cde"]


def test_a_pattern_split_across_chunks_is_caught_before_any_of_it_is_sent():
    choice = GuardedChoice(GuardConfig(PatternGuard([r"rm -rf /"]), hold_back_tokens=4))
    pieces = ["print(", "'hi')\n", "os.system('", "rm", " -r", "f /", "')", "\nmore"]
    out, blocked = run(choice, pieces)
    assert blocked
    sent = "".join(out)
    assert "rm" not in sent and sent == "print("  # only what was 4 tokens clear of the hit
    assert choice.blocked_reason.startswith("pattern")
    # after the cut nothing more comes out, whatever arrives
    assert asyncio.run(choice.push("safe", [], 1, True)) == ("", [], 0, True)


def test_hold_back_zero_sends_cleared_text_at_once():
    choice = GuardedChoice(GuardConfig(PatternGuard(["secret"]), hold_back_tokens=0))
    out, blocked = run(choice, ["a ", "sec", "ret", "b"])
    assert blocked and out == ["a ", "sec"]  # with no hold-back a split match leaks its head


def test_a_guard_that_never_fires_releases_the_input_unchanged():
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    choice = GuardedChoice(GuardConfig(PatternGuard(["password"]), hold_back_tokens=3))
    out, blocked = run(choice, pieces)
    assert not blocked and "".join(out) == text


def test_logprobs_and_token_counts_travel_with_their_text():
    choice = GuardedChoice(GuardConfig(PatternGuard(["zzz"]), hold_back_tokens=1))

    async def go():
        first = await choice.push("a", ["lp-a"], 1, False)
        second = await choice.push("b", ["lp-b"], 1, False)
        last = await choice.push("", [], 0, True)
        return first, second, last

    first, second, last = asyncio.run(go())
    assert first == ("", [], 0, False)
    assert second == ("a", ["lp-a"], 1, False)
    assert last == ("b", ["lp-b"], 1, False)


def test_pattern_scan_window_keeps_context_across_chunks():
    guard = PatternGuard(["abc"], max_match_chars=8)
    assert guard.check_sync("xxxxab" + "c", 6) is not None  # "ab" was cleared before
    assert guard.check_sync("abcxxxxxxxxxxxxx" + "y", 16) is None  # old match out of window


def test_classifier_guard_runs_off_the_loop_and_cuts_over_threshold():
    seen = []

    def score(text: str) -> float:
        seen.append(text)
        return 0.9 if "attack" in text else 0.1

    choice = GuardedChoice(GuardConfig(ClassifierGuard(score, threshold=0.5), hold_back_tokens=1))
    out, blocked = run(choice, ["plan ", "the ", "att", "ack", " now"])
    assert blocked and "".join(out) == "plan the "  # "att" was held back
    assert seen[-1].endswith("attack")


def test_pattern_file(tmp_path):
    path = tmp_path / "patterns.json"
    path.write_text(json.dumps({"patterns": ["AKIA[0-9A-Z]{16}"], "ignore_case": False}))
    guard = PatternGuard.from_file(path, extra=["secret"])
    assert len(guard.patterns) == 2
    assert guard.check_sync("key AKIAABCDEFGHIJKLMNOP", 0) and not guard.check_sync("akia", 0)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        PatternGuard.from_file(path)
    with pytest.raises(ValueError):
        PatternGuard(["(unclosed"])


def toy_score(text: str) -> float:
    """A stand-in classifier for the --guard-classifier loading test."""
    return 1.0 if "forbidden" in text else 0.0


def test_serve_builds_patterns_then_classifier():
    from ultrafast.config import ServerConfig
    from ultrafast.server.build import build_guard

    assert build_guard(ServerConfig()) is None
    config = ServerConfig(
        guard_patterns=("secret",),
        guard_hold_back_tokens=2,
        guard_classifier="tests.unit.test_guard:toy_score",
    )
    guard = build_guard(config)
    assert guard.hold_back_tokens == 2
    assert asyncio.run(guard.guard.check("a secret", 0)).startswith("pattern")
    assert asyncio.run(guard.guard.check("forbidden", 0)).startswith("classifier")
    assert asyncio.run(guard.guard.check("fine", 0)) is None
    for bad in ("nomodule", "tests.unit.test_guard:missing", "no.such.module:f"):
        with pytest.raises(ValueError):
            build_guard(ServerConfig(guard_classifier=bad))


def test_the_checked_text_is_a_bounded_trailing_window():
    choice = GuardedChoice(
        GuardConfig(PatternGuard(["needle"]), hold_back_tokens=2, window_chars=64)
    )
    pieces = ["x" * 10] * 50 + ["nee", "dle", "yy"]
    out, blocked = run(choice, pieces)
    assert blocked and len(choice.text) <= 64
    assert "".join(out) == "x" * 490  # up to 2 tokens before the match: nothing of it
