"""Small files and functions (docs/ARCHITECTURE.md, "Layers and import rules"): no function of
more than 80 lines in the product's server/, engine/, executors/ and core/, and no Python file
of more than 500 lines outside tests/ (the product, the harness, scripts/). Read with `ast`;
a nested function counts within the function that holds it."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import ROOT

MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 500
FUNCTION_DIRS = ("ultrafast/server", "ultrafast/engine", "ultrafast/executors", "ultrafast/core")
FILE_DIRS = ("ultrafast", "ultrafast_harness", "scripts")

# No exceptions: a file or function that outgrows the limit is split by meaning.
KNOWN_LONG_FILES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Names of the outermost functions (and methods) of `source` longer than `limit` lines."""
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                if child.end_lineno - child.lineno + 1 > limit:
                    found.append(child.name)
            elif isinstance(child, ast.ClassDef):
                visit(child)

    visit(ast.parse(source))
    return found


def _files(dirs: tuple[str, ...]) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py"))]


def test_no_product_function_over_80_lines():
    files = _files(FUNCTION_DIRS)
    assert len(files) > 50  # the walk found the packages
    found = {
        f"{path.relative_to(ROOT).as_posix()}:{name}"
        for path in files
        for name in long_functions(path.read_text(encoding="utf-8"))
    }
    assert found - KNOWN_LONG_FUNCTIONS == set()


def test_no_file_over_500_lines_outside_tests():
    found = {
        path.relative_to(ROOT).as_posix()
        for path in _files(FILE_DIRS)
        if len(path.read_text(encoding="utf-8").splitlines()) > MAX_FILE_LINES
    }
    assert found - KNOWN_LONG_FILES == set()


def test_the_size_checks_see_a_long_function_and_method():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))  # 81 lines with its `def`
    assert long_functions("def long():\n" + body) == ["long"]
    assert long_functions("class C:\n    def m(self):\n" + body.replace("    ", "        ")) == [
        "m"
    ]
    assert long_functions("def short():\n" + "    x = 1\n" * 79) == []
