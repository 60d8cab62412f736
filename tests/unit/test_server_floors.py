"""The server's floors (ARCHITECTURE.md, "server/"): front ends by API on top, the call
pipeline, the prompt step and the session store below them; no arrow runs back up.

- only app.py (which assembles the routes) and the front ends themselves import
  `ultrafast.server.frontends`;
- the session store (`server/sessions/`) imports no front end, no route, and neither the call
  pipeline's entry (`calls.py`) nor `state.py` (which holds a `SessionFlow`);
- the prompt step (`server/prompt/`) imports no other server module.
Every import statement (lazy ones too) is read with `ast` (test_server_import_boundary.py).
"""

from __future__ import annotations

from tests.unit.test_server_import_boundary import server_import_graph

S = "ultrafast.server"
FRONTENDS = f"{S}.frontends"


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import that breaks the floors above."""
    found = []
    for module, imported in graph.items():
        for target in imported:
            if _under(target, FRONTENDS) and not (
                module == f"{S}.app" or _under(module, FRONTENDS)
            ):
                found.append((module, target))
            elif _under(module, f"{S}.sessions") and (
                _under(target, FRONTENDS) or target in {f"{S}.app", f"{S}.calls", f"{S}.state"}
            ):
                found.append((module, target))
            elif _under(module, f"{S}.prompt") and not _under(target, f"{S}.prompt"):
                found.append((module, target))
    return sorted(found)


def test_no_import_runs_back_up_the_server_floors():
    graph = server_import_graph()
    assert f"{S}.sessions.flow" in graph and f"{S}.prompt.chat_tokens" in graph
    assert f"{FRONTENDS}.responses" in graph and f"{FRONTENDS}.chat" in graph
    assert upward_imports(graph) == []


def test_the_floor_check_finds_each_kind_of_upward_import():
    graph = {
        f"{S}.tools.realtime_events": {f"{FRONTENDS}.conversations"},
        f"{S}.sessions.flow": {f"{S}.state", f"{S}.sessions.store", f"{S}.prompt"},
        f"{S}.sessions.store": {f"{FRONTENDS}.replay"},
        f"{S}.prompt.chat_tokens": {f"{S}.prompt.client_text", f"{S}.calls"},
        f"{S}.app": {f"{FRONTENDS}.chat"},
        f"{FRONTENDS}.chat": {f"{FRONTENDS}.replay", f"{S}.calls", f"{S}.sessions.flow"},
    }
    assert upward_imports(graph) == [
        (f"{S}.prompt.chat_tokens", f"{S}.calls"),
        (f"{S}.sessions.flow", f"{S}.state"),
        (f"{S}.sessions.store", f"{FRONTENDS}.replay"),
        (f"{S}.tools.realtime_events", f"{FRONTENDS}.conversations"),
    ]
