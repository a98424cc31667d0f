"""`cleaner compact`: the same rows before and after, the commit protocol kept, and a crash at any
step of a compaction never shows a row twice or loses one."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from cleaner.records import PurifiedRow
from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse import compact as compact_module
from cleaner.warehouse.compact import LOCK_NAME, compact
from cleaner.warehouse.parts import MERGED_PREFIX, list_parts, write_part
from tests.factories import make_purify_config, make_rollout, make_segments

CONFIG = make_purify_config("abc")


def _purified(rollout_id: str) -> PurifiedRow:
    return PurifiedRow(config_id="abc", iteration=0, rollout_id=rollout_id, group_id="g", token_ids=(1, 2, 3),
                       prompt_len=1, loss_mask=(0, 1, 1), behavior_logprobs=(0.0, -0.5, -0.25),
                       old_logprobs=(0.0, -0.5, -0.25), reward=1.0, advantage=0.5, rolled_back=True,
                       n_shallow=1, n_deep=0, n_unrecovered=0, tokens_removed=4, scorer_version="t")


def _warehouse(tmp_path: Path) -> Warehouse:
    """Three committed batches of iteration 0, one of iteration 1, an uncommitted segments part,
    and a config's purified rows in two parts."""
    wh = Warehouse(tmp_path / "wh")
    for batch in range(3):
        ids = [f"r{batch}a", f"r{batch}b"]
        wh.write_rollouts(0, [make_rollout(i) for i in ids], [s for i in ids for s in make_segments(i)])
    wh.write_rollouts(1, [make_rollout("q0", iteration=1)], make_segments("q0", iteration=1))
    orphan = schema.to_table(schema.SEGMENTS, make_segments("orphan"))
    write_part(wh.root / "segments" / "iteration=0", orphan, stamp=wh.stamp)  # a collector died before its rollouts part
    wh.write_purified(0, CONFIG, [_purified("r0a")])
    wh.write_purified(0, CONFIG, [_purified("r0b"), _purified("r1a")])
    return wh


def _snapshot(wh: Warehouse) -> dict[str, list]:
    """Every row of every SQL view, sorted, and the typed reads the jobs use."""
    connection = wh.connect()
    views = {name: sorted(map(repr, connection.sql(f"SELECT * FROM {name}").fetchall()))
             for name in (*schema.DATASETS, "attempts", "failures")}
    typed = {
        "read_rollouts": sorted(map(repr, wh.read_rollouts(0))),
        "read_segments": sorted(map(repr, wh.read_segments(0))),
        "read_purified": sorted(map(repr, wh.read_purified(0, "abc"))),
        "rollout_ids": sorted(wh.rollout_ids(0)),
    }
    return {**views, **typed}


def _names(wh: Warehouse, dataset: schema.Dataset, iteration: int | None = None) -> list[str]:
    partition = None if iteration is None else {"iteration": iteration}
    return [p.name for p in list_parts(wh.root, dataset, partition)]


def test_rows_are_identical_after_compaction_and_parts_are_few(tmp_path):
    wh = _warehouse(tmp_path)
    before = _snapshot(wh)
    assert len(before["rollouts"]) == 7 and len(before["segments"]) == 42 and len(before["purified"]) == 3
    orphan = set(_names(wh, schema.SEGMENTS, 0)) - set(_names(wh, schema.ROLLOUTS, 0))
    result = compact(wh.root)
    assert _snapshot(wh) == before
    merged = _names(wh, schema.ROLLOUTS, 0)
    assert len(merged) == 1 and merged[0].startswith(MERGED_PREFIX)
    assert len(orphan) == 1 and set(_names(wh, schema.SEGMENTS, 0)) == {merged[0]}  # the twin; the orphan removed
    assert result.n_leftovers == 1
    assert len(_names(wh, schema.PURIFIED)) == 1
    assert len(_names(wh, schema.ROLLOUTS, 1)) == 1  # a lone part is left as it is
    by_dataset = {(m.dataset, m.partition): (m.n_parts, m.n_rows) for m in result.merges}
    assert by_dataset == {("rollouts", "iteration=0"): (3, 6), ("segments", "iteration=0"): (3, 36),
                          ("purified", "iteration=0/config=abc"): (2, 3)}
    assert compact(wh.root).merges == ()  # nothing small left to merge
    assert _snapshot(wh) == before


def test_an_uncommitted_part_stays_while_its_iteration_is_being_collected(tmp_path):
    """Between its two writes a collection has a segments part without its twin: compaction leaves
    the uncommitted parts of an iteration alone while its collect lock is held."""
    from cleaner.warehouse.lock import phase_lock

    wh = _warehouse(tmp_path)
    orphan = set(_names(wh, schema.SEGMENTS, 0)) - set(_names(wh, schema.ROLLOUTS, 0))
    with phase_lock(wh.root, "collect", 0):
        compact(wh.root)  # in this process, as another's would be: flock is per open file
    assert orphan <= set(_names(wh, schema.SEGMENTS, 0))
    compact(wh.root)
    assert not orphan & set(_names(wh, schema.SEGMENTS, 0))


def test_the_commit_protocol_holds_after_compaction(tmp_path):
    wh = _warehouse(tmp_path)
    compact(wh.root)
    wh.write_rollouts(0, [make_rollout("late")], make_segments("late"))  # a collector writing on
    (merged,) = [n for n in _names(wh, schema.ROLLOUTS, 0) if n.startswith(MERGED_PREFIX)]
    connection = wh.connect()
    assert connection.sql("SELECT count(*) FROM rollouts WHERE iteration = 0").fetchall() == [(7,)]
    assert connection.sql("SELECT count(DISTINCT rollout_id) FROM segments WHERE iteration = 0").fetchall() == [(7,)]
    (wh.root / "rollouts" / "iteration=0" / merged).unlink()  # without its commit marker ...
    assert {s.rollout_id for s in wh.read_segments(0)} == {"late"}  # ... the merged segments are invisible
    compact(wh.root)  # and the next compaction removes them as an uncommitted merge
    assert (wh.root / "segments" / "iteration=0" / merged).exists() is False


def test_an_evaluation_is_compacted_with_its_commit_protocol(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    for batch in range(3):
        wh.write_eval_batch("ev1", [make_rollout(f"e{batch}")], make_segments(f"e{batch}"))
    before = (sorted(map(repr, wh.read_eval_rollouts("ev1"))), sorted(map(repr, wh.read_eval_segments("ev1"))))
    result = compact(wh.root, "eval_segments")
    assert {(m.dataset, m.partition, m.n_parts) for m in result.merges} == {
        ("eval_rollouts", "eval=ev1", 3), ("eval_segments", "eval=ev1", 3)}
    assert (sorted(map(repr, wh.read_eval_rollouts("ev1"))), sorted(map(repr, wh.read_eval_segments("ev1")))) == before
    assert wh.connect().sql("SELECT count(*) FROM eval_segments").fetchall() == [(18,)]


def test_only_the_chosen_dataset_and_iteration_are_compacted(tmp_path):
    wh = _warehouse(tmp_path)
    wh.write_rollouts(1, [make_rollout("q1", iteration=1)], make_segments("q1", iteration=1))
    result = compact(wh.root, "segments", 1)  # segments go with their commit markers
    assert {(m.dataset, m.partition) for m in result.merges} == {("rollouts", "iteration=1"),
                                                                 ("segments", "iteration=1")}
    assert len(_names(wh, schema.ROLLOUTS, 0)) == 3 and len(_names(wh, schema.PURIFIED)) == 2
    with pytest.raises(WarehouseError, match="unknown dataset 'nope'"):
        compact(wh.root, "nope")
    with pytest.raises(WarehouseError, match="iterations is not partitioned by iteration"):
        compact(wh.root, "iterations", 0)


class _Crash(Exception):
    pass


def _crash_at(monkeypatch, step: int) -> list[str]:
    """Make the compaction die before its `step`-th file operation (renaming a merged part into
    place or removing a part). Returns the log of the operations done."""
    done: list[str] = []
    real_write, real_remove = compact_module.write_merged, compact_module._remove

    def operation(name, real):
        def wrapped(*args, **kwargs):
            if len(done) == step:
                raise _Crash(f"killed before {name} #{step}")
            done.append(name)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(compact_module, "write_merged", operation("rename", real_write))
    monkeypatch.setattr(compact_module, "_remove", operation("remove", real_remove))
    return done


def test_a_crash_at_any_step_shows_every_row_once_and_the_next_compaction_finishes(tmp_path, monkeypatch):
    reference = _warehouse(tmp_path / "reference")
    done = _crash_at(monkeypatch, step=-1)  # never: count the steps of a whole compaction
    compact(reference.root)
    steps = len(done)
    # the uncommitted part; segments, rollouts; removals
    assert done[:3] == ["remove", "rename", "rename"] and steps == 1 + 2 + 6 + 1 + 2
    for step in range(steps):
        monkeypatch.undo()
        wh = _warehouse(tmp_path / f"crash-{step}")
        before = _snapshot(wh)
        _crash_at(monkeypatch, step)
        with pytest.raises(_Crash):
            compact(wh.root)
        assert _snapshot(wh) == before, f"crash before step {step}"
        monkeypatch.undo()
        compact(wh.root)
        assert _snapshot(wh) == before, f"after finishing the compaction crashed at step {step}"
        assert len(_names(wh, schema.ROLLOUTS, 0)) == 1 and len(_names(wh, schema.SEGMENTS, 0)) == 1
        assert not [p for p in wh.root.rglob(".*.tmp")]


def test_leftovers_of_a_killed_compaction_are_removed(tmp_path):
    wh = _warehouse(tmp_path)
    before = _snapshot(wh)
    directory = wh.root / "rollouts" / "iteration=0"
    stale = directory / f".{MERGED_PREFIX}dead.parquet.999.tmp"  # SIGKILLed mid-write
    stale.write_bytes(b"half a part")
    result = compact(wh.root)
    assert not stale.exists() and result.n_leftovers == 2  # and the uncommitted segments part
    assert _snapshot(wh) == before


def test_one_compaction_at_a_time(tmp_path):
    wh = _warehouse(tmp_path)
    with open(wh.root / LOCK_NAME, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with pytest.raises(WarehouseError, match="another `cleaner compact` is running"):
            compact(wh.root)
    assert compact(wh.root).merges  # the lock is free again


def test_a_corrupt_part_stops_the_compaction_and_is_named(tmp_path):
    wh = _warehouse(tmp_path)
    bad = list_parts(wh.root, schema.PURIFIED)[0]
    bad.write_bytes(bad.read_bytes()[:50])
    with pytest.raises(WarehouseError, match=rf"{bad}: not a readable Parquet file"):
        compact(wh.root, "purified")
    assert len(list_parts(wh.root, schema.PURIFIED)) == 2  # nothing removed
    assert not [p for p in wh.root.rglob(".*.tmp")]


def test_temporaries_of_killed_writers_are_removed_and_no_running_writers(tmp_path):
    """A writer SIGKILLed just after linking its part leaves the part's second, hidden name; one
    killed mid-write leaves a half-written temporary. compact and the next collection's writer remove
    both; a temporary of a live process, or of another host's (a shared disk), stays."""
    import os
    import socket

    from tests.helpers import ended_pid

    wh = _warehouse(tmp_path)
    directory = wh.root / "segments" / "iteration=0"
    part = sorted(directory.glob("part-*.parquet"))[0]
    host = socket.gethostname()
    dead = ended_pid()  # a pid no process has now
    linked = directory / f".{part.name}.{host}.{dead}.tmp"
    os.link(part, linked)  # killed between the link and the unlink
    half = directory / f".part-abc.parquet.{host}.{dead}.tmp"
    half.write_bytes(b"half a part")
    running = directory / f".part-def.parquet.{host}.{os.getpid()}.tmp"
    running.write_bytes(b"being written")
    elsewhere = directory / f".part-ghi.parquet.other-node.{dead}.tmp"
    elsewhere.write_bytes(b"being written on another node")
    compact(wh.root)
    assert (not linked.exists(), not half.exists(), running.exists(), elsewhere.exists()) == (True, True, True, True)
    os.link(next(directory.glob("part-*.parquet")), linked)
    wh.remove_uncommitted(0)  # what a collection of the iteration runs first, holding its lock
    assert not linked.exists() and running.exists()
