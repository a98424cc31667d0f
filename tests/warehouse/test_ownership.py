"""Which parts a warehouse wrote (cleaner/warehouse/ownership.py), and settling the others
(foreign.py, `cleaner warehouse [--adopt|--remove PART]`): a stamp in every part's footer names the
warehouse and the part's path; a copy, a rename, another warehouse's part or another program's file
is named and left out of every view until it is adopted or removed; an older cleaner's parts stay
the warehouse's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse.compact import compact
from cleaner.warehouse.foreign import adopt, remove
from cleaner.warehouse.gate import every_finding
from cleaner.warehouse.ownership import IDENTITY_FILE, STAMP_KEY
from cleaner.warehouse.parts import list_parts, new_merged_name, write_merged, write_part
from tests.factories import make_eval_run, make_rollout, make_segments
from tests.helpers import tree_digest

runner = CliRunner()


def _batch(wh: Warehouse, ids: tuple[str, ...]) -> None:
    wh.write_rollouts(0, [make_rollout(r) for r in ids], [s for r in ids for s in make_segments(r)])


def _ids(wh: Warehouse) -> list[str]:
    return sorted(r.rollout_id for r in wh.read_rollouts(0))


def _view_ids(wh: Warehouse) -> list[str]:
    return sorted(row[0] for row in wh.connect().execute("SELECT rollout_id FROM rollouts").fetchall())


def _only(root: Path, dataset: str) -> Path:
    (part,) = list_parts(root, schema.DATASETS[dataset])
    return part


def _pair_from(other: Path, root: Path) -> Path:
    """Copy another warehouse's collection part (rollouts and segments) into `root`; the rollouts copy."""
    for dataset in ("rollouts", "segments"):
        shutil.copy(_only(other, dataset), root / dataset / "iteration=0")
    return root / "rollouts" / "iteration=0" / _only(other, "rollouts").name


@pytest.fixture
def two(tmp_path) -> tuple[Warehouse, Warehouse]:
    """Ours, holding r0 and r1; another, holding x0 and x1."""
    ours, theirs = Warehouse(tmp_path / "ours"), Warehouse(tmp_path / "theirs")
    _batch(ours, ("r0", "r1"))
    _batch(theirs, ("x0", "x1"))
    return ours, theirs


def test_every_part_names_its_warehouse_and_its_path(two):
    ours, _ = two
    identity = json.loads((ours.root / IDENTITY_FILE).read_text())
    for dataset in ("rollouts", "segments"):
        part = _only(ours.root, dataset)
        stamp = json.loads(pq.read_schema(part).metadata[STAMP_KEY])
        assert stamp == {"warehouse": identity["id"], "path": f"{dataset}/iteration=0/{part.name}"}
    assert identity["legacy"] == []
    assert schema.ROLLOUTS.schema.metadata is None and pq.read_table(_only(ours.root, "rollouts")).num_rows == 2


def test_a_copy_and_another_warehouses_part_are_left_out_named_and_never_entered_in_the_manifest(two):
    ours, theirs = two
    own = _only(ours.root, "rollouts")
    shutil.copy(own, ours.root / "rollouts" / "iteration=0" / "part-copy.parquet")
    theirs_part = _pair_from(theirs.root, ours.root)
    for _ in range(2):  # never entered, so judged again at every read
        assert _ids(ours) == _view_ids(ours) == ["r0", "r1"]  # each once: the others are left out
        reasons = {Path(line.split(": not a part")[0]).name: line for line in every_finding(Warehouse(ours.root))}
        assert sorted(reasons) == sorted(["part-copy.parquet", theirs_part.name])
        assert "(it is a copy of this warehouse's part rollouts/iteration=0/part-" in reasons["part-copy.parquet"]
        their_id = json.loads((theirs.root / IDENTITY_FILE).read_text())["id"]
        assert f"(it was written by another warehouse (id {their_id}) as rollouts/iteration=0/" in reasons[theirs_part.name]
        manifest = json.loads((ours.root / ".manifest" / "rollouts.json").read_text())["parts"]
        assert sorted(manifest) == [f"iteration=0/{own.name}"]


def test_a_file_written_by_another_program_carries_no_stamp(two):
    ours, _ = two
    evil = ours.root / "rollouts" / "iteration=0" / "part-evil.parquet"
    ours.connect().execute(f"COPY (SELECT * FROM rollouts) TO '{evil}' (FORMAT parquet)")
    (line,) = every_finding(Warehouse(ours.root))
    assert line.startswith(f"{evil}: not a part this warehouse wrote (it carries no cleaner stamp: a file copied in "
                           "or written by another program (e.g. `COPY ... TO`)); every reader refuses iteration 0 "
                           f"until `cleaner warehouse -w {ours.root} --adopt {evil}` makes its rows the warehouse's or `--remove {evil}` "
                           "deletes it")
    assert _view_ids(ours) == ["r0", "r1"]


def test_a_part_restored_under_its_own_name_is_the_warehouses_again(two, tmp_path):
    ours, _ = two
    backup = tmp_path / "backup"
    shutil.copytree(ours.root, backup)
    _only(ours.root, "segments").unlink()
    assert every_finding(Warehouse(ours.root))  # r0 and r1 lost their segments
    shutil.copy(_only(backup, "segments"), ours.root / "segments" / "iteration=0")
    assert every_finding(Warehouse(ours.root)) == []
    assert every_finding(Warehouse(backup)) == []  # a copy of the whole warehouse is the warehouse


def test_an_older_cleaners_parts_stay_the_warehouses_and_later_unstamped_ones_do_not(tmp_path):
    """Parts written before stamps: with no identity file every part is taken as it is; the first
    stamping write lists them as the warehouse's; an unstamped part that turns up after is not."""
    root = tmp_path / "wh"
    for dataset, rows in (("segments", make_segments("r0")), ("rollouts", [make_rollout("r0")])):
        write_part(root / dataset / "iteration=0", schema.to_table(schema.DATASETS[dataset], rows), "part-old.parquet")
    assert every_finding(Warehouse(root)) == [] and _ids(Warehouse(root)) == ["r0"]
    assert not (root / IDENTITY_FILE).exists()  # readers make no identity
    _batch(Warehouse(root), ("r1",))
    legacy = json.loads((root / IDENTITY_FILE).read_text())["legacy"]
    assert legacy == ["rollouts/iteration=0/part-old.parquet", "segments/iteration=0/part-old.parquet"]
    shutil.rmtree(root / ".manifest")  # a cache: the list alone keeps them the warehouse's
    assert every_finding(Warehouse(root)) == [] and _ids(Warehouse(root)) == ["r0", "r1"]
    for dataset, rows in (("segments", make_segments("r2")), ("rollouts", [make_rollout("r2")])):
        write_part(root / dataset / "iteration=0", schema.to_table(schema.DATASETS[dataset], rows), "part-late.parquet")
    assert ["it carries no cleaner stamp" in line for line in every_finding(Warehouse(root))] == [True]
    assert _ids(Warehouse(root)) == ["r0", "r1"]


def test_a_foreign_merged_part_hides_none_of_the_warehouses_parts(two):
    ours, _ = two
    own = _only(ours.root, "rollouts")
    merged = write_merged(own.parent, new_merged_name(), [pq.read_table(own)], schema.ROLLOUTS, [own.name])
    assert _view_ids(ours) == ["r0", "r1"] and own.exists()
    assert [line.startswith(f"{merged}: not a part this warehouse wrote") for line in every_finding(ours)] == [True]
    with pytest.raises(WarehouseError, match=f"cannot compact {merged}: not a part"):  # after its roll-forward,
        compact(ours.root)  # which honours only the warehouse's own merged parts
    assert own.exists() and merged.exists() and _view_ids(ours) == ["r0", "r1"]


def test_compaction_merges_no_part_the_warehouse_did_not_write(two):
    ours, theirs = two
    _batch(ours, ("r2",))
    foreign = _pair_from(theirs.root, ours.root)
    before = tree_digest(ours.root / "rollouts") + tree_digest(ours.root / "segments")
    with pytest.raises(WarehouseError, match=f"cannot compact {foreign}: not a part this warehouse wrote"):
        compact(ours.root)
    assert tree_digest(ours.root / "rollouts") + tree_digest(ours.root / "segments") == before


def test_adopting_a_part_makes_its_rows_the_warehouses_with_its_twin(two):
    ours, theirs = two
    foreign = _pair_from(theirs.root, ours.root)
    settled = adopt(ours.root, foreign)
    assert not foreign.exists() and not (ours.root / "segments" / "iteration=0" / foreign.name).exists()
    assert [p.parent.parent.name for p in settled.written] == ["segments", "rollouts"]
    assert settled.written[0].name == settled.written[1].name and settled.written[0].name.startswith("part-merged-")
    assert every_finding(Warehouse(ours.root)) == []
    assert _ids(Warehouse(ours.root)) == _view_ids(Warehouse(ours.root)) == ["r0", "r1", "x0", "x1"]
    assert len(Warehouse(ours.root).read_segments(0, {"x0"})) == len(make_segments("x0"))


def test_an_adopted_copy_is_then_a_rollout_stored_twice(two):
    ours, _ = two
    copy = ours.root / "rollouts" / "iteration=0" / "part-copy.parquet"
    shutil.copy(_only(ours.root, "rollouts"), copy)
    adopt(ours.root, copy)
    (line,) = every_finding(Warehouse(ours.root))
    assert "iteration 0: rollout r0 is stored 2 times (in " in line


def test_removing_a_part_deletes_it_and_its_foreign_twin_only(two, tmp_path):
    ours, theirs = two
    before = tree_digest(ours.root / "rollouts") + tree_digest(ours.root / "segments")
    foreign = _pair_from(theirs.root, ours.root)
    settled = remove(ours.root, foreign)
    assert [p.parent.parent.name for p in settled.files] == ["rollouts", "segments"]
    assert tree_digest(ours.root / "rollouts") + tree_digest(ours.root / "segments") == before
    assert every_finding(Warehouse(ours.root)) == []


def test_adopt_and_remove_refuse_a_part_the_warehouse_wrote_or_a_path_outside_it(two, tmp_path):
    ours, theirs = two
    own = _only(ours.root, "rollouts")
    before = tree_digest(ours.root / "rollouts") + tree_digest(ours.root / "segments")
    for settle in (adopt, remove):
        with pytest.raises(WarehouseError, match=f"{own}: a part this warehouse wrote; adopt and remove settle only"):
            settle(ours.root, own)
        with pytest.raises(WarehouseError, match="not in the warehouse"):
            settle(ours.root, _only(theirs.root, "rollouts"))
        with pytest.raises(WarehouseError, match="not a part file of the warehouse"):
            settle(ours.root, ours.root / IDENTITY_FILE)
    assert tree_digest(ours.root / "rollouts") + tree_digest(ours.root / "segments") == before


def test_the_commands_say_what_they_did_in_one_line_each(two):
    ours, theirs = two
    foreign = _pair_from(theirs.root, ours.root)
    checked = runner.invoke(app, ["warehouse", "-w", str(ours.root)])
    lines = checked.output.splitlines()
    assert checked.exit_code == 1 and lines[0].startswith(f"{foreign}: not a part this warehouse wrote")
    assert lines[-1] == f"error: {ours.root}: 1 finding(s) above; every reader refuses what they name"
    adopted = runner.invoke(app, ["warehouse", "-w", str(ours.root), "--adopt", str(foreign)])
    assert adopted.exit_code == 0 and adopted.output.startswith(f"adopted {foreign}: its rows are in ")
    refused = runner.invoke(app, ["warehouse", "-w", str(ours.root), "--remove", str(foreign)])
    assert refused.exit_code == 1 and refused.output.startswith(f"error: {foreign}: not a part file")
    clean = runner.invoke(app, ["warehouse", "-w", str(ours.root)])
    assert clean.exit_code == 0 and "every part the warehouse's own" in clean.output


def test_a_warehouse_copied_without_its_identity_file_says_so_and_writes_nothing(two, tmp_path):
    """`cp -r W/* elsewhere` leaves the hidden files behind: its parts' stamps name a warehouse it
    cannot prove it is, so readers say to copy the file back, and a writer refuses rather than make
    a new id that would disown every part."""
    ours, _ = two
    copy = tmp_path / "copy"
    shutil.copytree(ours.root, copy, ignore=shutil.ignore_patterns(".*"))
    lines = every_finding(Warehouse(copy))
    assert len(lines) == 1 and f"{copy / IDENTITY_FILE}, which says whose parts are this warehouse's, is missing" \
        in lines[0] and "copy that file back" in lines[0]
    with pytest.raises(WarehouseError, match=f"{copy / IDENTITY_FILE} is missing; copy it back"):
        Warehouse(copy).write_rollouts(0, [make_rollout("r9")], make_segments("r9"))
    assert not (copy / IDENTITY_FILE).exists() and len(list((copy / "rollouts").rglob("part-*"))) == 1
    shutil.copy(ours.root / IDENTITY_FILE, copy)
    assert every_finding(Warehouse(copy)) == []


def test_a_copied_part_of_any_other_dataset_is_left_out_and_named(two):
    """The datasets no iteration's gate reads (eval runs here; iterations and train_steps alike)."""
    ours, _ = two
    ours.write_eval_run(make_eval_run("e1", saar=True))
    (own,) = list_parts(ours.root, schema.EVAL_RUNS)
    shutil.copy(own, own.parent / "part-copy.parquet")
    assert ours.connect().execute("SELECT count(*) FROM eval_runs").fetchall() == [(1,)]
    (line,) = every_finding(Warehouse(ours.root))
    assert line.startswith(f"{own.parent / 'part-copy.parquet'}: not a part this warehouse wrote (it is a copy of this "
                           f"warehouse's part eval_runs/{own.name} under another name); its rows are left out until")
