"""`cleaner report`: every figure the warehouse allows as a PNG of the declared size, report.md embedding
them, and a line saying why for each one it does not."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import matplotlib.image
import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.report.figures import HEIGHT_PX, WIDTH_PX, eval_series
from cleaner.report.job import report_job
from cleaner.warehouse import Warehouse, queries
from tests.factories import make_eval_run, make_rollout, make_segments
from tests.helpers import tree_digest

runner = CliRunner()


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", path
    return struct.unpack(">II", header[16:24])


def assert_drawn(path: Path) -> None:
    """A PNG of the report's size that is not one flat colour."""
    assert png_size(path) == (WIDTH_PX, HEIGHT_PX)
    pixels = matplotlib.image.imread(path)
    assert pixels.std() > 0.01, f"{path} is blank"


def embedded(page: Path) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text())


def test_report_of_a_run_draws_every_figure_and_embeds_it(small_run, tmp_path):
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", "-w", str(small_run / "warehouse"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    expected = ["accuracy.png", "failures.png", "merges.png", "premise.png", "train.png", "error_types.png",
                "ablation-iteration-1.png"]
    assert embedded(out / "report.md") == expected
    for name in expected:
        assert_drawn(out / name)
    page = (out / "report.md").read_text()
    assert "Skipped" not in page and "Eval" not in page  # no eval_runs: no eval section at all
    assert "32 rollouts in 2 collected iteration(s), 2 completed `cleaner run` iteration(s), 4 optimiser" in page
    # the ablation table: the run's config and the two added ones, each over iteration 1's 16 rollouts
    rows = [line for line in page.splitlines() if line.startswith("| γ=")]
    assert [row.split(" | ")[0] for row in rows] == ["| γ=0.3 p=1", "| γ=0.5 p=1", "| γ=0.9 p=1"]
    assert all(row.split(" | ")[2] == "16" for row in rows)


def test_report_says_what_a_collect_only_warehouse_lacks(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                      make_segments("r0") + make_segments("r1"))
    result = runner.invoke(app, ["report", "-w", str(wh.root)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "wh-report"  # the default: beside the warehouse, named after it
    assert embedded(out / "report.md") == ["error_types.png"]
    assert_drawn(out / "error_types.png")
    page = (out / "report.md").read_text()
    skipped = re.findall(r"## (.+)\n\n\*Skipped: (.+)\.\*", page)
    no_run = "no `iterations` rows: this warehouse holds no completed `cleaner run` iteration"
    assert skipped == [
        ("Accuracy", no_run), ("Tool failures", no_run), ("SAAR merges", no_run), ("Premise diagnostic", no_run),
        ("Train metrics", "no `train_steps` rows: nothing was trained into this warehouse"),
        ("Ablation grid", "no ablation: no iteration is purified under two or more configs "
                          "(`cleaner ablate` makes one)"),
    ]
    assert sorted(p.name for p in out.iterdir()) == [".cleaner-output.json", "error_types.png", "report.md"]


def test_report_plots_the_eval_runs_of_the_warehouse(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    for eval_id, model, dataset, avg, failures in [("e1", "tiny", "toy", 0.25, 1.5), ("e2", "tiny", "toy", 0.75, 0.5),
                                                   ("e3", "tiny", "gsm8k", 0.125, 2.0), ("e4", "base", "toy", 0.5, 1.0)]:
        wh.write_eval_run(make_eval_run(eval_id, False, model=model, dataset=dataset, avg_at_n=avg,
                                        pass_at_k=((1, avg),), failures_per_trajectory=failures))
    written = report_job(wh, tmp_path / "out")
    assert_drawn(tmp_path / "out" / "eval.png")
    assert [s.title for s in written.sections if s.file] == ["Error types", "Eval results"]
    page = (tmp_path / "out" / "report.md").read_text()
    assert '| tiny | gsm8k | false | 0.125 | {1=0.125} | 2.000 |' in page
    # a repeated (model, dataset) is averaged; one saar setting: series are the models
    assert eval_series(queries.eval_results(wh.connect())).sort("dataset", "series").rows() == [
        ("gsm8k", "tiny", 0.125, 2.0), ("toy", "base", 0.5, 1.0), ("toy", "tiny", 0.5, 1.0)]


def test_report_out_at_a_file_is_one_error_line(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    (tmp_path / "taken").write_text("not a directory")
    result = runner.invoke(app, ["report", "-w", str(wh.root), "--out", str(tmp_path / "taken")])
    assert result.exit_code == 1
    assert "error:" in result.output and "not a directory" in result.output and "Traceback" not in result.output
    assert (tmp_path / "taken").read_text() == "not a directory"


def test_report_of_a_missing_warehouse_is_one_error_line(tmp_path):
    result = runner.invoke(app, ["report", "-w", str(tmp_path / "nowhere")])
    assert result.exit_code == 1
    assert "error:" in result.output and "nowhere" in result.output and "Traceback" not in result.output


def _collected(root: Path) -> Warehouse:
    warehouse = Warehouse(root)
    warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    return warehouse


def test_sibling_warehouses_get_their_own_default_report(tmp_path):
    first, second = _collected(tmp_path / "first"), _collected(tmp_path / "second")
    second.write_eval_run(make_eval_run("e1", False))
    for warehouse in (first, second):
        assert runner.invoke(app, ["report", "-w", str(warehouse.root)]).exit_code == 0
    assert "Eval results" not in (tmp_path / "first-report" / "report.md").read_text()
    assert "Eval results" in (tmp_path / "second-report" / "report.md").read_text()
    assert not (tmp_path / "report").exists()


def test_a_report_replaces_the_previous_report_whole(tmp_path):
    warehouse = _collected(tmp_path / "wh")
    warehouse.write_eval_run(make_eval_run("e1", False))
    report_job(warehouse, tmp_path / "out")
    assert (tmp_path / "out" / "eval.png").exists()
    report_job(_collected(tmp_path / "other"), tmp_path / "out")  # no evals: no eval.png
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".cleaner-output.json", "error_types.png",
                                                                     "report.md"]


def test_report_out_at_a_warehouse_or_a_users_directory_is_refused_untouched(tmp_path):
    warehouse = _collected(tmp_path / "wh")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    refusals = {warehouse.root: f"--out {warehouse.root} is inside the warehouse {warehouse.root}",
                mine: f"{mine}: will not replace it with a report: cleaner did not write it"}
    for out, says in refusals.items():
        before = tree_digest(out)
        result = runner.invoke(app, ["report", "-w", str(warehouse.root), "--out", str(out)])
        output = " ".join(result.output.split())
        assert result.exit_code == 1 and output.count("error:") == 1 and "Traceback" not in output, output
        assert says in output
        assert tree_digest(out) == before


def test_report_out_inside_the_warehouse_is_refused_and_nothing_is_written(tmp_path):
    """A report in a partition would be a foreign file every reader trips on; a link into the
    warehouse is inside it too."""
    warehouse = _collected(tmp_path / "wh")
    (tmp_path / "link").symlink_to(warehouse.root / "rollouts")
    before = tree_digest(warehouse.root)
    for out in (warehouse.root / "rollouts" / "iteration=0" / "report", tmp_path / "link" / "report"):
        result = runner.invoke(app, ["report", "-w", str(warehouse.root), "--out", str(out)])
        output = " ".join(result.output.split())
        assert result.exit_code == 1 and output.count("error:") == 1 and "Traceback" not in output, output
        assert f"--out {out} is inside the warehouse {warehouse.root}" in output
    assert tree_digest(warehouse.root) == before


@pytest.mark.parametrize("umask", [0o022, 0o077], indirect=True)
def test_a_report_is_made_as_mkdir_and_open_make_them(tmp_path, umask):
    from tests.helpers import wrong_modes

    report_job(_collected(tmp_path / "wh"), tmp_path / "out")
    assert (tmp_path / "out" / "report.md").is_file() and wrong_modes(tmp_path / "out", umask) == []
