"""The notebooks, executed top to bottom with nbclient so they never rot.

On a small hand-made warehouse their tables are checked against values counted by hand from
tests/factories.py: every rollout there makes two calls (step 0: attempt 0 fails with
NameError on `pirnt(1)`, attempt 1 succeeds with `print(1)`) and then answers. On a collected run
(the `small_run` fixture) they must run, and agree with what the run stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from cleaner.records import PurifiedRow, PurifyConfigRow
from cleaner.warehouse import Warehouse
from tests.factories import make_rollout, make_segments

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"


def purified(config_id: str, rollout_id: str, n_shallow: int, n_deep: int) -> PurifiedRow:
    return PurifiedRow(config_id, 0, rollout_id, "it0-p0", (1, 2), 1, (0, 1), (0.0, -0.5), (0.0, -0.5),
                       1.0, 0.0, True, n_shallow, n_deep, 0, 5, "test")


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory) -> Path:
    wh = Warehouse(tmp_path_factory.mktemp("notebooks") / "wh")
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
    return wh.root


def execute(name: str, warehouse: Path, monkeypatch, frames: list[str]) -> dict[str, list[dict]]:
    """Run a notebook on `warehouse` as Jupyter would (in its own directory); return the named
    frames of its namespace as rows, read from a cell appended to an in-memory copy."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(
        f"import json\nprint(json.dumps({{n: globals()[n].to_dicts() for n in {frames!r}}}, default=str))"))
    monkeypatch.setenv("CLEANER_WAREHOUSE", str(warehouse))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    NotebookClient(notebook, kernel_name="python3", timeout=120,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    (output,) = [o for o in notebook.cells[-1].outputs if o.output_type == "stream"]
    return json.loads(output.text)


def rows(frame: list[dict], *columns: str) -> list[tuple]:
    return [tuple(round(r[c], 3) if isinstance(r[c], float) else r[c] for c in columns) for r in frame]


def test_explore_notebook_on_a_hand_made_warehouse(hand_made, monkeypatch):
    out = execute("explore_warehouse.ipynb", hand_made, monkeypatch,
                  ["accuracy", "error_types", "recovery", "retries_per_step", "similarity_by_error", "premise",
                   "merges"])
    # rollouts, accuracy, failures/rollout, failed-call rate (1 of 2 calls), first-call error rate
    assert rows(out["accuracy"], "iteration", "rollouts", "accuracy", "failures_per_rollout", "failed_call_rate",
                "first_call_error_rate") == [(0, 2, 0.5, 1.0, 0.5, 1.0), (1, 1, 0.0, 1.0, 0.5, 1.0)]
    assert rows(out["error_types"], "iteration", "error", "count", "share") == [
        (0, "NameError", 2, 1.0), (1, "timeout", 1, 1.0)]
    # attempt 0 holds the failed call and the answering turn (no call); attempt 1 the fix
    assert rows(out["recovery"], "iteration", "attempt", "calls", "succeeded", "answered", "success_rate") == [
        (0, 0, 2, 0, 0, 0.0), (0, 1, 2, 2, 0, 1.0), (1, 0, 1, 0, 0, 0.0), (1, 1, 1, 1, 0, 1.0)]
    assert rows(out["retries_per_step"], "iteration", "retries", "steps") == [(0, 1, 2), (1, 1, 1)]
    # difflib: "pirnt(1)" vs "print(1)" match "p", "i" and "nt(1)": 2 * 7 / 16 = 0.875 >= gamma 0.5
    assert rows(out["similarity_by_error"], "error", "pairs", "mean_similarity", "shallow_share", "retry_ok") == [
        ("NameError", 2, 0.875, 1.0, 1.0), ("timeout", 1, 0.875, 1.0, 1.0)]
    # every rollout fixed its only failure: all recovered
    assert rows(out["premise"], "iteration", "class", "rollouts", "accuracy") == [
        (0, "recovered", 2, 0.5), (1, "recovered", 1, 0.0)]
    assert rows(out["merges"], "config_id", "shallow", "deep", "shallow_share") == [
        ("cfg-shallow", 2, 0, 1.0), ("cfg-deep", 1, 1, 0.5)]


def test_ablation_notebook_on_a_hand_made_warehouse(hand_made, monkeypatch):
    out = execute("ablation.ipynb", hand_made, monkeypatch, ["stats", "shift", "renderings"])
    assert rows(out["stats"], "config_id", "rollouts", "rolled_back", "shallow", "deep", "tokens_removed",
                "trained_tokens_per_row", "negatives", "shallow_share") == [
        ("cfg-shallow", 2, 2, 2, 0, 10, 1.0, 0, 1.0), ("cfg-deep", 2, 2, 1, 1, 10, 1.0, 0, 0.5)]
    # old and behaviour log-probs are equal on the one trained token of each row
    assert rows(out["shift"], "config_id", "trained_tokens", "mean_abs_logprob_gap") == [
        ("cfg-deep", 2, 0.0), ("cfg-shallow", 2, 0.0)]
    assert rows(out["renderings"], "renderings", "rollouts") == [(1, 2)]  # both configs render the same tokens


def test_both_notebooks_run_on_a_collected_run_and_agree_with_it(small_run, monkeypatch):
    warehouse = small_run / "warehouse"
    connection = Warehouse(warehouse).connect()
    explored = execute("explore_warehouse.ipynb", warehouse, monkeypatch, ["accuracy", "premise"])
    stored = connection.sql("SELECT iteration, accuracy, clean_rollouts, recovered_rollouts, unrecovered_rollouts "
                            "FROM iterations ORDER BY iteration").fetchall()
    assert rows(explored["accuracy"], "iteration", "accuracy") == [(i, round(a, 3)) for i, a, *_ in stored]
    counted = {(r["iteration"], r["class"]): r["rollouts"] for r in explored["premise"]}
    for iteration, _, *classes in stored:  # the run's premise diagnostic, from its iterations rows
        assert [counted.get((iteration, c), 0) for c in ("clean", "recovered", "unrecovered")] == classes
    ablation = execute("ablation.ipynb", warehouse, monkeypatch, ["stats"])
    assert [r["gamma"] for r in ablation["stats"]] == pytest.approx([0.3, 0.5, 0.9])  # iteration 1's grid
    assert all(r["rollouts"] == 16 for r in ablation["stats"])


def test_a_notebook_on_a_missing_warehouse_fails_with_its_name(tmp_path, monkeypatch):
    with pytest.raises(CellExecutionError, match="nowhere"):
        execute("explore_warehouse.ipynb", tmp_path / "nowhere", monkeypatch, [])


def test_notebooks_are_stored_without_outputs():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        for cell in notebook.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, path.name
