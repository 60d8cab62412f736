"""Where the tests and benchmarks find the binaries the setup places beside the project.

`make setup` (scripts/fetch_tools.sh) unpacks redis-server and promtool into `.tools/bin` of the
checkout instead of installing system packages (which would register services). A tool is taken
from `$ULTRAFAST_TOOLS_DIR/bin` when that is set, else from the checkout's `.tools/bin`, else
from PATH (a machine that has it already).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def tools_bin() -> Path:
    env = os.environ.get("ULTRAFAST_TOOLS_DIR")
    return (Path(env) if env else REPO_ROOT / ".tools") / "bin"


def find_tool(name: str) -> str | None:
    """The path of the executable `name`: the project's tool folder first, then PATH."""
    candidate = tools_bin() / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which(name)
