"""BENCHMARKS.md, written by the benches that keep a section of it (`--write-benchmarks`)."""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def write_section(heading: str, section: str) -> None:
    """Replace the section that starts with `heading` (up to the next `## `), or append it,
    leaving the other sections alone."""
    text = BENCHMARKS.read_text() if BENCHMARKS.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(heading))
        text = text[:start] + section + (text[end + 1:] if end >= 0 else "")
    BENCHMARKS.write_text(text)
