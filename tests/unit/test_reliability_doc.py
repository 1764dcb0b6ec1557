"""RELIABILITY.md is a promise: every row names a test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_reliability_row_names_tests_that_exist() -> None:
    rows = [line for line in (ROOT / "RELIABILITY.md").read_text().splitlines()
            if line.startswith("|") and not line.startswith(("| Fault", "|---"))]
    assert len(rows) >= 30
    missing = []
    for row in rows:
        named, current = 0, None
        for m in re.finditer(r"`(tests/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`", row):
            current = m.group(1) or current
            name = m.group(2) or m.group(3)
            assert current is not None, row
            path = ROOT / current
            if not path.exists() or (name and not re.search(rf"def {name}\b", path.read_text())):
                missing.append(f"{current}::{name}")
            named += 1
        assert named, f"a row names no test: {row[:80]}"
    assert not missing, missing
