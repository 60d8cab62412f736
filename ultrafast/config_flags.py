"""Command-line flags generated from the config dataclasses, and the configs read back.

Each option of `serve` (and of `generate`, `chat`, `cluster`, which take parts of it) is
declared once, on the field it sets (`ultrafast/config.py`): `field(default=..., metadata=
flag("--port", "server", "TCP port", ...))`. `add_flags` turns those fields into argparse arguments
in their `--help` groups, the default shown being the field's own default in the flag's units
(`keep_alive_s = 300.0` is shown as `--keep-alive 5m`); `read_config` builds the keyword
arguments of the dataclass back from the parsed namespace, with no hand-written `args.x ->
field` table. vLLM's `EngineArgs` generates its parser the same way.

A converter may be named as "module:function" (loaded only when a flag is read), so that
config.py, the bottom layer, imports nothing from the server for, e.g., `--api-key` hashing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

NOT_SET: Any = object()  # the shown default is the field's own default (through `shown`)


@dataclass(frozen=True)
class Flag:
    """One command-line option of a config field. `shown` maps the field's default to the
    flag's default (its units: ms for a field in s, "on"/"off" for a bool); `to_field` maps
    the parsed value back (None leaves the field at its default). `attr` names the member of
    the field's value the flag sets (a nested dataclass, or one pair of a tuple of pairs)."""

    name: str
    group: str
    help: str | Callable[[], str]
    part: str = "main"  # which commands take it: add_flags(..., parts=...)
    type: Any = None
    choices: tuple | None = None
    metavar: str | None = None
    action: str | None = None  # "append", "store_true"
    nargs: str | None = None
    const: Any = None
    default: Any = NOT_SET  # the flag's own default, when it is not the field's
    shown: Callable[[Any], Any] | None = None
    to_field: Callable[[Any], Any] | str | None = None
    attr: str | None = None
    bounds: tuple[float, float] | None = None  # a value outside is a ValueError naming --flag
    hidden: bool = False
    aliases: tuple[str, ...] = ()  # older spellings still accepted (`--spec` for --speculation)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")


def flag(name: str, group: str, help: str | Callable[[], str], **options: Any) -> dict:
    """A field's metadata holding one flag (`dataclasses.field(metadata=flag(...))`)."""
    return {"flags": (Flag(name, group, help, **options),)}


def flags(*declared: Flag) -> dict:
    """A field's metadata holding several flags, each setting one `attr` of its value."""
    return {"flags": declared}


def reads(dest: str) -> dict:
    """Metadata of a field that takes another flag's value when its own flag (if any) is not
    given (`max_num_seqs` is what `--num-slots` gives unless `--max-num-seqs` says otherwise:
    every slot may run)."""
    return {"reads": dest}


def scaled(factor: float) -> dict[str, Callable[[Any], Any]]:
    """`shown` and `to_field` of a flag in other units than its field (ms for s: 1000)."""
    return {"shown": lambda v: v * factor, "to_field": lambda v: v / factor}


def on_off() -> dict[str, Any]:
    """A bool field as `--flash-attn on|off`."""
    return {
        "choices": ("on", "off"),
        "shown": lambda v: "on" if v else "off",
        "to_field": lambda v: v == "on",
    }


def switch_off() -> dict[str, Any]:
    """A field that is True unless its switch is given (`--no-access-log`)."""
    return {"action": "store_true", "shown": lambda v: not v, "to_field": lambda v: not v}


def parse_models_arg(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`--models a=/p/a.gguf,b=/p/b` (repeatable) -> ((name, path), ...); a bare path is
    named after its file stem. ValueError on a duplicate or empty name."""
    from pathlib import Path

    models: list[tuple[str, str]] = []
    for value in values:
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, path = item.partition("=")
            if not sep:
                name, path = Path(item).stem, item
            if not name or not path:
                raise ValueError(f"--models: {item!r} is not NAME=PATH")
            if name in dict(models):
                raise ValueError(f"--models: the name {name!r} is given twice")
            models.append((name, path))
    return tuple(models)


def duration_text(seconds: float | None) -> str:
    """300.0 -> "5m", None (never) -> "-1": a keep-alive as `--keep-alive` takes it."""
    if seconds is None:
        return "-1"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _converter(fn: Callable[[Any], Any] | str | None) -> Callable[[Any], Any] | None:
    if isinstance(fn, str):
        module, _, name = fn.partition(":")
        loaded: Callable[[Any], Any] = getattr(importlib.import_module(module), name)
        return loaded
    return fn


def _flag_default(field: dataclasses.Field, declared: Flag) -> Any:
    if declared.default is not NOT_SET:
        return declared.default
    value = field.default
    if declared.attr is not None:
        value = getattr(value, declared.attr) if dataclasses.is_dataclass(value) else None
    return declared.shown(value) if declared.shown and value is not None else value


def config_flags(
    cls: type, parts: Iterable[str] | None = None, names: Iterable[str] | None = None
) -> list[tuple[Any, Flag]]:
    """(field, flag) for each flag of `cls` in `parts` (None: all) on the fields `names`
    (None: all), in field order."""
    wanted = None if parts is None else set(parts)
    fields = None if names is None else set(names)
    return [
        (field, declared)
        for field in dataclasses.fields(cls)
        for declared in field.metadata.get("flags", ())
        if (wanted is None or declared.part in wanted) and (fields is None or field.name in fields)
    ]


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    parts: Iterable[str] | None = None,
    group: Callable[[argparse.ArgumentParser, str], Any] | None = None,
    names: Iterable[str] | None = None,
    help: str | None = None,
) -> None:
    """Add the flags of `cls`'s fields to `parser`, each in its help group (`group(parser,
    title)`, e.g. cli_help.group; default: straight on the parser). `names` and `help`: one
    field's flag with another text, for a bench suite that takes, e.g., `--compile`."""
    for field, declared in config_flags(cls, parts, names):
        target = group(parser, declared.group) if group else parser
        options: dict[str, Any] = {"default": _flag_default(field, declared)}
        help_text = declared.help() if callable(declared.help) else declared.help
        options["help"] = argparse.SUPPRESS if declared.hidden else (help or help_text)
        for key in ("type", "choices", "metavar", "nargs", "const", "action"):
            if getattr(declared, key) is not None:
                options[key] = getattr(declared, key)
        if declared.action == "append":
            options["default"] = []
        elif declared.action == "store_true":
            options.pop("default")
        target.add_argument(declared.name, *declared.aliases, dest=declared.dest, **options)


def _checked(declared: Flag, value: Any) -> Any:
    if declared.bounds is not None and value is not None:
        low, high = declared.bounds
        if not low <= value <= high:
            raise ValueError(f"{declared.name} {value} is out of range [{low:g}, {high:g}]")
    return value


def _field_value(field: dataclasses.Field, declared: tuple[Flag, ...], args: Any) -> Any:
    """The field's value from its flags in `args`; NOT_SET when none was parsed or all say
    "leave the default"."""
    present = [d for d in declared if hasattr(args, d.dest)]
    if not present:
        return NOT_SET
    if len(declared) == 1 and declared[0].attr is None:
        value = _checked(declared[0], getattr(args, declared[0].dest))
        if value is None:  # not given, and no default of its own: the field's stands
            return NOT_SET
        convert = _converter(declared[0].to_field)
        return convert(value) if convert is not None else value
    members: dict[str, Any] = {}
    for d in present:
        value = _checked(d, getattr(args, d.dest))
        convert = _converter(d.to_field)
        members[d.attr or d.dest] = convert(value) if convert and value is not None else value
    if dataclasses.is_dataclass(field.default):  # a nested config: only the flagged members
        return dataclasses.replace(field.default, **members)  # type: ignore[type-var]
    return tuple((k, v) for k, v in members.items() if v is not None)  # pairs: those given


def read_config(cls: type, args: Any, parts: Iterable[str] | None = None) -> dict[str, Any]:
    """`cls`'s keyword arguments from the parsed flags in `args` (fields whose flags the
    command does not have, or that were left unset, keep their defaults)."""
    wanted = None if parts is None else set(parts)
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        declared = tuple(
            d for d in field.metadata.get("flags", ()) if wanted is None or d.part in wanted
        )
        value = _field_value(field, declared, args) if declared else NOT_SET
        if value is NOT_SET and "reads" in field.metadata:
            value = getattr(args, field.metadata["reads"], None) or NOT_SET
        if value is not NOT_SET:
            out[field.name] = value
    return out
