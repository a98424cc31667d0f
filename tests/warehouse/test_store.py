"""Warehouse round trips, commit protocol, crash safety and validation errors."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.records import PurifiedRow
from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse.parts import list_parts, write_part
from tests.factories import make_purified, make_purify_config, make_rollout, make_segments


def _fill(tmp_path: Path) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    rollouts = [make_rollout("r0"), make_rollout("r1", reward=0.0, n_failed=1)]
    segments = make_segments("r0") + make_segments("r1")
    wh.write_rollouts(0, rollouts, segments)
    return wh


def test_round_trip_through_records(tmp_path):
    wh = _fill(tmp_path)
    assert {r.rollout_id for r in wh.read_rollouts(0)} == {"r0", "r1"}
    segments = wh.read_segments(0)
    assert len(segments) == 12
    original = make_segments("r0")
    read_back = sorted((s for s in segments if s.rollout_id == "r0"), key=lambda s: s.seq)
    assert read_back == original  # tuples, None and floats survive the trip
    assert wh.rollout_ids(0) == frozenset({"r0", "r1"})
    assert wh.iterations_collected() == [0]
    assert list((tmp_path / "wh" / "rollouts").iterdir())[0].name == "iteration=0"


def test_a_rollout_stored_twice_is_named_not_read(tmp_path):
    """Two processes collecting one iteration commit the same batch twice; reading it names the
    duplicates instead of handing purify a rollout whose segments come twice."""
    wh = Warehouse(tmp_path)
    rollouts = [make_rollout("r0"), make_rollout("r1")]
    segments = make_segments("r0") + make_segments("r1")
    wh.write_rollouts(0, rollouts, segments)
    assert [r.rollout_id for r in wh.read_rollouts(0)] == ["r0", "r1"]
    wh.write_rollouts(0, rollouts[:1], make_segments("r0"))  # the second writer's copy of r0
    with pytest.raises(WarehouseError, match=r"iteration 0 stores 1 rollout\(s\) more than once \(r0\)"):
        wh.read_rollouts(0)


def test_duckdb_views_and_attempts(tmp_path):
    connection = _fill(tmp_path).connect()
    assert connection.sql("SELECT count(*) FROM rollouts").fetchall() == [(2,)]
    attempts = connection.sql(
        "SELECT step, attempt, has_call, tool_status, error_type FROM attempts "
        "WHERE rollout_id = 'r0' ORDER BY seq").fetchall()
    assert attempts == [(0, 0, True, "error", "NameError"), (0, 1, True, "ok", None), (1, 0, False, None, None)]
    assert connection.sql("SELECT count(*) FROM failures").fetchall() == [(2,)]
    # Datasets with no parts yet still have a view with the right columns.
    assert connection.sql("SELECT count(*) FROM purified").fetchall() == [(0,)]
    assert "old_logprobs" in [c[0] for c in connection.sql("DESCRIBE purified").fetchall()]


def test_uncommitted_segments_are_invisible(tmp_path):
    wh = _fill(tmp_path)
    # A writer that died after the segments part and before its rollouts part.
    table = schema.to_table(schema.SEGMENTS, make_segments("orphan"))
    write_part(tmp_path / "wh" / "segments" / "iteration=0", table)
    assert {s.rollout_id for s in wh.read_segments(0)} == {"r0", "r1"}
    assert wh.connect().sql("SELECT count(DISTINCT rollout_id) FROM segments").fetchall() == [(2,)]


def test_purified_write_is_idempotent(tmp_path):
    wh = _fill(tmp_path)
    config = make_purify_config("abc")
    row = PurifiedRow(config_id="abc", iteration=0, rollout_id="r0", group_id="g", token_ids=(1, 2, 3),
                      prompt_len=1, loss_mask=(0, 1, 1), behavior_logprobs=(0.0, -0.5, -0.25),
                      old_logprobs=(0.0, -0.5, -0.25), reward=1.0, advantage=0.5, rolled_back=True,
                      n_shallow=1, n_deep=0, n_unrecovered=0, tokens_removed=4, scorer_version="t")
    wh.write_purified(0, config, [row])
    wh.write_purified(0, config, [row])
    assert wh.read_purified(0, "abc") == [row]
    connection = wh.connect()
    assert connection.sql("SELECT count(*) FROM purified").fetchall() == [(1,)]
    assert connection.sql("SELECT count(*) FROM purify_configs").fetchall() == [(1,)]



def test_purified_many_writes_new_config_rows_once_in_one_part(tmp_path):
    wh = _fill(tmp_path)
    configs = [make_purify_config(c) for c in ("c1", "c2")]
    rows = {c.config_id: make_purified(c.config_id) for c in configs}
    wh.write_purified(0, configs[0], [rows["c1"]])  # c1 is already known and stored
    wh.write_purified_many(0, [(c, [rows[c.config_id]]) for c in configs])
    wh.write_purified_many(0, [(c, [rows[c.config_id]]) for c in configs])  # idempotent
    assert [wh.read_purified(0, c) for c in ("c1", "c2")] == [[rows["c1"]], [rows["c2"]]]
    assert len(list((tmp_path / "wh" / "purify_configs").glob("*.parquet"))) == 2  # c1's, then c2's
    connection = wh.connect()
    assert connection.sql("SELECT config_id FROM purify_configs ORDER BY 1").fetchall() == [("c1",), ("c2",)]
    assert connection.sql("SELECT count(*) FROM purified").fetchall() == [(2,)]


def test_to_table_converts_shared_list_objects_once_with_the_same_result(tmp_path):
    tokens, logprobs = (1, 2, 3), (0.0, -0.5, -0.25)  # one object shared by rows of three configs
    rows = [PurifiedRow(
        config_id=c, iteration=0, rollout_id=f"r{i}", group_id="g",
        token_ids=tokens if i else (7, 8), prompt_len=1, loss_mask=(0, 1, 1) if i else (0, 1),
        behavior_logprobs=logprobs if i else (0.0, -1.0), old_logprobs=logprobs if i else (0.0, -2.0),
        reward=1.0, advantage=0.5, rolled_back=False, n_shallow=0, n_deep=0, n_unrecovered=0,
        tokens_removed=0, scorer_version="t",
    ) for c in ("c1", "c2", "c3") for i in range(2)]
    columns = {name: [getattr(row, name) for row in rows] for name in schema.PURIFIED.columns}
    assert schema.to_table(schema.PURIFIED, rows).equals(pa.Table.from_pydict(columns, schema=schema.PURIFIED.schema))
    wh = _fill(tmp_path)
    configs = [make_purify_config(c) for c in ("c1", "c2", "c3")]
    wh.write_purified_many(0, [(c, rows[2 * k : 2 * k + 2]) for k, c in enumerate(configs)])
    assert [wh.read_purified(0, c) for c in ("c1", "c2", "c3")] == [rows[0:2], rows[2:4], rows[4:6]]


_WRITER = """
import sys
import pyarrow as pa
from pathlib import Path
from cleaner.warehouse.parts import write_part
table = pa.table({"x": pa.array(range(3_000_000), pa.int64())})
print("ready", flush=True)
while True:
    write_part(Path(sys.argv[1]), table)
"""


def test_sigkill_mid_write_leaves_no_partial_part(tmp_path):
    directory = tmp_path / "parts"
    process = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE)
    assert process.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 30
    # Kill while a temporary file exists: a write is in flight.
    while time.monotonic() < deadline:
        if any(p.name.endswith(".tmp") for p in directory.glob(".*")) and list(directory.glob("part-*")):
            break
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    visible = sorted(directory.glob("part-*.parquet"))
    assert visible, "the writer should have finished at least one part"
    for path in visible:
        assert pq.read_table(path).num_rows == 3_000_000


def _digest(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_truncated_part_is_named_and_nothing_modified(tmp_path):
    wh = _fill(tmp_path)
    bad = list_parts(wh.root, schema.ROLLOUTS)[0]
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    before = _digest(wh.root)
    with pytest.raises(WarehouseError, match=str(bad)):
        wh.connect()
    assert _digest(wh.root) == before


def test_missing_column_is_named(tmp_path):
    wh = _fill(tmp_path)
    table = schema.to_table(schema.ROLLOUTS, [make_rollout("r9")]).drop_columns(["reward"])
    path = write_part(wh.root / "rollouts" / "iteration=1", table)
    with pytest.raises(WarehouseError, match=rf"{path}.*missing column 'reward'"):
        wh.connect()


def test_wrong_row_type_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="rollouts takes Rollout rows"):
        schema.to_table(schema.ROLLOUTS, make_segments("r0"))
    assert isinstance(schema.to_table(schema.ROLLOUTS, []), pa.Table)


def test_parts_written_before_a_column_was_added_still_read(tmp_path):
    """purify_configs.edit and the iterations' failed-call credit were added later: a part without
    them reads edit as replace and the credit as null, in records, SQL and after a compaction."""
    from cleaner.records import IterationRow
    from cleaner.warehouse.compact import compact

    wh = Warehouse(tmp_path)
    old_config = schema.to_table(schema.PURIFY_CONFIGS, [make_purify_config("old")])
    write_part(wh.root / "purify_configs", old_config.drop_columns(["edit"]))
    new_config = make_purify_config("new", edit="mask")
    write_part(wh.root / "purify_configs", schema.to_table(schema.PURIFY_CONFIGS, [new_config]))
    row = IterationRow(0, "p", "q", "{}", "{}", "{}", 1.0, 1.0, 1.0, 0.5, 0.25, 0.5, 1, 2)
    added = ["failed_call_tokens", "failed_call_advantage", "failed_call_positive_share"]
    write_part(wh.root / "iterations", schema.to_table(schema.ITERATIONS, [row]).drop_columns(added))
    wh.write_iteration(IterationRow(1, "q", "r", "{}", "{}", "{}", 1.0, 1.0, 1.0, 0.75, 0.25, 0.5, 1, 2,
                                    failed_call_tokens=40, failed_call_advantage=0.25, failed_call_positive_share=0.5))
    for _ in range(2):  # before and after merging the old parts with the new ones
        connection = wh.connect()
        assert connection.sql("SELECT config_id, edit FROM purify_configs ORDER BY 1").fetchall() == [
            ("new", "mask"), ("old", "replace")]
        assert connection.sql("SELECT iteration, failed_call_tokens, failed_call_advantage FROM iterations "
                              "ORDER BY 1").fetchall() == [(0, None, None), (1, 40, 0.25)]
        assert [(r.iteration, r.failed_call_positive_share) for r in wh.read_iterations()] == [(0, None), (1, 0.5)]
        assert wh.purify_config_ids() == {"old", "new"}
        compact(wh.root)
    assert len(list_parts(wh.root, schema.ITERATIONS)) == 1
    missing = schema.to_table(schema.PURIFY_CONFIGS, [make_purify_config("x")])
    path = write_part(wh.root / "purify_configs", missing.drop_columns(["similarity_on"]))
    with pytest.raises(WarehouseError, match=rf"{path}.*missing column 'similarity_on'"):  # others stay required
        wh.connect()


def test_a_file_is_not_a_warehouse_to_write(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    for root, expected in ((taken, "is a file, not a warehouse directory"), (taken / "sub", f"{taken} is a file")):
        warehouse = Warehouse(root)
        with pytest.raises(WarehouseError, match=expected):
            warehouse.check_writable()
        with pytest.raises(WarehouseError, match=expected):
            warehouse.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
        with pytest.raises(WarehouseError, match=expected):
            warehouse.save_config("run", "{}")
    assert taken.read_text() == "mine"
    Warehouse(tmp_path / "new" / "wh").check_writable()  # a missing directory is fine, and not created
    assert not (tmp_path / "new").exists()


def test_a_config_id_is_found_by_a_unique_prefix(tmp_path):
    wh = _fill(tmp_path)
    ids = ("abcd12340000", "abcd56780000", "ef0123456789")
    wh.write_purified_many(0, [(make_purify_config(c), [make_purified(c)]) for c in ids])
    assert wh.resolve_config_id("ef012345") == "ef0123456789"  # the 8 digits purify prints
    assert wh.resolve_config_id("abcd1") == "abcd12340000"
    assert wh.resolve_config_id("abcd56780000") == "abcd56780000"
    assert wh.resolve_config_id("9999") == "9999"  # unknown: the caller says nothing is stored
    with pytest.raises(WarehouseError, match="config id 'abcd' is ambiguous, it begins abcd12340000, abcd56780000"):
        wh.resolve_config_id("abcd")
    with pytest.raises(WarehouseError, match="give at least 4 of its digits"):
        wh.resolve_config_id("ef0")


def test_purify_configs_store_gamma_and_p_as_typed(tmp_path):
    wh = _fill(tmp_path)
    wh.write_purified(0, make_purify_config("c1", gamma=0.3), [make_purified("c1")])
    assert wh.connect().sql("SELECT gamma, rollback_prob FROM purify_configs").fetchall() == [(0.3, 1.0)]
    (part,) = list_parts(wh.root, schema.PURIFY_CONFIGS)
    assert pq.read_table(part)["gamma"].to_pylist() == [0.3]


def _steps(config_id: str | None, checkpoint: str | None, losses: list[float]):
    from cleaner.records import TrainStepRow

    return [TrainStepRow(0, step, step, loss, 0.0, 0.0, 0.0, 1.0, 1e-4, 10, config_id=config_id, checkpoint=checkpoint)
            for step, loss in enumerate(losses)]


def test_a_rerun_of_one_training_replaces_its_train_steps_rows_and_no_others(tmp_path):
    """Each train_steps row names the purify config it trained and the checkpoint it wrote;
    training the same pair again replaces that pair's rows, also inside a part a compaction merged
    with other rows, and rows written before the columns existed read as null and stay."""
    from cleaner.warehouse.compact import compact

    wh = Warehouse(tmp_path / "wh")
    legacy = schema.to_table(schema.TRAIN_STEPS, _steps(None, None, [9.0]))
    write_part(wh.root / "train_steps" / "iteration=0", legacy.drop_columns(["config_id", "checkpoint"]))
    wh.write_train_steps(0, _steps("cfg-a", "/ckpt/x", [1.0, 2.0]))
    wh.write_train_steps(0, _steps("cfg-b", "/ckpt/x", [3.0]))
    wh.write_train_steps(0, _steps("cfg-a", "/ckpt/y", [4.0]))

    def stored() -> list[tuple]:
        sql = wh.connect().sql("SELECT config_id, checkpoint, loss FROM train_steps ORDER BY loss").fetchall()
        rows = sorted(wh.read_train_steps(0), key=lambda row: row.loss)
        assert [(r.config_id, r.checkpoint, r.loss) for r in rows] == sql
        return sql

    assert stored() == [("cfg-a", "/ckpt/x", 1.0), ("cfg-a", "/ckpt/x", 2.0), ("cfg-b", "/ckpt/x", 3.0),
                        ("cfg-a", "/ckpt/y", 4.0), (None, None, 9.0)]
    wh.write_train_steps(0, _steps("cfg-a", "/ckpt/x", [5.0]))  # the rerun: its two rows become one
    assert stored() == [("cfg-b", "/ckpt/x", 3.0), ("cfg-a", "/ckpt/y", 4.0), ("cfg-a", "/ckpt/x", 5.0),
                        (None, None, 9.0)]
    compact(wh.root)  # one part holds every run's rows
    assert len(list_parts(wh.root, schema.TRAIN_STEPS)) == 1
    wh.write_train_steps(0, _steps("cfg-b", "/ckpt/x", [6.0, 7.0]))
    assert stored() == [("cfg-a", "/ckpt/y", 4.0), ("cfg-a", "/ckpt/x", 5.0), ("cfg-b", "/ckpt/x", 6.0),
                        ("cfg-b", "/ckpt/x", 7.0), (None, None, 9.0)]
    assert len(list_parts(wh.root, schema.TRAIN_STEPS)) == 1  # the replaced part was removed


def test_a_config_or_a_row_given_twice_is_stored_once(tmp_path):
    """A grid's repeated value reaches the warehouse as one config given twice: its rows go in once;
    a negative sample (another `negative_seq`) is another row of the rollout, kept."""
    wh = _fill(tmp_path)
    config = make_purify_config("c1")
    r0, r1 = make_purified("c1", "r0"), make_purified("c1", "r1")
    negative = dataclasses.replace(r0, negative_seq=1)
    wh.write_purified_many(0, [(config, [r0, r0, negative]), (config, [r0, r1]), (config, [r1])])
    assert sorted((row.rollout_id, row.negative_seq or -1) for row in wh.read_purified(0, "c1")) == [
        ("r0", -1), ("r0", 1), ("r1", -1)]
    assert len(list((tmp_path / "wh" / "purified").rglob("part-*.parquet"))) == 1


_RACE = """
import sys, time
from pathlib import Path
from cleaner.warehouse import Warehouse
from tests.factories import make_purified, make_purify_config
root, me, other = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
found = Warehouse.purified_rollout_ids

def slow(self, iteration, config_id):  # what a purify found stored, then the time it takes to write
    ids = found(self, iteration, config_id)
    time.sleep(0.5)
    return ids

Warehouse.purified_rollout_ids = slow
me.touch()
while not other.exists():
    time.sleep(0.01)
Warehouse(root).write_purified(0, make_purify_config("c1"), [make_purified("c1", r) for r in ("r0", "r1")])
"""


def test_two_processes_writing_a_configs_rows_at_once_store_each_row_once(tmp_path):
    """Two writers of one config's rows (shards of two shard counts, a purify resumed beside one
    still running), each finding no rows stored before the other writes: the write lock makes the
    second find the first's rows."""
    wh = _fill(tmp_path)
    ready = [tmp_path / "a.ready", tmp_path / "b.ready"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    writers = [subprocess.Popen([sys.executable, "-c", _RACE, str(wh.root), str(me), str(other)], env=env)
               for me, other in (ready, ready[::-1])]
    assert [writer.wait(timeout=120) for writer in writers] == [0, 0]
    assert sorted(row.rollout_id for row in wh.read_purified(0, "c1")) == ["r0", "r1"]


def test_train_steps_written_before_the_objective_columns_read_them_as_null(tmp_path):
    """verl's terms (pg_loss, kl_loss, ppo_kl, clip_fraction_lower) and the train config id were added
    later: an earlier part reads them as null beside a part that has them."""
    from cleaner.records import TrainStepRow

    wh = Warehouse(tmp_path)
    old = TrainStepRow(iteration=0, step=0, optimizer_step=0, loss=0.5, clip_fraction=0.125, approx_kl=0.0625,
                       entropy=1.0, grad_norm=0.25, lr=2.0**-10, tokens=10)  # float32 holds them exactly
    added = ["pg_loss", "kl_loss", "ppo_kl", "clip_fraction_lower", "train_config_id"]
    write_part(wh.root / "train_steps" / "iteration=0", schema.to_table(schema.TRAIN_STEPS, [old]).drop_columns(added))
    new = dataclasses.replace(old, iteration=1, pg_loss=0.25, kl_loss=0.125, ppo_kl=0.0625, clip_fraction_lower=0.5,
                              train_config_id="abc")
    wh.write_train_steps(1, [new])
    assert wh.connect().sql("SELECT iteration, pg_loss, kl_loss, ppo_kl, clip_fraction_lower, train_config_id "
                            "FROM train_steps ORDER BY 1").fetchall() == [
        (0, None, None, None, None, None), (1, 0.25, 0.125, 0.0625, 0.5, "abc")]
    assert wh.read_train_steps(0) == [old]
