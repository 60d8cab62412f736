"""The progress display on a fake TTY and a fake pipe, driven by a fake clock."""

import io

from ultrafast.progress import Progress


class FakeStream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


class FakeClock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_tty_redraws_one_line_with_bar_rate_and_eta():
    stream, clock = FakeStream(tty=True), FakeClock()
    p = Progress("load", total=10, stream=stream, clock=clock, width=10)
    for _ in range(5):
        clock.now_s += 1.0
        p.update(errors=0)
    p.close()
    out = stream.getvalue()
    assert "\n" not in out[:-1]  # one line, rewritten in place
    assert out.endswith("\n") and out.count("\r") >= 5
    last = out.rstrip("\n").split("\r")[-1]
    assert "[#####-----] 5/10" in last and "50%" in last
    assert "1.0/s" in last and "ETA 5s" in last and "errors=0" in last


def test_tty_redraw_is_rate_limited():
    stream, clock = FakeStream(tty=True), FakeClock()
    p = Progress("fast", total=1000, stream=stream, clock=clock, redraw_s=0.1)
    for _ in range(1000):
        clock.now_s += 0.001  # 1000 updates in 1 s -> about 10 redraws, not 1000
        p.update()
    assert stream.getvalue().count("\r") <= 12
    p.close()
    assert "1000/1000" in stream.getvalue().split("\r")[-1]


def test_pipe_gets_plain_periodic_lines_without_control_characters():
    stream, clock = FakeStream(tty=False), FakeClock()
    p = Progress("train", total=None, stream=stream, clock=clock, log_every_s=10.0, unit="steps")
    for _ in range(30):
        clock.now_s += 1.0
        p.update(loss=1.5)
    p.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert 2 <= len(lines) <= 4  # every 10 s of 30, plus the final line
    assert lines[-1].startswith("train - 30 steps") and "loss=1.5" in lines[-1]


def test_close_is_idempotent_and_context_manager_closes():
    stream = FakeStream(tty=False)
    with Progress("x", total=2, stream=stream) as p:
        p.update(2)
    p.close()
    assert stream.getvalue().count("\n") == 1
    assert "2/2" in stream.getvalue()
