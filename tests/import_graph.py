"""The import graph of the repository's packages, read with `ast` (no module is imported):
every import statement, lazy ones inside functions and `TYPE_CHECKING` ones included.
Used by tests/unit/test_layers.py."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ultrafast", "ultrafast_harness")


def module_files(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (`pkg/__init__.py` is
    `pkg`)."""
    found: dict[str, Path] = {}
    for top in packages:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported_names(source: str, module: str, is_package: bool = False) -> list[str]:
    """Absolute dotted names each import statement of `module` names: `import a.b` gives
    `a.b`; `from a import b` gives `a` and `a.b` (b may be a module); relative imports are
    resolved against `module`'s package."""
    package = module if is_package else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def resolve(name: str, modules: Iterable[str]) -> str | None:
    """The module of ours `name` refers to: itself, or the nearest enclosing module (for
    `from pkg.mod import function`); None for a third-party name."""
    known = set(modules)
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(sources: dict[str, str], packages: set[str] | None = None) -> dict[str, set[str]]:
    """module -> the modules of ours it imports. `sources` maps module names to source text;
    `packages` names the modules that are packages (their `__init__`). An import of
    `pkg.mod` is an edge to `pkg.mod`, not to `pkg` (a package's `__init__` only when named
    itself), so a docstring-only `__init__` adds no edge."""
    packages = packages or set()
    graph: dict[str, set[str]] = {}
    for module, source in sources.items():
        edges = set()
        for name in imported_names(source, module, module in packages):
            target = resolve(name, sources)
            if target is not None and target != module:
                edges.add(target)
        # `from pkg import mod` names both `pkg` and `pkg.mod`: keep only the most precise
        graph[module] = {t for t in edges if not any(o.startswith(t + ".") for o in edges)}
    return graph


def repository_graph() -> dict[str, set[str]]:
    files = module_files()
    packages = {name for name, path in files.items() if path.name == "__init__.py"}
    return import_graph({name: path.read_text() for name, path in files.items()}, packages)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each
    sorted: every import cycle lies inside one of them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)
