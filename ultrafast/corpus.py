"""The demo models' corpus: this interpreter's standard library, split by a hash of each file's
relative path so the split is the same on every machine (training, perplexity, calibration)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELDOUT_BUCKETS = 5  # sha256(relative path)[0] < 5 is held out (about 2% of the files)


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of this interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    held: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/"):
            continue
        bucket = hashlib.sha256(rel.encode()).digest()[0]
        (held if bucket < HELDOUT_BUCKETS else train).append(path)
    return train, held
