"""Every command answers --help, and bad arguments fail with a clear message, not a traceback."""

import subprocess
import sys

import pytest


def ultrafast(*args):
    return subprocess.run(
        [sys.executable, "-m", "ultrafast.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["generate"],
        ["serve"],
        ["bench"],
        ["bench", "decode"],
        ["convert"],
        ["loadtest"],
        ["keys"],
        ["quantize"],
    ],
)
def test_help(command):
    done = ultrafast(*command, "--help")
    assert done.returncode == 0 and "usage: ultrafast" in done.stdout


def test_missing_model_is_a_clear_error(tmp_path):
    done = ultrafast("generate", "x", "--model", str(tmp_path / "nope"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


def test_convert_refuses_a_non_model_directory(tmp_path):
    done = ultrafast("convert", str(tmp_path), str(tmp_path / "x.gguf"))
    assert done.returncode != 0 and "Traceback" not in done.stderr


def test_spec_flags(tmp_path):
    done = ultrafast(
        "generate",
        "def f(x):",
        "--max-tokens",
        "12",
        "--spec",
        "ngram",
        "--spec-tiers",
        "priority,default",
        "--threads",
        "1",
        "--stats",
    )
    assert done.returncode == 0, done.stderr
    assert "speculation ngram:" in done.stderr and "drafts accepted" in done.stderr
    done = ultrafast("generate", "x", "--spec-tiers", "turbo")
    assert done.returncode == 2 and "unknown speculation tier" in done.stderr
    done = ultrafast("generate", "x", "--spec", "draft", "--draft-model", str(tmp_path / "nope"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


BENCH_SUITES = ("harness", "decode", "tiers", "sessions", "guard", "gpu")


@pytest.mark.parametrize("suite", BENCH_SUITES)
def test_every_bench_suite_has_its_own_help(suite, capsys):
    from ultrafast.cli import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(["bench", suite, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: ultrafast bench {suite}") and "--out" in text


@pytest.mark.parametrize(
    "argv, refused",
    [
        (["bench", "tiers", "--gguf", "x.gguf"], "--gguf"),  # decode's option
        (["bench", "decode", "--turns", "3"], "--turns"),  # sessions'
        (["bench", "gpu", "--peers", "transformers"], "--peers"),  # harness'
        (["bench", "sessions", "--roofline"], "--roofline"),  # harness'
        (["bench", "nosuch"], "nosuch"),
    ],
)
def test_a_suite_refuses_another_suites_options(argv, refused, capsys):
    from ultrafast.cli import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and refused in err
    assert "unrecognized arguments" in err or "invalid choice" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["bench"],
        ["bench", "--roofline", "--rounds", "3"],
        ["bench", "run"],
        ["bench", "harness", "--concurrency", "1"],
    ],
)
def test_bench_without_a_suite_is_the_harness(argv):
    from ultrafast.cli import parse_args
    from ultrafast_harness.bench import harness_report

    args = parse_args(argv)
    assert args.suite == "harness" and args.func.module == harness_report.__name__
    assert args.concurrency == ("1" if "--concurrency" in argv else "1,4,16")


# The `ultrafast bench` invocations quoted in README.md, BENCHMARKS.md, deploy/README.md,
# scripts/ and tests/ when the suites became subcommands: each still parses, to its suite.
DOCUMENTED_BENCH_COMMANDS = [
    ("--roofline", "harness"),
    ("--roofline --rounds 3", "harness"),
    (
        "--peers ours-engine-torch,transformers --concurrency 1 --compile inductor --rounds 3",
        "harness",
    ),
    (
        "--model M --max-tokens 8 --rounds 1 --concurrency 1,2 --prompt-tokens 12 --threads 1 "
        "--roofline --out r.json",
        "harness",
    ),
    ("decode", "decode"),
    ("decode --spec ngram,draft,auto", "decode"),
    ("decode --rounds 5 --new-tokens 128 --spec ngram,auto --gguf a.gguf --gguf b.gguf", "decode"),
    ("tiers", "tiers"),
    ("tiers --probes 32", "tiers"),
    ("tiers --probes 32 --rounds 30", "tiers"),
    ("sessions", "sessions"),
    ("sessions --sessions 0 --rounds 3", "sessions"),
    ("sessions --sessions 32", "sessions"),
    ("sessions --model M --sessions 0 --rounds 2", "sessions"),
    ("sessions --executor torch --model M --sessions 0 --rounds 1", "sessions"),
    ("sessions --oversubscribed", "sessions"),
    ("sessions --oversubscribed --oversub-conversations 12 --oversub-turns 6", "sessions"),
    ("guard", "guard"),
    ("gpu --out runs/bench_gpu.json", "gpu"),
]


@pytest.mark.parametrize("command, suite", DOCUMENTED_BENCH_COMMANDS)
def test_documented_bench_commands_still_parse(command, suite):
    from ultrafast.cli import parse_args

    assert parse_args(["bench", *command.split()]).suite == suite


@pytest.mark.parametrize("suite", BENCH_SUITES)
def test_a_suite_reads_only_options_its_subcommand_has(suite):
    """Every `args.NAME` a suite's main reads is an option of that suite's subcommand."""
    import ast
    import importlib

    from ultrafast.cli import parse_args

    args = parse_args(["bench", suite])
    source = importlib.import_module(args.func.module).__file__
    tree = ast.parse(open(source).read())
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "args"
    }
    assert read and read <= set(vars(args)), read - set(vars(args))


def test_engine_and_server_defaults_come_from_the_config_dataclasses():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import engine_options, server_config
    from ultrafast.config import EngineConfig, ServerConfig

    args = parse_args(["serve"])
    assert EngineConfig(model="m", **engine_options(args)) == EngineConfig(model="m")
    assert server_config(args) == ServerConfig()
    args = parse_args(["generate", "x"])
    assert EngineConfig(model="m", **engine_options(args)) == EngineConfig(model="m")


def test_engine_flags_reach_the_config():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import engine_options, server_config

    args = parse_args(
        [
            "serve",
            "--max-draft-tokens",
            "3",
            "--num-slots",
            "2",
            "--speculation-tiers",
            "priority, default",
            "--session-ttl-s",
            "60",
            "--priority-ttft-ms",
            "90",
            "--speculation-costs",
            "fixed",
        ]
    )
    options = engine_options(args)
    assert options["max_draft_tokens"] == 3 and options["num_slots"] == 2
    assert options["speculation_measured_costs"] is False
    assert options["max_num_seqs"] == 2 and options["speculation_tiers"] == ("priority", "default")
    server = server_config(args)
    assert server.session_ttl_s == 60 and server.priority.ttft_ms == 90


def test_the_speculation_flags_keep_their_short_spellings():
    """`--spec`, `--spec-tiers` and `--spec-costs` are accepted spellings of the speculation
    flags: they set the same fields, and `serve --help` names them beside the long ones."""
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import engine_options

    long = ["--speculation", "ngram", "--speculation-tiers", "default", "--speculation-costs"]
    short = ["--spec", "ngram", "--spec-tiers", "default", "--spec-costs"]
    for flags in (long, short):
        options = engine_options(parse_args(["serve", *flags, "fixed"]))
        assert options["speculation"] == "ngram"
        assert options["speculation_tiers"] == ("default",)
        assert options["speculation_measured_costs"] is False
    shown = " ".join(ultrafast("serve", "--help").stdout.split())
    for name in ("speculation", "speculation-tiers", "speculation-costs"):
        assert f"--{name}" in shown and f"--{name.replace('speculation', 'spec')} " in shown


def test_fixed_spec_costs_reach_the_speculator():
    from ultrafast.config import DEMO_MODEL_DIR, EngineConfig
    from ultrafast.llm import build_speculator
    from ultrafast.model_files import resolve_model

    files = resolve_model(str(DEMO_MODEL_DIR))
    for measured in (True, False):
        config = EngineConfig(
            model=str(DEMO_MODEL_DIR), speculation="ngram", speculation_measured_costs=measured
        )
        assert build_speculator(config, files).config.use_measured_costs is measured


def test_the_flash_attention_flag_reaches_the_ggml_executor():
    from ultrafast.cli import parse_args
    from ultrafast.cli_serve import engine_options
    from ultrafast.config import DEMO_MODEL_DIR, EngineConfig
    from ultrafast.llm import build_executor
    from ultrafast.model_files import resolve_model

    assert engine_options(parse_args(["serve", "--flash-attn", "off"]))["flash_attn"] is False
    files = resolve_model(str(DEMO_MODEL_DIR))
    for on in (True, False):
        config = EngineConfig(
            model=str(DEMO_MODEL_DIR), executor="ggml", num_slots=1, max_model_len=64, flash_attn=on
        )
        executor = build_executor(config, files)
        try:
            assert executor.flash_attn is on
        finally:
            executor.close()
