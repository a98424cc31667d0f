"""bench/memory_plan.py writes docs/running.md's "Will it fit" table from memory.py's estimate."""

from __future__ import annotations

from pathlib import Path

from memory_plan import table


def test_the_docs_will_it_fit_table_is_the_estimates():
    running = (Path(__file__).resolve().parents[2] / "docs" / "running.md").read_text()
    assert table(16_384) in running
    assert "| Qwen3-4B (4.02B) | fits:" in running and "| Qwen3-8B (8.19B) | does not fit:" in running
