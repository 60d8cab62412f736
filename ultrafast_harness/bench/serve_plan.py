"""The order `ultrafast bench serve` runs its levels in: servers interleaved per level.

Every server is started first (one at a time, so each start is timed alone) and stays up, the
others frozen while one runs a level (serve_servers.alone); then each level (a stream count at
the short prompt length, a stream count at the long prompt length, the burst) runs on every
server in turn before the next level starts. A machine whose
speed drifts over minutes (a neighbour, thermal limits) then weighs on every server's figure of
a level alike, instead of on whichever server ran last. The server order rotates from level to
level and round to round, so no server always runs first (a cold cache) or last.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    kind: str  # "streams" (short prompts), "long" (long prompts) or "burst"
    streams: int  # concurrent streams (the burst: its request count)
    prompt_tokens: int

    @property
    def key(self) -> str:
        """The report's name for the level: "4", "long 16", "burst"."""
        if self.kind == "streams":
            return str(self.streams)
        return "burst" if self.kind == "burst" else f"long {self.streams}"


def levels_of(
    streams: list[int],
    prompt_tokens: int,
    long_streams: list[int],
    long_prompt_tokens: int,
    burst_requests: int,
) -> list[Level]:
    out = [Level("streams", n, prompt_tokens) for n in streams]
    out += [Level("long", n, long_prompt_tokens) for n in long_streams]
    if burst_requests > 0:
        out.append(Level("burst", burst_requests, prompt_tokens))
    return out


def interleaved(
    servers: list[str], levels: list[Level], rounds: int
) -> list[tuple[int, Level, str]]:
    """(round, level, server) in run order: per round, per level, every server, the order
    rotated by one at each step. The burst runs once (round 0): it is its own repetition."""
    order: list[tuple[int, Level, str]] = []
    turn = 0
    for r in range(rounds):
        for level in levels:
            if level.kind == "burst" and r > 0:
                continue
            shift = turn % max(1, len(servers))
            order += [(r, level, name) for name in servers[shift:] + servers[:shift]]
            turn += 1
    return order
