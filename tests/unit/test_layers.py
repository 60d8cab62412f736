"""The package's shape, as docs/ARCHITECTURE.md ("Layers and import rules") states it, read
from every import statement with `ast` (lazy and TYPE_CHECKING ones included;
tests/import_graph.py):

1. each product module imports only modules of its own layer or of the layers below it, in
   the order LAYERS gives (the doc's layer block lists the same entries in the same order);
2. the product imports no harness (`ultrafast_harness`), except the CLI files, lazily inside a
   function (`ultrafast bench` / `ultrafast loadtest` are user commands), and nothing outside
   the CLI files imports a CLI module;
3. there is no import cycle in `ultrafast` or `ultrafast_harness`;
4. no product function over 80 lines in server/, engine/, executors/, core/, and no file over
   500 lines outside tests/ (tests/unit/test_sizes.py).

The rules are written over packages and path prefixes, not a list of today's files: a new
module lands in its package's layer, and a new top-level module must be placed in LAYERS (and
in the doc) before the test passes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.import_graph import (
    ROOT,
    cycles,
    import_graph,
    imported_names,
    module_files,
    repository_graph,
)

# Bottom layer first. An entry is a module (`ultrafast/x.py`), a package (`ultrafast/p/`) or a
# file pattern (`ultrafast/cli*.py`); a module belongs to its longest matching entry, so
# `ultrafast/model/loader.py` sits above the rest of `ultrafast/model/`.
LAYERS: tuple[tuple[str, ...], ...] = (
    (  # foundations: configs and their flags, file formats' names, fetching files
        "ultrafast/__init__.py",
        "ultrafast/config.py",
        "ultrafast/config_flags.py",
        "ultrafast/server_config.py",
        "ultrafast/weight_format.py",
        "ultrafast/cpu_info.py",
        "ultrafast/cpu_contention.py",
        "ultrafast/heap_trim.py",
        "ultrafast/chat_templates.py",
        "ultrafast/model_defaults.py",
        "ultrafast/redis_conn.py",
        "ultrafast/progress.py",
        "ultrafast/local_tools.py",
        "ultrafast/corpus.py",
        "ultrafast/model_fetch.py",
        "ultrafast/model_fetch_gemma.py",
        "ultrafast/embed_fetch.py",
    ),
    ("ultrafast/grammar/",),
    ("ultrafast/request.py",),
    ("ultrafast/core/",),
    ("ultrafast/kvcache/",),
    ("ultrafast/model/", "ultrafast/convert.py"),
    ("ultrafast/quant/",),
    ("ultrafast/model/loader.py",),
    (
        "ultrafast/tokenizer.py",
        "ultrafast/grammar/tokenizer.py",
        "ultrafast/grammar/matcher.py",
        "ultrafast/grammar/deferred.py",
        "ultrafast/model_files.py",
    ),
    ("ultrafast/sampling/",),
    ("ultrafast/executors/",),
    ("ultrafast/engine/",),
    ("ultrafast/llm.py", "ultrafast/engine_sizing.py", "ultrafast/early_open.py"),
    (
        "ultrafast/quant/command.py",
        "ultrafast/quant/evaluate.py",
        "ultrafast/quant/policy.py",
        "ultrafast/quant/perplexity.py",
    ),
    ("ultrafast/server/",),
    ("ultrafast/cluster/",),
    ("ultrafast/cli*.py",),
)
HARNESS = "ultrafast_harness"
CLI_FILE = re.compile(r"(^|\.)cli(_[a-z_]+)?$")  # ultrafast.cli, ultrafast.cli_serve, ...
DOC = ROOT / "docs" / "ARCHITECTURE.md"

# None left: a module that needs a type of the one that builds it takes a Protocol instead
# (idle_speed.CoreView, ggml_calibration.CalibratedExecutor).
KNOWN_CYCLES: list[list[str]] = []


def _matches(entry: str, path: str) -> bool:
    if entry.endswith("/"):
        return path.startswith(entry)
    if "*" in entry:
        return re.fullmatch(re.escape(entry).replace(r"\*", "[^/]*"), path) is not None
    return path == entry


def layer_of(path: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """The index of the layer whose longest entry matches `path` (a/b/c.py), or None."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for index, entries in enumerate(layers):
        for entry in entries:
            if _matches(entry, path) and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]


def _path_of(module: str, files: dict[str, Path]) -> str:
    return files[module].relative_to(ROOT).as_posix()


def layer_violations(graph: dict[str, set[str]], paths: dict[str, str], layers=LAYERS) -> list[str]:
    """`a -> b` for each import of a module from a higher layer (and each product module in
    no layer). `paths` maps module names to their repository paths."""
    found = []
    for module, targets in sorted(graph.items()):
        if not module.startswith("ultrafast."):
            continue
        mine = layer_of(paths[module], layers)
        if mine is None:
            found.append(f"{paths[module]} is in no layer")
            continue
        for target in sorted(targets):
            theirs = layer_of(paths[target], layers) if target.startswith("ultrafast.") else 0
            if theirs is not None and theirs > mine:
                found.append(f"{module} -> {target}")
    return found


def _product_graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    files = module_files()
    return repository_graph(), {m: _path_of(m, files) for m in files}


def test_every_module_imports_only_its_layer_and_the_ones_below():
    graph, paths = _product_graph()
    assert len([m for m in graph if m.startswith("ultrafast.")]) > 150  # the walk found it
    assert layer_violations(graph, paths) == []


def test_the_layer_check_sees_an_upward_import_and_an_unplaced_module():
    sources = {
        "ultrafast.request": "from ultrafast.engine.core import EngineCore\n",
        "ultrafast.engine.core": "import ultrafast.request\n",
        "ultrafast.newthing": "",
    }
    paths = {
        "ultrafast.request": "ultrafast/request.py",
        "ultrafast.engine.core": "ultrafast/engine/core.py",
        "ultrafast.newthing": "ultrafast/newthing.py",
    }
    found = layer_violations(import_graph(sources), paths)
    assert found == [
        "ultrafast/newthing.py is in no layer",
        "ultrafast.request -> ultrafast.engine.core",
    ]
    assert layer_of("ultrafast/model/loader.py") > layer_of("ultrafast/quant/saved.py")
    assert layer_of("ultrafast/quant/saved.py") > layer_of("ultrafast/model/llama.py")
    assert layer_of("ultrafast/cli_serve.py") == len(LAYERS) - 1


def test_the_architecture_doc_lists_the_layers_in_this_order():
    """Every LAYERS entry appears in the doc's layer block, layer by layer from the bottom."""
    text = DOC.read_text(encoding="utf-8")
    block = text.split("## Layers and import rules", 1)[1].split("```", 2)[1]
    positions = []
    for entries in LAYERS:
        for entry in entries:
            assert entry in block, f"{entry} is not in ARCHITECTURE.md's layer block"
        positions.append(
            (min(block.index(e) for e in entries), max(block.index(e) for e in entries))
        )
    for (_, below_last), (above_first, _) in zip(positions, positions[1:]):
        assert below_last < above_first, "the doc's layer block is out of order"


def _lazy_imports(source: str, module: str) -> set[str]:
    """Names imported inside a function of `source`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for statement in node.body:
                body = ast.Module(body=[statement], type_ignores=[])
                names |= set(imported_names(ast.unparse(body), module))
    return names


def harness_imports(sources: dict[str, str]) -> list[str]:
    """Product modules importing the harness (a CLI file may, lazily)."""
    found = []
    for module, source in sorted(sources.items()):
        if not module.startswith("ultrafast."):
            continue
        wrong = {n for n in imported_names(source, module) if n.split(".")[0] == HARNESS}
        if CLI_FILE.search(module):
            wrong -= _lazy_imports(source, module)
        found += [f"{module} -> {name}" for name in sorted(wrong)]
    return found


def cli_imports(graph: dict[str, set[str]]) -> list[str]:
    """Modules other than the CLI files that import a CLI file."""
    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        if not CLI_FILE.search(module)
        for target in sorted(targets)
        if target.startswith("ultrafast.") and CLI_FILE.search(target)
    ]


def _sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in module_files().items()}


def test_the_product_imports_no_harness_and_only_the_cli_imports_the_cli():
    sources = _sources()
    assert any(m.startswith(HARNESS + ".") for m in sources)
    assert harness_imports(sources) == []
    assert cli_imports(repository_graph()) == []


def test_the_harness_checks_see_a_product_import_and_allow_a_lazy_cli_one():
    sources = {
        "ultrafast.cluster.process": "from ultrafast_harness.bench import server_process\n",
        "ultrafast.cli": "def run():\n    from ultrafast_harness.loadtest.runner import main\n",
        "ultrafast.cli_bench": "import ultrafast_harness.bench.decode\n",
        "ultrafast_harness.bench.tiers": "from ultrafast.cli_serve import add_engine_args\n",
        "ultrafast.cli_serve": "",
        "ultrafast_harness.bench.decode": "",
    }
    assert harness_imports(sources) == [
        "ultrafast.cli_bench -> ultrafast_harness.bench.decode",
        "ultrafast.cluster.process -> ultrafast_harness.bench",
        "ultrafast.cluster.process -> ultrafast_harness.bench.server_process",
    ]
    graph = import_graph(sources)
    assert cli_imports(graph) == ["ultrafast_harness.bench.tiers -> ultrafast.cli_serve"]


def test_no_import_cycles():
    found = cycles(repository_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert new == [], f"import cycles: {new}"


@pytest.mark.parametrize(
    "sources, expected",
    [
        ({"p.a": "import p.b\n", "p.b": "from p import a\n"}, [["p.a", "p.b"]]),
        (
            {
                "p.a": "def f():\n    from p.c import x\n",
                "p.b": "import p.a\n",
                "p.c": "import p.b",
            },
            [["p.a", "p.b", "p.c"]],
        ),
        ({"p.a": "import p.b\n", "p.b": "import os\n"}, []),
    ],
)
def test_the_cycle_finder_sees_direct_and_lazy_cycles(sources, expected):
    assert cycles(import_graph(sources)) == expected


def prometheus_importers(sources: dict[str, str]) -> list[str]:
    return sorted(
        module
        for module, source in sources.items()
        if module.startswith("ultrafast.")  # the product; the load test's client parses too
        and any(n.split(".")[0] == "prometheus_client" for n in imported_names(source, module))
    )


def test_only_the_server_imports_prometheus_client():
    found = prometheus_importers(_sources())
    assert found and all(m.startswith("ultrafast.server.") for m in found), found
    assert prometheus_importers({"ultrafast.engine.x": "import prometheus_client\n"}) == [
        "ultrafast.engine.x"
    ]
