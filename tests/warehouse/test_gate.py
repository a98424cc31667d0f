"""The readers' gate (cleaner/warehouse/gate.py) as a fault x reader matrix, on a hand-built warehouse.

The warehouse (tests/factories.py): iteration 0 of one prompt, p0, planned as a group of four
rollouts r0..r3 in two collection parts (r0, r1 and r2, r3), each rollout a prompt, a NameError
fixed by a retry, and an answer; every rollout purified under the default purify config. Each
fault is made on a copy of it as a user (or an accident) would make it, and every reader then
refuses in one `error:` line naming what is wrong, or (show, report, ui) shows what is stored and
says the finding in one line; nothing is written, and the warehouse's data are as they were.
"""

from __future__ import annotations

import html
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import CollectConfig, PurifyConfig
from cleaner.ui.app import create_app
from cleaner.warehouse import Warehouse, schema
from cleaner.warehouse.browse import Browser
from cleaner.warehouse.compact import compact
from cleaner.warehouse.configs import CollectPlan
from cleaner.warehouse.gate import every_finding
from cleaner.warehouse.parts import write_part
from tests.factories import make_purified, make_purify_config, make_rollout, make_segments
from tests.helpers import assert_same_collection, comparable, tree_digest

runner = CliRunner()
CONFIG = PurifyConfig()  # the default config: what `cleaner purify` reads back
DATA = ("rollouts", "segments", "purified", "purify_configs", "configs", ".warehouse.json")


def build(root: Path, ids: tuple[str, ...] = ("r0", "r1", "r2", "r3")) -> Warehouse:
    wh = Warehouse(root)
    for batch in (ids[:2], ids[2:]):
        wh.write_rollouts(0, [make_rollout(r) for r in batch], [s for r in batch for s in make_segments(r)])
    row = make_purify_config(CONFIG.config_id)
    wh.write_purified(0, row, [make_purified(CONFIG.config_id, r) for r in ids])
    wh.save_collect_config(0, CollectConfig(n_prompts=1, group_size=len(ids)).to_json())
    wh.save_plan(0, CollectPlan(("p0",), len(ids)))
    return wh


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gate") / "wh"
    build(root)
    return root


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> Path:
    """Another warehouse with rollouts of other ids (a colleague's, another run's)."""
    root = tmp_path_factory.mktemp("other") / "wh"
    build(root, ("x0", "x1", "x2", "x3"))
    return root


def parts(root: Path, dataset: str) -> list[Path]:
    return sorted((root / dataset).rglob("part-*.parquet"))


def part_of(root: Path, dataset: str, rollout_id: str) -> Path:
    """The part of `dataset` holding a rollout's rows."""
    return next(p for p in parts(root, dataset) if rollout_id in pq.read_table(p, columns=["rollout_id"])[0].to_pylist())


def data_digest(root: Path) -> str:
    """What the warehouse stores, leaving out its caches and lock files (.manifest, .locks)."""
    return "".join(tree_digest(root / name) for name in DATA if (root / name).exists())


# ---------------------------------------------------------------------------------------------
# Faults: each makes its fault in the warehouse `root` and returns what a refusal must say


def copied_pair(root: Path, other: Path, holder) -> str:
    for dataset in ("rollouts", "segments"):
        shutil.copy(part_of(root, dataset, "r0"), root / dataset / "iteration=0" / "part-copy.parquet")
    return "part-copy.parquet: not a part this warehouse wrote (it is a copy of this warehouse's part rollouts/"


def copied_rollouts(root: Path, other: Path, holder) -> str:
    shutil.copy(part_of(root, "rollouts", "r0"), root / "rollouts" / "iteration=0" / "part-copy.parquet")
    return "part-copy.parquet: not a part this warehouse wrote (it is a copy of this warehouse's part rollouts/"


def copied_segments(root: Path, other: Path, holder) -> str:
    """A segments part copied alone: no rollouts part commits it, so no reader would read it, but it
    is not the warehouse's either, and no writer deletes it as a killed collection's leftover."""
    shutil.copy(part_of(root, "segments", "r0"), root / "segments" / "iteration=0" / "part-copy.parquet")
    return "part-copy.parquet: not a part this warehouse wrote (it is a copy of this warehouse's part segments/"


def foreign_pair(root: Path, other: Path, holder) -> str:
    for dataset in ("rollouts", "segments"):
        shutil.copy(parts(other, dataset)[0], root / dataset / "iteration=0")
    return f"{parts(other, 'rollouts')[0].name}: not a part this warehouse wrote (it was written by another warehouse"


def sql_copy(root: Path, other: Path, holder) -> str:
    """What `cleaner sql "COPY (SELECT * FROM rollouts) TO 'W/rollouts/iteration=0/part-evil.parquet'"` did."""
    evil = root / "rollouts" / "iteration=0" / "part-evil.parquet"
    Warehouse(root).connect().execute(f"COPY (SELECT * FROM rollouts) TO '{evil}' (FORMAT parquet)")
    return "part-evil.parquet: not a part this warehouse wrote (it carries no cleaner stamp"


def lost_segments(root: Path, other: Path, holder) -> str:
    part_of(root, "segments", "r0").unlink()  # r0 and r1's
    return "iteration 0: 2 rollouts have no segments (r0, r1): its rollouts part"


def lost_rollouts(root: Path, other: Path, holder) -> str:
    part_of(root, "rollouts", "r0").unlink()
    return "iteration 0 holds 2 of the 4 rollouts its collection planned: it was interrupted"


def every_rollouts_part_lost(root: Path, other: Path, holder) -> str:
    for part in parts(root, "rollouts"):
        part.unlink()
    return "iteration 0 holds 0 of the 4 rollouts its collection planned: it was interrupted"


def being_collected(root: Path, other: Path, holder) -> str:
    process = holder("collect:0:", root)
    return f"iteration 0 is being collected (it holds collect-iteration=0.lock: pid {process.pid} on "


ITERATION_FAULTS = [copied_pair, copied_rollouts, copied_segments, foreign_pair, sql_copy, lost_segments,
                    lost_rollouts, every_rollouts_part_lost, being_collected]


def duplicate_rows(root: Path, other: Path, holder) -> str:
    """What an older `cleaner ablate --gamma 0.5,0.5` stored: the config's rows once per repeat."""
    directory = root / "purified" / "iteration=0" / f"config={CONFIG.config_id}"
    rows = [make_purified(CONFIG.config_id, r) for r in ("r0", "r1", "r2", "r3")]
    write_part(directory, schema.to_table(schema.PURIFIED, rows), stamp=Warehouse(root).stamp)
    return f"purify config {CONFIG.config_id} of iteration 0 holds 2 rows for rollout r0 (in "


# ---------------------------------------------------------------------------------------------
# Readers that refuse


def _refusing(tmp: Path) -> dict[str, list[str]]:
    w = str(tmp / "wh")
    return {
        "purify": ["purify", "-w", w],
        "ablate": ["ablate", "-w", w, "--gamma", "0.5,0.9"],
        "export-sft": ["export", "-w", w, "--iteration", "0", "--format", "sft", "--out", str(tmp / "out")],
        "export-preference": ["export", "-w", w, "--iteration", "0", "--format", "preference", "--out", str(tmp / "out")],
        "export-messages": ["export", "-w", w, "--iteration", "0", "--format", "messages", "--out", str(tmp / "out")],
        "export-purified": ["export", "-w", w, "--iteration", "0", "--format", "sft", "--view", "purified",
                            "--out", str(tmp / "out")],
        "train": ["train", "-w", w, "--iteration", "0", "--config-id", CONFIG.config_id, "--policy", "{policy}",
                  "--out", str(tmp / "out")],
        "collect-resume": ["collect", "-w", w, "--prompts", "1", "--group-size", "4", "--resume"],
    }


READERS = list(_refusing(Path("/x")))
CONFIG_READERS = ["purify", "export-purified", "train"]  # the readers of the config's rows
# collect --resume repairs these two instead (tested with a real collection below); under a running
# collection it is refused by the lock, in the lock's words
RESUMED = {lost_segments: None, lost_rollouts: None, every_rollouts_part_lost: None,
           being_collected: "another process is collecting iteration 0 (it holds collect-iteration=0.lock"}
CASES = ([(fault, reader) for fault in ITERATION_FAULTS for reader in READERS
          if not (reader == "collect-resume" and fault in RESUMED and RESUMED[fault] is None)]
         + [(duplicate_rows, reader) for reader in CONFIG_READERS])


def _one_error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output
    return errors[0]


@pytest.mark.parametrize(("fault", "reader"), CASES, ids=[f"{f.__name__}-{r}" for f, r in CASES])
def test_a_reader_refuses_a_fault_in_one_line_and_writes_nothing(fault, reader, base, other, tmp_path, holder,
                                                                 tiny_qwen3_dir):
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    said = fault(root, other, holder)
    if reader == "collect-resume" and fault in RESUMED:
        said = RESUMED[fault]
    before = data_digest(root)
    args = [arg.replace("{policy}", str(tiny_qwen3_dir)) for arg in _refusing(tmp_path)[reader]]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert said in _one_error_line(result.output)
    assert data_digest(root) == before
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Readers that display: what is stored, and the finding in one line


@pytest.mark.parametrize("fault", [*ITERATION_FAULTS, duplicate_rows], ids=lambda f: f.__name__)
def test_the_displays_show_what_is_stored_and_say_the_finding(fault, base, other, tmp_path, holder):
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    said = fault(root, other, holder)
    before = data_digest(root)
    if fault is not every_rollouts_part_lost:  # else there is no rollout to show
        shown = runner.invoke(app, ["show", "r2", "-w", str(root), "--no-tokenizer"])  # r2's part is untouched
        assert shown.exit_code == 0, shown.output
        assert [line for line in shown.output.splitlines() if line.startswith("warning:")] and said in shown.output
    report = runner.invoke(app, ["report", "-w", str(root), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0 and said in report.output, report.output
    assert said in (tmp_path / "report" / "report.md").read_text()
    client = TestClient(create_app(Browser(Warehouse(root, read_only=True))), base_url="http://127.0.0.1")
    for page in ("/", "/rollouts", "/sql?q=select+1", *(["/rollouts/r2"] if fault is not every_rollouts_part_lost else [])):
        response = client.get(page)
        assert response.status_code == 200 and said in html.unescape(response.text), page
    check = runner.invoke(app, ["warehouse", "-w", str(root)])
    assert check.exit_code == 1 and said in check.output, check.output
    assert data_digest(root) == before


def test_show_of_a_rollout_that_lost_its_segments_says_why_it_cannot(base, other, tmp_path, holder):
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    said = lost_segments(root, other, holder)
    result = runner.invoke(app, ["show", "r0", "-w", str(root), "--no-tokenizer"])
    assert result.exit_code == 1 and said in _one_error_line(result.output)


def test_a_healthy_warehouse_passes_every_reader_that_needs_no_model(base, tmp_path):
    """The gate finds nothing in the warehouse the faults start from (so each finding above is the
    fault's)."""
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    check = runner.invoke(app, ["warehouse", "-w", str(root)])
    assert check.exit_code == 0 and "1 collected iteration(s), each whole" in check.output, check.output
    shown = runner.invoke(app, ["show", "r2", "-w", str(root), "--no-tokenizer"])
    assert shown.exit_code == 0 and "warning:" not in shown.output
    client = TestClient(create_app(Browser(Warehouse(root, read_only=True))), base_url="http://127.0.0.1")
    assert "Not as collected" not in client.get("/").text


# ---------------------------------------------------------------------------------------------
# collect --resume repairs what it can, and says what it cannot


def test_collect_resume_collects_again_the_rollouts_whose_segments_part_is_gone(tmp_path):
    """A real collection (the committed tiny policy, two parts of two rollouts): one segments part
    deleted, export refuses, and `--resume` collects those two rollouts again, the same ones (their
    seeds), after which every reader reads the iteration whole."""
    root = tmp_path / "wh"
    args = ["collect", "-w", str(root), "--prompts", "2", "--group-size", "2", "--batch-rollouts", "2",
            "--max-concurrent-rollouts", "2", "--sandbox-workers", "1"]
    assert runner.invoke(app, args).exit_code == 0
    collected = comparable(Warehouse(root).read_rollouts(0), Warehouse(root).read_segments(0))
    lost = parts(root, "segments")[0]
    gone = set(pq.read_table(lost, columns=["rollout_id"])[0].to_pylist())
    lost.unlink()
    export = ["export", "-w", str(root), "--iteration", "0", "--format", "sft", "--out", str(tmp_path / "out")]
    refused = runner.invoke(app, export)
    assert refused.exit_code == 1 and f"iteration 0: 2 rollouts have no segments ({', '.join(sorted(gone))})" in \
        _one_error_line(refused.output)
    resumed = runner.invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0 and "iteration 0: 2 rollouts written (4 planned)" in resumed.output, resumed.output
    assert_same_collection(comparable(Warehouse(root).read_rollouts(0), Warehouse(root).read_segments(0)), collected)
    assert every_finding(Warehouse(root)) == []
    assert runner.invoke(app, export).exit_code == 0


def test_collect_resume_says_it_cannot_repair_a_part_whose_rollouts_only_partly_lost_their_segments(tmp_path):
    """A rollouts part whose segments part holds some of its rollouts' segments: collecting the
    others again would store the rest twice, so the resume refuses and names them."""
    root = tmp_path / "wh"
    wh = Warehouse(root)
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1")], make_segments("r0"))
    before = data_digest(root)
    result = runner.invoke(app, ["collect", "-w", str(root), "--prompts", "1", "--group-size", "2", "--resume"])
    line = _one_error_line(result.output)
    assert result.exit_code == 1 and "iteration 0: 1 rollouts have no segments (r1): its segments part" in line
    assert "the part's other rollouts kept theirs, so they cannot be collected again" in line
    assert data_digest(root) == before


# ---------------------------------------------------------------------------------------------
# No duplicate rows by construction; what a reader says of a directory that is no warehouse


def test_a_grids_repeated_values_are_one_config_with_one_row_per_rollout(base, tmp_path):
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    result = runner.invoke(app, ["ablate", "-w", str(root), "--gamma", "0.3,0.3,0.30", "--rollback-prob", "1"])
    assert result.exit_code == 0 and result.output.rstrip().splitlines()[-1].startswith("1 config(s) in "), result.output
    (config_id,) = {PurifyConfig(gamma=0.3).config_id}
    rows = Warehouse(root).read_purified(0, config_id)
    assert sorted(row.rollout_id for row in rows) == ["r0", "r1", "r2", "r3"]
    assert every_finding(Warehouse(root)) == []


@pytest.mark.parametrize("reader", ["sql", "show", "report", "export", "purify", "check"])
def test_a_reader_pointed_at_a_run_directory_or_at_the_root_says_it_is_no_warehouse(reader, base, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir / "warehouse")
    (run_dir / "checkpoints").mkdir()
    for where, said in ((run_dir, f"{run_dir}: not a warehouse but a run directory: its warehouse is "
                                  f"{run_dir / 'warehouse'} (-w {run_dir / 'warehouse'})"),
                        (Path("/"), "/: not a warehouse: it holds none of a warehouse's folders")):
        args = {"sql": ["sql", "select count(*) from rollouts"], "show": ["show", "r0", "--no-tokenizer"],
                "report": ["report", "--out", str(tmp_path / "report")],
                "export": ["export", "--iteration", "0", "--format", "sft", "--out", str(tmp_path / "out")],
                "purify": ["purify"], "check": ["warehouse"]}[reader]
        result = runner.invoke(app, [*args, "-w", str(where)])
        assert result.exit_code == 1 and said in _one_error_line(result.output), result.output
    assert not (tmp_path / "report").exists() and not (tmp_path / "out").exists()
    empty = tmp_path / "new"
    empty.mkdir()  # a warehouse collect is about to fill: readers answer it, as an empty one
    answered = runner.invoke(app, ["sql", "select count(*) AS n from rollouts", "-w", str(empty), "-f", "csv"])
    assert answered.exit_code == 0 and answered.output.splitlines() == ["n", "0"]


def test_a_truncated_config_file_is_one_line_naming_it(base, tmp_path):
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    saved = root / "configs" / "collect-iteration=0.json"
    saved.write_text(saved.read_text()[:40])
    for args in (["purify"], ["export", "--iteration", "0", "--format", "sft", "--out", str(tmp_path / "out")],
                 ["show", "r0"]):
        result = runner.invoke(app, [*args, "-w", str(root)])
        line = _one_error_line(result.output)
        assert result.exit_code == 1 and line.startswith(f"error: {saved}: not a config cleaner wrote ("), result.output
        assert line.endswith("it is truncated or was edited: restore it from a copy of the warehouse")


def test_a_rollout_whose_segments_are_not_there_once_each_is_named(tmp_path):
    """The warehouse's own parts, yet a rollout's seqs repeat (a part an older cleaner wrote twice
    over): every reader refuses it, naming the rollout and its seqs."""
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1")],
                      make_segments("r0") + make_segments("r0") + make_segments("r1"))
    (line,) = every_finding(wh)
    assert line.startswith(f"{wh.root}: iteration 0: rollout r0 has 12 segments with 6 distinct seqs from 0 to 5, "
                           "not seq 0 to 11 once each: its segments were changed after it was committed")


def test_a_configs_rows_of_rollouts_the_iteration_does_not_hold_are_refused(base, tmp_path, tiny_qwen3_dir):
    """An iteration an older cleaner collected (no plan) whose rollouts parts were deleted: its
    purified rows are of rollouts it no longer holds, and training them is refused by name."""
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    (root / "configs" / "collect-plan-iteration=0.json").unlink()
    for part in parts(root, "rollouts"):
        part.unlink()
    args = _refusing(tmp_path)["train"]
    result = runner.invoke(app, [arg.replace("{policy}", str(tiny_qwen3_dir)) for arg in args])
    assert result.exit_code == 1 and (f"purify config {CONFIG.config_id} of iteration 0 holds rows of 4 rollouts the "
                                      "iteration does not hold (r0, r1, r2, ... (4 in all))") in _one_error_line(result.output)
    assert not (tmp_path / "out").exists()


def test_a_writer_removes_a_killed_collections_segments_part_but_not_a_copy(base, tmp_path):
    root = tmp_path / "wh"
    shutil.copytree(base, root)
    copy = root / "segments" / "iteration=0" / "part-copy.parquet"
    shutil.copy(part_of(root, "segments", "r0"), copy)
    killed = write_part(root / "segments" / "iteration=0", schema.to_table(schema.SEGMENTS, make_segments("r9")),
                        stamp=Warehouse(root).stamp)  # its rollouts part never written
    assert Warehouse(root).remove_uncommitted(0) == 1
    assert copy.exists() and not killed.exists()
    killed = write_part(killed.parent, schema.to_table(schema.SEGMENTS, make_segments("r9")), stamp=Warehouse(root).stamp)
    assert compact(root).n_leftovers == 1  # compaction, too
    assert copy.exists() and not killed.exists()
