"""docs/benchmarks-history.md: where every benchmark run appends its section (command, machine, figures)."""
from __future__ import annotations

from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "docs" / "benchmarks-history.md"


def append_section(lines: list[str]) -> None:
    with open(PATH, "a", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
    print(f"appended to {PATH}")
