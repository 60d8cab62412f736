"""Regexes for JSON numbers that end: integers spelled with only the digits their range
allows (int64 when the schema gives no bound), numbers with at most 17 significant digits
(a double's precision) and a bounded exponent.

llguidance's own JSON number lexeme lets a model write an 80-digit integer or a latitude with
hundreds of decimals until max_tokens; these are what json_lark.py puts in its terminals.
Every regex here matches only numbers inside the range (a subset where a bound is fractional:
see `number_range`), in JSON's spelling, and is written in the Rust `regex` syntax llguidance
uses (no lookarounds).
"""

from __future__ import annotations

import math

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SIG_DIGITS = 17  # a double round-trips through 17 significant digits
MAX_FRACTION_ZEROS = 20  # zeros after "0." before the first significant digit
_EXPONENT = r"(?:[eE][+-]?(?:[0-9]{1,2}|[12][0-9]{2}|30[0-8]))?"  # |e| <= 308


def _alt(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def _digit_range(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives matching the decimal strings of one length from a to b (a <= b)."""
    n = len(a)
    if a == b:
        return [a]
    if a == "0" * n and b == "9" * n:
        return [f"[0-9]{{{n}}}" if n > 1 else "[0-9]"]
    if n == 1:
        return [_digit_range(a, b)]
    if a[1:] == "0" * (n - 1) and b[1:] == "9" * (n - 1):
        return [_digit_range(a[0], b[0]) + (f"[0-9]{{{n - 1}}}" if n > 2 else "[0-9]")]
    if a[0] == b[0]:
        return [a[0] + _alt(_same_length(a[1:], b[1:]))]
    rest = n - 1
    parts = [a[0] + _alt(_same_length(a[1:], "9" * rest))]
    low, high = int(a[0]) + 1, int(b[0]) - 1
    if low <= high:
        parts.append(_digit_range(str(low), str(high)) + f"[0-9]{{{rest}}}")
    parts.append(b[0] + _alt(_same_length("0" * rest, b[1:])))
    return parts


def _uint_range(lo: int, hi: int) -> list[str]:
    """Alternatives for the integers lo..hi (0 <= lo <= hi), no leading zeros."""
    parts: list[str] = []
    full: list[int] = []  # lengths (> 1) whose every number is in the range: one part
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(hi, 10**n - 1)
        if n > 1 and a == 10 ** (n - 1) and b == 10**n - 1:
            full.append(n)
        elif a <= b:
            parts += _same_length(str(a), str(b))
    if full:
        low, high = full[0] - 1, full[-1] - 1
        count = f"{{{low}}}" if low == high else f"{{{low},{high}}}"
        parts.append("[1-9][0-9]" + count)
    return parts


def int_range(lo: int, hi: int) -> str:
    """A regex for the integers lo..hi (lo <= hi), in JSON's spelling."""
    if lo > hi:
        raise ValueError("empty range")
    parts: list[str] = []
    if lo < 0:
        parts.append("-" + _alt(_uint_range(max(1, -hi), -lo)))
    if hi >= 0:
        parts += _uint_range(max(lo, 0), hi)
    return _alt(parts)


def significant() -> str:
    """Any JSON number with at most 17 significant digits and |exponent| <= 308."""
    body = [f"0(?:\\.0{{0,{MAX_FRACTION_ZEROS}}}[0-9]{{1,{SIG_DIGITS}}})?"]
    for d in range(1, SIG_DIGITS + 1):
        head = "[1-9]" + (f"[0-9]{{{d - 1}}}" if d > 1 else "")
        tail = f"(?:\\.[0-9]{{1,{SIG_DIGITS - d}}})?" if d < SIG_DIGITS else ""
        body.append(head + tail)
    return "-?" + _alt(body) + _EXPONENT


def integer_bounds(
    minimum: float | None, maximum: float | None, exclusive_min: bool, exclusive_max: bool
) -> tuple[int, int]:
    """The integers a schema's bounds allow, within int64."""
    lo, hi = INT64_MIN, INT64_MAX
    if minimum is not None:
        lo = max(lo, math.floor(minimum) + 1 if exclusive_min else math.ceil(minimum))
    if maximum is not None:
        hi = min(hi, math.ceil(maximum) - 1 if exclusive_max else math.floor(maximum))
    return lo, hi


def number_range(
    minimum: float | None, maximum: float | None, exclusive_min: bool, exclusive_max: bool
) -> str | None:
    """A regex for numbers within the bounds, no exponent, or None when this form cannot
    cover the range well (a range narrower than one integer: the caller falls back to
    llguidance's own number). Integers lo..hi, and decimals m.f (f nonzero, ending in a
    nonzero digit) whose whole integer span m..m+1 (or -(m+1)..-m) lies in the range:
    near a fractional bound some valid numbers are left out, none outside is let in.
    The 17-significant-digit bound applies too (the caller intersects with `significant`)."""
    lo, hi = integer_bounds(minimum, maximum, exclusive_min, exclusive_max)
    parts = [int_range(lo, hi)] if lo <= hi else []
    fraction = f"\\.(?:0{{0,{MAX_FRACTION_ZEROS}}}[0-9]{{0,{SIG_DIGITS - 1}}}[1-9])"
    bottom = -math.inf if minimum is None else minimum
    top = math.inf if maximum is None else maximum
    # positive m.f: m >= bottom (f > 0 makes it strictly greater) and m + 1 <= top
    pos_lo = max(0, math.ceil(bottom) if bottom > -math.inf else 0)
    pos_hi = INT64_MAX if top == math.inf else math.floor(top) - 1
    if pos_lo <= pos_hi:
        parts.append(int_range(pos_lo, pos_hi) + fraction)
    # negative -(m.f): -(m + 1) >= bottom and -m <= top
    neg_lo = max(0, math.ceil(-top) if top < math.inf else 0)
    neg_hi = INT64_MAX if bottom == -math.inf else math.floor(-bottom) - 1
    if neg_lo <= neg_hi:
        parts.append("-" + int_range(neg_lo, neg_hi) + fraction)
    if not parts:
        return None
    return _alt(parts)
