"""Write a benchmark's JSON report and print its Markdown table (shared by every suite)."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out: str | Path, table: str) -> int:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table)
    print(f"\nwrote {out}")
    return 0
