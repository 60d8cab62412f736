"""When will each model next be called? Two patterns from the request stream, both cheap:

- periodic: a model whose recent calls came at a steady period (the gaps' coefficient of
  variation under `max_cv`) is next expected one period after its last call;
- follower: when the calls that came right after model A went to model B (an agent's loop:
  plan with A, then act with B), B is next expected A's last call plus the usual delay.

The registry preloads a model shortly before its predicted call (registry.py).
Times are the caller's clock (time.monotonic() in the server, a replayed trace in tests).
"""

from __future__ import annotations

import collections
import statistics


class UsePredictor:
    def __init__(
        self, history: int = 8, min_samples: int = 2, max_cv: float = 0.25, min_share: float = 0.8
    ):
        self.history = history  # calls (and successors) remembered per model
        self.min_samples = min_samples  # gaps or successions needed before predicting
        self.max_cv = max_cv  # how steady a period must be
        self.min_share = min_share  # how often A must be followed by the same model
        self._calls: dict[str, collections.deque[float]] = {}
        self._followers: dict[str, collections.deque[tuple[str, float]]] = {}
        self._last: tuple[str, float] | None = None

    def observe(self, name: str, t: float) -> None:
        """A call for `name` arrived at `t`."""
        calls = self._calls.setdefault(name, collections.deque(maxlen=self.history + 1))
        calls.append(t)
        if self._last is not None and self._last[0] != name:
            prev, prev_t = self._last
            succ = self._followers.setdefault(prev, collections.deque(maxlen=self.history))
            succ.append((name, t - prev_t))
        self._last = (name, t)

    def period(self, name: str) -> float | None:
        """The model's steady period, or None when its calls are not steady (yet)."""
        calls = self._calls.get(name)
        if not calls or len(calls) < self.min_samples + 1:
            return None
        gaps = [b - a for a, b in zip(calls, list(calls)[1:], strict=False)]
        mean = statistics.fmean(gaps)
        if mean <= 0 or statistics.pstdev(gaps) > self.max_cv * mean:
            return None
        return mean

    def _periodic_next(self, name: str, now: float) -> float | None:
        period = self.period(name)
        if period is None:
            return None
        expected = self._calls[name][-1] + period
        # a call overdue by more than half a period: the pattern broke, stop predicting it
        return expected if expected >= now - period / 2 else None

    def _follower_next(self, name: str) -> float | None:
        if self._last is None or self._last[0] == name:
            return None
        prev, prev_t = self._last
        succ = self._followers.get(prev)
        if not succ or len(succ) < self.min_samples:
            return None
        delays = [d for n, d in succ if n == name]
        if len(delays) < self.min_share * len(succ):
            return None
        return prev_t + statistics.median(delays)

    def next_use(self, name: str, now: float) -> float | None:
        """The earliest predicted time of `name`'s next call, or None."""
        guesses = [
            g for g in (self._periodic_next(name, now), self._follower_next(name)) if g is not None
        ]
        return min(guesses) if guesses else None
