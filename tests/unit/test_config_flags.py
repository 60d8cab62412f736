"""Flags from the config (config_flags.py): every `serve` option is declared on the config
field it sets, its shown default is that field's default in the flag's units, and the
dataclasses are read back from the parsed flags (nested tiers, pairs, switches, bounds)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from ultrafast.config import EngineConfig, ServerConfig
from ultrafast.config_flags import (
    Flag,
    add_flags,
    config_flags,
    duration_text,
    flag,
    flags,
    read_config,
    reads,
    scaled,
    switch_off,
)


def _serve_parser() -> argparse.ArgumentParser:
    from ultrafast.cli import build_parser

    for action in build_parser(["serve"])._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("no subcommands")


def test_every_serve_option_is_declared_on_a_config_field():
    declared = {d.dest for cls in (EngineConfig, ServerConfig) for _, d in config_flags(cls)}
    options = {
        action.dest
        for action in _serve_parser()._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    }
    assert len(options) > 50 and options == declared


def test_shown_defaults_come_from_the_fields_in_the_flags_units():
    parser = _serve_parser()
    defaults = {a.dest: a.default for a in parser._actions}
    assert defaults["keep_alive"] == duration_text(ServerConfig.keep_alive_s) == "5m"
    assert defaults["short_first_window_ms"] == EngineConfig.short_first_window_s * 1000
    assert defaults["priority_queue"] == ServerConfig.priority.max_in_flight
    assert defaults["flash_attn"] == ("on" if EngineConfig.flash_attn else "off")
    assert defaults["speculation_tiers"] == ",".join(EngineConfig.speculation_tiers)
    assert duration_text(None) == "-1" and duration_text(90.0) == "90s"


@dataclass(frozen=True)
class Inner:
    a: int = 1
    b: int = 2


@dataclass(frozen=True)
class Probe:
    window_s: float = field(
        default=2.0, metadata=flag("--window-ms", "g", "w", type=float, **scaled(1000))
    )
    inner: Inner = field(
        default=Inner(),
        metadata=flags(Flag("--inner-a", "g", "a", type=int, attr="a")),
    )
    pairs: tuple = field(
        default=(),
        metadata=flags(
            Flag("--x", "g", "x", type=float, attr="x", bounds=(0.0, 1.0)),
            Flag("--y", "g", "y", type=float, attr="y"),
        ),
    )
    enabled: bool = field(default=True, metadata=flag("--no-enabled", "g", "e", **switch_off()))
    same: int = field(default=1, metadata=reads("inner_a"))  # as max_num_seqs: --num-slots
    tags: tuple = field(
        default=(), metadata=flag("--tag", "g", "t", action="append", to_field=tuple)
    )


def _probe(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_flags(parser, Probe)
    return read_config(Probe, parser.parse_args(list(argv)))


def test_read_back_units_nested_members_pairs_switches_and_shared_flags():
    assert Probe(**_probe()) == Probe()
    got = Probe(**_probe("--window-ms", "500", "--inner-a", "7", "--y", "0.5", "--no-enabled"))
    assert got.window_s == 0.5 and got.inner == Inner(a=7, b=2)
    assert got.pairs == (("y", 0.5),) and got.enabled is False and got.same == 7
    assert Probe(**_probe("--tag", "a", "--tag", "b")).tags == ("a", "b")


def test_a_value_out_of_its_bounds_names_the_flag():
    with pytest.raises(ValueError, match="--x 2.0 is out of range"):
        _probe("--x", "2")


def test_a_command_without_a_fields_flags_keeps_its_default():
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig, ("listen",))
    args = parser.parse_args(["--port", "9"])
    assert ServerConfig(**read_config(ServerConfig, args)) == ServerConfig(port=9)


def test_max_num_seqs_has_its_own_flag_and_follows_num_slots_without_it():
    parser = _serve_parser()

    def read(*argv: str) -> dict:
        return read_config(EngineConfig, parser.parse_args(list(argv)))

    both = read("--num-slots", "8", "--max-num-seqs", "3")
    assert (both["num_slots"], both["max_num_seqs"]) == (8, 3)  # two settings, not one
    assert read("--num-slots", "4")["max_num_seqs"] == 4  # every slot may run
    assert read("--max-num-seqs", "2")["max_num_seqs"] == 2  # slots sized from memory
    assert "max_num_seqs" not in read()  # 0: every slot, once the slots are known
    with pytest.raises(ValueError, match="cannot exceed num_slots"):
        EngineConfig(model="m", **read("--num-slots", "2", "--max-num-seqs", "3"))


def test_the_step_budget_has_a_flag_and_the_prefill_chunk_follows_it():
    parser = _serve_parser()

    def config(*argv: str) -> EngineConfig:
        return EngineConfig(model="m", **read_config(EngineConfig, parser.parse_args(list(argv))))

    assert config().max_num_batched_tokens == config().prefill_chunk_tokens == 1024
    wide = config("--max-num-batched-tokens", "2048")
    assert (wide.max_num_batched_tokens, wide.prefill_chunk_tokens) == (2048, 2048)
    with pytest.raises(ValueError, match="--max-num-batched-tokens 8"):
        config("--max-num-batched-tokens", "8")


def test_the_gil_switch_flag_sets_the_interpreters_switch_interval():
    import sys

    from ultrafast.server.build import set_gil_switch

    args = _serve_parser().parse_args(["model.gguf", "--gil-switch-ms", "0.25"])
    config = ServerConfig(**read_config(ServerConfig, args))
    before = sys.getswitchinterval()
    try:
        set_gil_switch(config)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        set_gil_switch(ServerConfig())
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # the default
    finally:
        sys.setswitchinterval(before)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--gil-switch-ms"):
            ServerConfig(gil_switch_ms=bad)
