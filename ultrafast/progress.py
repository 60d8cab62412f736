"""Terminal progress for long jobs (bench, loadtest, quantize, training); no dependencies.

On a TTY: one line rewritten in place (carriage return), a bar when the total is known or a
spinner when not, with the count, the rate, the ETA and free-form fields. Redrawn at most every
`redraw_s`, so a tight loop does not spend its time printing. Not a TTY (CI logs, pipes): a
plain line every `log_every_s` and a final one, never carriage returns or escape codes.
Writes to stderr by default, so a command's stdout (reports, JSON) stays clean.
"""

from __future__ import annotations

import sys
import time

_SPINNER = "|/-\\"


def _fmt_s(seconds: float) -> str:
    seconds = int(max(0, seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    def __init__(
        self,
        label: str,
        total: int | None = None,
        stream=None,
        unit: str = "",
        width: int = 24,
        redraw_s: float = 0.1,
        log_every_s: float = 10.0,
        clock=time.monotonic,
    ):
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.unit = unit
        self.width = width
        self.redraw_s = redraw_s
        self.log_every_s = log_every_s
        self.clock = clock
        self.done = 0
        self.fields: dict[str, object] = {}
        self.started_s = clock()
        self._last_draw_s: float | None = None
        self._ticks = 0
        self._line_len = 0
        self._closed = False
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, **fields) -> None:
        """`n` more items done; `fields` are shown after the counts (e.g. errors=0)."""
        self.done += n
        self.fields.update(fields)
        self._maybe_draw()

    def set(self, done: int, **fields) -> None:
        self.done = done
        self.fields.update(fields)
        self._maybe_draw()

    def rate(self) -> float:
        elapsed = self.clock() - self.started_s
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """The status text (without carriage return or padding)."""
        rate = self.rate()
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            eta = _fmt_s((self.total - self.done) / rate) if rate > 0 else "?"
            text = (
                f"{self.label} [{bar}] {self.done}/{self.total}{unit} {100 * frac:.0f}% "
                f"{rate:.1f}/s ETA {eta}"
            )
        else:
            spin = _SPINNER[self._ticks % len(_SPINNER)] if self.tty else "-"
            text = (
                f"{self.label} {spin} {self.done}{unit} {rate:.1f}/s "
                f"{_fmt_s(self.clock() - self.started_s)}"
            )
        extra = " ".join(f"{k}={v}" for k, v in self.fields.items())
        return f"{text} {extra}".rstrip()

    def _maybe_draw(self, force: bool = False) -> None:
        now = self.clock()
        every = self.redraw_s if self.tty else self.log_every_s
        if not force and self._last_draw_s is not None and now - self._last_draw_s < every:
            return
        if not force and not self.tty and self._last_draw_s is None:
            self._last_draw_s = now  # plain logs: the first line after log_every_s, not at 0
            return
        self._last_draw_s = now
        self._ticks += 1
        text = self.line()
        if self.tty:
            pad = max(0, self._line_len - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._line_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._maybe_draw(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
