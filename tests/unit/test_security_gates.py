"""docs/RELIABILITY.md S5 grep gate: no unpickling, eval/exec, unsafe YAML, unsafe torch.load or an
unsandboxed Jinja environment anywhere in the package or scripts. A new use fails CI."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "ultrafast").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")])

FORBIDDEN = {
    "pickle.loads": re.compile(r"\bpickle\.loads?\("),
    "recv_pyobj": re.compile(r"\brecv_pyobj\("),
    "dill": re.compile(r"^\s*(import|from)\s+dill\b", re.M),
    "eval(": re.compile(r"(?<![.\w])eval\("),
    "exec(": re.compile(r"(?<![.\w])exec\("),
    "yaml.load without SafeLoader": re.compile(r"\byaml\.load\((?![^)]*SafeLoader)"),
    "torch.load without weights_only=True": re.compile(
        r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"
    ),
    "jinja2.Environment": re.compile(r"\b(jinja2\.)?(?<!Sandboxed)Environment\("),
}


def test_the_gate_sees_the_sources():
    assert len(SOURCES) > 20


@pytest.mark.parametrize("name", FORBIDDEN)
def test_no_forbidden_call(name):
    pattern = FORBIDDEN[name]
    hits = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for path in SOURCES
        for text in [path.read_text()]
        for m in pattern.finditer(text)
    ]
    assert not hits, f"{name} in {hits}"


@pytest.mark.parametrize(
    "line,name",
    [
        ("data = pickle.loads(blob)", "pickle.loads"),
        ("x = eval(text)", "eval("),
        ("cfg = yaml.load(f)", "yaml.load without SafeLoader"),
        ("sd = torch.load(path)", "torch.load without weights_only=True"),
        ("env = jinja2.Environment()", "jinja2.Environment"),
    ],
)
def test_the_gate_catches_each_pattern(line, name):
    assert FORBIDDEN[name].search(line)


@pytest.mark.parametrize(
    "line",
    [
        "model.eval()",
        "yaml.safe_load(f)",
        "yaml.load(f, Loader=yaml.SafeLoader)",
        "torch.load(path, weights_only=True)",
        "ImmutableSandboxedEnvironment(",
        "self.evaluate(x)",
    ],
)
def test_the_gate_allows_the_safe_forms(line):
    assert not any(p.search(line) for p in FORBIDDEN.values())
