"""The in-repo docs stay in step with the code: every reliability case code the code or the tests
cite has a row in docs/RELIABILITY.md, and the docs' relative links point at files inside the
repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASE_CODE = re.compile(r"\b[BFSL][0-9]{1,2}[a-z]?\b")
NOT_CASES = {"F32", "BF16"}  # GGUF tensor types, not case codes (F16 is both: it has a row)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def cited_codes() -> dict[str, str]:
    codes: dict[str, str] = {}
    for folder in ("ultrafast", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for code in CASE_CODE.findall(path.read_text(encoding="utf-8")):
                codes.setdefault(code, str(path.relative_to(ROOT)))
    return {c: p for c, p in codes.items() if c not in NOT_CASES}


def table_rows(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^\| ([A-Z]+[0-9]*[a-z]?) \|", text, re.M)}


def test_every_cited_case_code_has_a_row():
    rows = table_rows((ROOT / "docs" / "RELIABILITY.md").read_text(encoding="utf-8"))
    missing = {c: p for c, p in cited_codes().items() if c not in rows}
    assert not missing, f"cited without a row in docs/RELIABILITY.md: {missing}"


def test_the_row_finder_sees_a_missing_row():
    rows = table_rows("| B1 | x |\n| F3b | y |\nB2 in prose\n")
    assert rows == {"B1", "F3b"}


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():  # a clone has only the repo
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
