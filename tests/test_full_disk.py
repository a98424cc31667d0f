"""A full disk, for real: a 30 MB tmpfs (mounted here, as root) filled to what each test leaves
free. Every command that meets it prints one `error:` line naming the path and what to free, and
what was stored before stays as it was. Skipped, with the reason, where no tmpfs can be mounted."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import transformers  # noqa: F401  (before any CliRunner: its log handler keeps the stderr it is imported under)
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY, CollectConfig
from cleaner.engine.collect.agent import rollout_key
from cleaner.engine.collect.job import load_tasks
from cleaner.engine.train.checkpoint import save_checkpoint_atomic
from cleaner.errors import WriteError
from cleaner.warehouse import Warehouse
from cleaner.warehouse.parts import list_parts
from cleaner.warehouse.schema import ROLLOUTS
from tests.factories import make_rollout, make_segments
from tests.helpers import tiny_qwen3, tree_digest

runner = CliRunner()


class Disk:
    """A mounted tmpfs; `fill` leaves a given number of bytes free."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.filler = root / "filler"

    def free(self) -> int:
        return shutil.disk_usage(self.root).free

    def fill(self, leave_bytes: int = 0) -> None:
        size = (self.filler.stat().st_size if self.filler.exists() else 0) + self.free() - leave_bytes
        with open(self.filler, "ab") as handle:
            handle.truncate(0)
            os.posix_fallocate(handle.fileno(), 0, max(size, 1))
        assert self.free() <= leave_bytes

    def empty(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield Disk(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _one_line(args: list[str], *expected: str) -> str:
    result = runner.invoke(app, args)
    output = " ".join(result.output.split())  # rich wraps the line
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output and output.count("error:") == 1, result.output
    for text in expected:
        assert text in output, (text, output)
    return output


def _no_space(path: Path, disk: Disk) -> str:
    return f"{path}: cannot write it, no space left on the device (the file system at {disk.root} has "


# the two rollouts a collection of one toy prompt, two samples, plans (purify checks it is complete)
PLANNED = CollectConfig(model=str(DEFAULT_POLICY), n_prompts=1, group_size=2)
R0, R1 = (rollout_key(0, load_tasks(PLANNED)[0].prompt_id, sample)[0] for sample in range(2))


def _collected(root: Path) -> Warehouse:
    warehouse = Warehouse(root)
    warehouse.write_rollouts(0, [make_rollout(R0), make_rollout(R1, reward=0.0)],
                             make_segments(R0) + make_segments(R1))
    warehouse.save_collect_config(0, PLANNED.to_json())
    return warehouse


def test_a_part_that_does_not_fit_is_one_error_and_nothing_half_written(disk):
    warehouse = _collected(disk.root / "wh")
    before = tree_digest(warehouse.root / "rollouts")
    disk.fill()
    with pytest.raises(WriteError) as full:
        warehouse.write_rollouts(0, [make_rollout("r2")], make_segments("r2"))
    part = Path(str(full.value).split(":")[0])
    assert part.parent == warehouse.root / "segments" / "iteration=0" and part.name.startswith("part-")
    assert str(full.value).startswith(_no_space(part, disk) + "0 B free); free space there")
    assert tree_digest(warehouse.root / "rollouts") == before
    assert not list(warehouse.root.rglob(".*.tmp"))  # no half-written temporary
    assert sorted(r.rollout_id for r in warehouse.read_rollouts(0)) == sorted([R0, R1])  # still reads


def test_collect_on_a_full_disk_is_one_line(disk):
    root = disk.root / "wh"
    disk.fill()
    _one_line(["collect", "-w", str(root), "--prompts", "2", "--group-size", "2"],
              _no_space(root / "configs" / "collect-iteration=0.json", disk), "free space there")
    assert not list_parts(root, ROLLOUTS)


def test_purify_on_a_full_disk_is_one_line_and_the_rollouts_stay(disk):
    warehouse = _collected(disk.root / "wh")
    before = tree_digest(warehouse.root / "rollouts")
    disk.fill()
    output = _one_line(["purify", "-w", str(warehouse.root)], "cannot write it, no space left on the device")
    assert f"{warehouse.root}/purif" in output  # a purified or purify_configs part
    assert tree_digest(warehouse.root / "rollouts") == before
    disk.empty()
    assert sorted(r.rollout_id for r in warehouse.read_rollouts(0)) == sorted([R0, R1])


def test_a_serialiser_that_fails_without_an_errno_on_a_nearly_full_disk_is_no_space(disk):
    """torch's zip writer reports a full disk as '[enforce fail at inline_container.cc] ... unexpected
    pos', no errno, and may fail with megabytes still free (a chunk of it did not fit): the save's
    error is still the one 'no space' line, naming what to free."""
    from cleaner.outputs import CHECKPOINT, atomic_directory

    disk.fill(leave_bytes=5 * 2**20)
    out = disk.root / "ckpt"
    with pytest.raises(WriteError) as failed, atomic_directory(out, CHECKPOINT) as temp:
        (temp / "model.safetensors").write_bytes(b"x" * 2**20)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1048640 vs 1048576")
    assert str(failed.value).startswith(_no_space(out, disk)) and "free" in str(failed.value)
    assert not out.exists() and list(disk.root.glob(".ckpt*")) == []  # nothing half-written stays


def _plain_segments(root: Path) -> int:
    """Segments rows as another tool reads the directory: plain DuckDB over every part."""
    import duckdb

    return duckdb.sql(f"SELECT count(*) FROM read_parquet('{root}/segments/**/*.parquet')").fetchall()[0][0]


def test_a_full_disk_between_a_parts_two_writes_leaves_no_uncommitted_part(disk, monkeypatch):
    """The disk fills after a batch's segments part is written and before its rollouts part: the
    segments part goes with the failure, so plain DuckDB over the directory counts what the views do."""
    import cleaner.warehouse.store as store

    warehouse = _collected(disk.root / "wh")
    original = store.write_part

    def fill_before_the_commit(directory, table, name=None, stamp=None):
        if directory.parent.name == "rollouts":
            disk.fill()
        return original(directory, table, name, stamp)

    monkeypatch.setattr(store, "write_part", fill_before_the_commit)
    with pytest.raises(WriteError, match="no space left on the device"):
        warehouse.write_rollouts(0, [make_rollout("r2")], make_segments("r2"))
    monkeypatch.undo()
    disk.empty()
    view = warehouse.connect().sql("SELECT count(*) FROM segments").fetchall()[0][0]
    assert view == 2 * len(make_segments(R0)) and _plain_segments(warehouse.root) == view


def test_an_uncommitted_part_a_killed_collection_left_goes_with_the_next_writer(disk):
    """A collection SIGKILLed between its two writes leaves a segments part without its twin: the
    next collect of the iteration (here a --resume with nothing left to generate) removes it, and
    compaction removes one whatever its rollouts."""
    from cleaner.engine.collect.job import CollectRequest, collect_job
    from cleaner.warehouse.parts import write_part
    from cleaner.warehouse.schema import SEGMENTS, to_table

    warehouse = _collected(disk.root / "wh")
    segments = disk.root / "wh" / "segments" / "iteration=0"
    write_part(segments, to_table(SEGMENTS, make_segments(R0)), stamp=warehouse.stamp)  # as the killed collection of R0 left it
    assert _plain_segments(warehouse.root) == 3 * len(make_segments(R0))
    collect_job(warehouse, CollectRequest(PLANNED, resume=True), progress=False)
    assert _plain_segments(warehouse.root) == 2 * len(make_segments(R0))
    write_part(segments, to_table(SEGMENTS, make_segments("someone-else")), stamp=warehouse.stamp)
    runner.invoke(app, ["compact", "-w", str(warehouse.root)])
    view = warehouse.connect().sql("SELECT count(*) FROM segments").fetchall()[0][0]
    assert _plain_segments(warehouse.root) == view == 2 * len(make_segments(R0))


def test_compact_on_a_full_disk_is_one_line_and_every_row_stays(disk):
    warehouse = _collected(disk.root / "wh")
    warehouse.write_rollouts(0, [make_rollout("r2")], make_segments("r2"))  # a second part to merge
    data = [warehouse.root / name for name in ("rollouts", "segments")]
    before = [tree_digest(path) for path in data]
    disk.fill()
    _one_line(["compact", "-w", str(warehouse.root)], "cannot write it, no space left on the device",
              f"{warehouse.root}/segments/iteration=0/part-merged-")
    assert [tree_digest(path) for path in data] == before  # no part removed, no merged part half there
    disk.empty()
    assert sorted(r.rollout_id for r in warehouse.read_rollouts(0)) == sorted([R0, R1, "r2"])


def test_train_refuses_before_training_when_its_checkpoint_cannot_fit(disk, small_run, tmp_path):
    warehouse = Warehouse(shutil.copytree(small_run / "warehouse", tmp_path / "warehouse"))
    [(config_id,)] = warehouse.connect().sql("SELECT DISTINCT config_id FROM purified WHERE iteration = 0").fetchall()
    steps = tree_digest(warehouse.root / "train_steps")
    disk.fill(leave_bytes=200 * 1024)
    out = disk.root / "out"
    started = time.monotonic()
    output = _one_line(["train", "-w", str(warehouse.root), "--iteration", "0", "--config-id", config_id,
                        "--policy", str(small_run / "checkpoints" / "iteration-1"), "--out", str(out),
                        "--mini-batch-size", "8"],
                       f"{out}: the checkpoint needs about ", "parameters: weights as float32 and the float32 "
                       f"optimiser state), and the file system at {disk.root} has 200.0 KiB free; free ",
                       "there or choose another --out (checked before training)")
    assert time.monotonic() - started < 30, output
    assert tree_digest(warehouse.root / "train_steps") == steps and not out.exists()
    # free space just above the content's estimate: refused too, the save's overheads would not fit
    from cleaner.engine.train import space

    policy = small_run / "checkpoints" / "iteration-1"
    content = space.checkpoint_bytes(space.stored_parameters(policy), "float32", "torch", space.other_bytes(policy))
    disk.empty()
    disk.fill(leave_bytes=content + 64 * 1024)
    _one_line(["train", "-w", str(warehouse.root), "--iteration", "0", "--config-id", config_id, "--policy",
               str(policy), "--out", str(out), "--mini-batch-size", "8"], f"{out}: the checkpoint needs about ")


def test_a_checkpoint_that_does_not_fit_is_one_error_and_the_previous_one_stays(disk):
    out = disk.root / "policy"
    save_checkpoint_atomic(tiny_qwen3(0), None, out)
    before = tree_digest(out)
    disk.fill(leave_bytes=16 * 1024)
    with pytest.raises(WriteError, match=f"^{out}: cannot write it, no space left on the device"):
        save_checkpoint_atomic(tiny_qwen3(1), None, out)
    assert tree_digest(out) == before
    assert sorted(p.name for p in disk.root.iterdir()) == ["filler", "policy"]  # no temporary left


@pytest.mark.slow
def test_the_issues_repro_collect_with_150_kb_free_is_one_line(disk):
    """`cleaner collect -w /mnt/f/wh --prompts 32 --group-size 8` on a 30 MB tmpfs filled to 150 KB
    free, in a process of its own: the whole collection runs, its first part that does not fit is
    one line, and the rollouts committed before it read back."""
    import sys

    root = disk.root / "wh"
    disk.fill(leave_bytes=150 * 1024)
    result = subprocess.run([sys.executable, "-m", "cleaner.cli", "collect", "-w", str(root), "--prompts", "32",
                             "--group-size", "8"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write it, no space left on the device" in errors[0], result.stderr
    committed = Warehouse(root).read_rollouts(0)
    assert len(committed) < 256 and len({r.rollout_id for r in committed}) == len(committed)
