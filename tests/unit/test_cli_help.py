"""`ultrafast serve --help` explains itself: grouped flags, each with help and its default
shown; `--version`; flags named in messages exist; an impossible --max-model-len is refused
with what fits; `--api-key` keys authenticate through the tenants code."""

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ultrafast.cli import build_parser
from ultrafast.cli_help import SERVE_GROUPS, SHOWN_DEFAULT
from ultrafast.cli_serve import check_max_model_len
from ultrafast.config import DEMO_MODEL_DIR, ServerConfig

PACKAGE = Path(__file__).resolve().parents[2] / "ultrafast"
HARNESS = PACKAGE.parent / "ultrafast_harness"


def ultrafast(*args):
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", *args], capture_output=True, text=True, timeout=120
    )


def subparser(name: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no subcommands")


def all_flags() -> set[str]:
    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    walk(child)

    walk(build_parser())
    return flags


def shown_help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


@pytest.mark.parametrize("command", ["serve", "generate", "cluster"])
def test_every_flag_has_help_and_shows_its_default(command):
    parser = subparser(command)
    missing_help, missing_default = [], []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        text = shown_help(parser, action)
        if not text.strip():
            missing_help.append(name)
        elif not action.required and not SHOWN_DEFAULT.search(text):  # a required one has none
            missing_default.append(name)
    assert not missing_help, f"flags without help: {missing_help}"
    assert not missing_default, f"flags whose help shows no default: {missing_default}"


def test_serve_help_groups_its_flags():
    parser = subparser("serve")
    groups = {g.title: g for g in parser._action_groups}
    for title in ("model", "server", "service tiers", "KV cache", "sessions", "limits"):
        assert title in groups and groups[title]._group_actions, title
    assert set(SERVE_GROUPS) <= set(groups)
    # nothing is left in argparse's catch-all group but -h
    ungrouped = [a.option_strings for a in groups["options"]._group_actions]
    assert ungrouped == [["-h", "--help"]], ungrouped
    text = ultrafast("serve", "--help").stdout
    assert text.index("\nmodel:") < text.index("\nserver:") < text.index("\nservice tiers:")
    assert "--port PORT           TCP port (default: 8000)" in text
    cluster = {g.title: g for g in subparser("cluster")._action_groups}
    assert {a.dest for a in cluster["cluster"]._group_actions} >= {"replicas", "address"}


def test_version():
    done = ultrafast("--version")
    assert done.returncode == 0, done.stderr
    wanted = re.search(r'(?m)^version = "([^"]+)"', (PACKAGE.parent / "pyproject.toml").read_text())
    assert done.stdout.startswith(f"ultrafast {wanted.group(1)} ("), done.stdout
    assert "Python" in done.stdout


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
# flags of other programs that our prose names, with the program
OTHER_PROGRAMS = {
    flag: "redis-server (bench/redis_server.py)"
    for flag in ("--dir", "--requirepass", "--user", "--tls-port")
}


def _prose_strings(tree: ast.AST):
    """(line, text) of every string with a space in it: messages, help texts, docstrings, but
    not the argv items of the commands we run (each a bare "--flag" or "--flag=value")."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.search(r"\s", node.value.strip()):
                yield node.lineno, node.value


def _declared_flags(tree: ast.AST) -> set[str]:
    """Flags a module's own parser declares (`add_argument("--x", ...)`): the standalone
    scripts run with `python -m` have their own."""
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
    }


def test_every_flag_a_message_names_exists():
    paths = [*PACKAGE.rglob("*.py"), *HARNESS.rglob("*.py")]  # the bench suites' messages too
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in paths}
    flags = all_flags() | set(OTHER_PROGRAMS)
    for tree in trees.values():
        flags |= _declared_flags(tree)
    wrong = []
    for path, tree in sorted(trees.items()):
        for line, text in _prose_strings(tree):
            wrong += [
                f"{path.relative_to(PACKAGE.parent)}:{line} {flag}"
                for flag in FLAG.findall(text)
                if flag not in flags
            ]
    assert not wrong, "messages name flags no command has:\n" + "\n".join(wrong)


def test_the_scan_sees_a_wrong_flag_in_a_message():
    tree = ast.parse(
        'error = APIError(403, "this Host is not allowed (see --allowed-hosts)")\n'
        'log.info("set --no-such to do it")\n'
        'argv = ["--bind", "127.0.0.1"]'
    )
    named = [f for _, text in _prose_strings(tree) for f in FLAG.findall(text)]
    assert named == ["--allowed-hosts", "--no-such"]
    assert not set(named) & all_flags()


def test_an_impossible_max_model_len_says_what_fits():
    with pytest.raises(ValueError) as caught:
        check_max_model_len(str(DEMO_MODEL_DIR), 1_000_000)
    message = str(caught.value)
    assert "--max-model-len 1,000,000" in message and "2,048 positions" in message
    assert "--max-model-len 2048 or less" in message
    check_max_model_len(str(DEMO_MODEL_DIR), 2048)  # the model's own context fits
    check_max_model_len(str(DEMO_MODEL_DIR), None)  # the default is capped, never refused
    with pytest.raises(ValueError, match=">= 1"):
        check_max_model_len(str(DEMO_MODEL_DIR), 0)


def test_the_cli_refuses_an_impossible_max_model_len_before_loading():
    done = ultrafast("generate", "hi", "--model", str(DEMO_MODEL_DIR), "--max-model-len", "1000000")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--max-model-len 2048 or less" in done.stderr


def test_api_key_flag_is_hashed_into_the_server_config():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import server_config
    from ultrafast.server.tenants import hash_key

    config = server_config(parse_args(["serve", "--api-key", "k1", "--api-key", "k2"]))
    assert config.api_key_hashes == (hash_key("k1"), hash_key("k2"))
    assert config.auth_on and "k1" not in repr(config)
    assert not server_config(parse_args(["serve"])).auth_on
    with pytest.raises(ValueError, match="--api-key"):
        server_config(parse_args(["serve", "--api-key", "has space"]))


def test_api_keys_from_the_flag_join_the_file_tenants(tmp_path):
    from ultrafast.request import ServiceTier
    from ultrafast.server.tenants import CLI_TENANT, hash_key, server_api_keys

    assert server_api_keys(None, ()) is None
    alone = server_api_keys(None, (hash_key("k1"),))
    tenant, revoked = alone.lookup("k1")
    assert tenant.name == CLI_TENANT and not revoked
    assert tenant.tiers == frozenset(ServiceTier) and tenant.has_scope("metrics")
    assert alone.lookup("k2") is None
    keys_file = tmp_path / "keys.json"
    tenant = {"name": "acme", "keys": [{"sha256": hash_key("file-key")}]}
    keys_file.write_text(json.dumps({"tenants": [tenant]}))
    both = server_api_keys(str(keys_file), (hash_key("k1"),))
    assert both.lookup("file-key")[0].name == "acme" and both.lookup("k1")[0].name == CLI_TENANT
    with pytest.raises(ValueError, match="also in"):
        server_api_keys(str(keys_file), (hash_key("file-key"),))


def test_log_flags_reach_the_server_config():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import server_config

    config = server_config(parse_args(["serve", "--log-level", "warning", "--no-access-log"]))
    assert (config.log_level, config.access_log) == ("warning", False)
    assert server_config(parse_args(["serve"])) == ServerConfig()
