"""Smoke test of the analysis notebook: run it as a script on a small hand-made warehouse.

The expected numbers are counted by hand from tests/warehouse/factories.py: every rollout there makes
two calls (step 0: attempt 0 fails, attempt 1 succeeds) and then answers.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from cleaner.engine.records import PurifiedRow, PurifyConfigRow
from cleaner.warehouse import Warehouse
from tests.warehouse.factories import make_rollout, make_segments

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore_warehouse.py"


def purified(config_id: str, rollout_id: str, n_shallow: int, n_deep: int) -> PurifiedRow:
    return PurifiedRow(config_id, 0, rollout_id, "it0-p0", (1, 2), 1, (0, 1), (0.0, -0.5), (0.0, -0.5),
                       1.0, 0.0, True, n_shallow, n_deep, 0, 5, "test")


def small_warehouse(root: Path) -> Warehouse:
    wh = Warehouse(root)
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                      make_segments("r0") + make_segments("r1"))
    timeout = [  # iteration 1: the first call times out instead of raising NameError
        dataclasses.replace(s, tool_status="timeout", error_type=None) if s.seq == 2 else s
        for s in make_segments("r2", iteration=1)
    ]
    wh.write_rollouts(1, [make_rollout("r2", iteration=1, reward=0.0)], timeout)
    wh.write_purified(0, PurifyConfigRow("cfg-shallow", 0.3, 1.0, "code", "always", "{}"),
                      [purified("cfg-shallow", "r0", 1, 0), purified("cfg-shallow", "r1", 1, 0)])
    wh.write_purified(0, PurifyConfigRow("cfg-deep", 0.9, 1.0, "code", "always", "{}"),
                      [purified("cfg-deep", "r0", 0, 1), purified("cfg-deep", "r1", 1, 0)])
    return wh


def table_rows(output: str, title: str) -> list[list[str]]:
    """The data rows of the polars table printed under `## title`."""
    section = output.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    body = section.split("╞", 1)[1].split("\n", 1)[1]
    return [[cell.strip(" │") for cell in line.split("┆")] for line in body.splitlines() if "┆" in line]


def test_notebook_runs_on_a_small_warehouse(tmp_path):
    wh = small_warehouse(tmp_path / "wh")
    result = subprocess.run([sys.executable, str(NOTEBOOK), str(wh.root)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # iteration, rollouts, accuracy, failures/rollout, failed-call rate (1 of 2 calls), first-call errors
    assert table_rows(out, "accuracy and tool failures per iteration") == [
        ["0", "2", "0.500", "1.000", "0.500", "1.000"],
        ["1", "1", "0.000", "1.000", "0.500", "1.000"],
    ]
    assert table_rows(out, "error types") == [["0", "NameError", "2", "1.000"], ["1", "timeout", "1", "1.000"]]
    # attempt 0 holds the failed call and the answering turn (no call); attempt 1 the fix
    assert table_rows(out, "recovery by attempt") == [
        ["0", "0", "2", "0", "0", "0.000"], ["0", "1", "2", "2", "0", "1.000"],
        ["1", "0", "1", "0", "0", "0.000"], ["1", "1", "1", "1", "0", "1.000"],
    ]
    merges = table_rows(out, "shallow vs deep per purify config")
    assert [(row[1], row[4], row[5], row[-1]) for row in merges] == [
        ("cfg-shallow", "2", "0", "1.000"), ("cfg-deep", "1", "1", "0.500")]


def test_notebook_on_a_missing_warehouse_fails_with_its_name(tmp_path):
    result = subprocess.run([sys.executable, str(NOTEBOOK), str(tmp_path / "nowhere")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "nowhere" in result.stderr
