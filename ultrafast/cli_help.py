"""What `--help` shows: argument groups by title and every default (used by cli_serve.py)."""

from __future__ import annotations

import argparse
import re
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")
SERVE_GROUPS = (
    "model",
    "server",
    "authentication",
    "limits",
    "service tiers",
    "engine",
    "KV cache",
    "sessions",
    "several models",
    "speculative decoding",
    "output guard",
)
# a help text that already says its default in words (None, [] and "" defaults must)
SHOWN_DEFAULT = re.compile(r"\(default\b|\bdefault:")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, unless the text already says it: an on/off flag
    shows "(default: off)", and a default of None, [] or "" has to be said in words (a
    test holds every serve flag to that)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            action.default is argparse.SUPPRESS
            or not action.option_strings
            or SHOWN_DEFAULT.search(text)
        ):
            return text
        if action.nargs == 0 and action.const is True:  # store_true
            return text + " (default: off)"
        if action.default in (None, [], ""):
            return text
        return text + " (default: %(default)s)"


def group(parser: argparse.ArgumentParser, title: str) -> Any:
    """The parser's argument group `title` for --help, made on first use (the engine flags of
    `serve`, `generate` and `cluster` come from shared helpers, so a title may be asked twice)."""
    for existing in parser._action_groups:
        if existing.title == title:
            return existing
    return parser.add_argument_group(title)
