"""The server sees the engine only through server/bridge.py (issue 16, part 2).

Allow-list, per importing module of ultrafast/server/ (every import statement, lazy ones
inside functions included, is read with `ast`):
- server/bridge.py may import anything.
- server/build.py may also import `ultrafast.llm` (it builds the engine: `build_engine`).
- every other server module may import ultrafast.server.*, ultrafast.request (the request
  contract every layer shares), ultrafast.config, ultrafast.tokenizer and third-party
  packages, but nothing from ultrafast.core, ultrafast.engine, ultrafast.executors,
  ultrafast.sampling or ultrafast.llm.
Everything else under `ultrafast.` not named above is allowed too (e.g. ultrafast.progress):
the rule is about the engine's packages.
"""

from __future__ import annotations

from pathlib import Path

import ultrafast.server
from tests.import_graph import imported_names

SERVER_DIR = Path(ultrafast.server.__file__).parent
ENGINE_PACKAGES = (
    "ultrafast.core",
    "ultrafast.engine",
    "ultrafast.executors",
    "ultrafast.sampling",
    "ultrafast.llm",
)
EXTRA_ALLOWED = {"bridge.py": ENGINE_PACKAGES, "build.py": ("ultrafast.llm",)}


def imported_modules(source: str, package: str) -> list[str]:
    """Absolute names of every module an import statement in `source` names; `package` is
    the importing module's package, for relative imports."""
    return imported_names(source, package, is_package=True)


def boundary_violations(source: str, package: str, allowed: tuple[str, ...] = ()) -> list[str]:
    def within(name: str, prefixes: tuple[str, ...]) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    return sorted(
        {
            name
            for name in imported_modules(source, package)
            if within(name, ENGINE_PACKAGES) and not within(name, allowed)
        }
    )


def test_no_server_module_but_the_bridge_imports_the_engine():
    files = sorted(SERVER_DIR.rglob("*.py"))
    assert len(files) > 10  # the walk found the package
    found = {}
    for path in files:
        rel = path.relative_to(SERVER_DIR)
        package = ".".join(("ultrafast", "server") + rel.parent.parts)
        bad = boundary_violations(path.read_text(), package, EXTRA_ALLOWED.get(str(rel), ()))
        if bad:
            found[str(rel)] = bad
    assert found == {}


def test_the_checker_catches_plain_from_lazy_and_relative_imports():
    source = (
        "import ultrafast.core.scheduler\n"
        "from ultrafast.engine.thread import EngineThread\n"
        "def f():\n    from ultrafast.executors import fake_exec\n"
        "from ...sampling import sampler\n"
        "from ultrafast import llm\n"
    )
    assert boundary_violations(source, "ultrafast.server.sessions") == [
        "ultrafast.core.scheduler",
        "ultrafast.engine.thread",
        "ultrafast.engine.thread.EngineThread",
        "ultrafast.executors",
        "ultrafast.executors.fake_exec",
        "ultrafast.llm",
        "ultrafast.sampling",
        "ultrafast.sampling.sampler",
    ]


def test_the_checker_lets_allowed_imports_through():
    source = (
        "from ultrafast.request import Request, ServiceTier\n"
        "from ultrafast.config import ServerConfig\n"
        "from ultrafast.server.bridge import EngineSnapshot\n"
        "from . import errors\nimport orjson\n"
    )
    assert boundary_violations(source, "ultrafast.server") == []
    assert (
        boundary_violations(
            "from ultrafast.llm import build_engine\n", "ultrafast.server", ("ultrafast.llm",)
        )
        == []
    )


def server_import_graph() -> dict[str, set[str]]:
    """module -> the ultrafast.server modules it imports (lazy imports included)."""
    modules = {}
    for path in sorted(SERVER_DIR.rglob("*.py")):
        rel = path.relative_to(SERVER_DIR)
        parts = ("ultrafast", "server") + rel.parent.parts
        name = ".".join(parts + (() if rel.stem == "__init__" else (rel.stem,)))
        modules[name] = (path, ".".join(parts))
    graph = {}
    for name, (path, package) in modules.items():
        graph[name] = {
            m
            for m in imported_modules(path.read_text(), package)
            if m in modules and m != name and not name.startswith(m + ".")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_server_modules_import_each_other_without_a_cycle():
    # the routes (app.py) sit on top; the call pipeline and the sessions below never reach up
    assert find_cycle(server_import_graph()) is None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
