"""Evaluation datasets: the commit protocol per eval id, eval_runs rows, SQL and lookups by id."""

from __future__ import annotations

import dataclasses
import math

from cleaner.warehouse import Warehouse, schema
from cleaner.warehouse.parts import write_part
from tests.factories import make_eval_run, make_rollout, make_segments


def test_eval_batches_commit_like_collection_and_stay_apart(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_eval_batch("e1", [make_rollout("eval-e1-r0")], make_segments("eval-e1-r0"))
    wh.write_eval_batch("e2", [make_rollout("eval-e2-r0")], make_segments("eval-e2-r0"))
    # a writer that died between the segments part and its rollouts part
    write_part(wh.root / "eval_segments" / "eval=e1", schema.to_table(schema.EVAL_SEGMENTS, make_segments("lost")))
    assert wh.eval_rollout_ids("e1") == frozenset({"eval-e1-r0"})
    assert {s.rollout_id for s in wh.read_eval_segments("e1")} == {"eval-e1-r0"}
    assert wh.read_eval_segments("e1") == make_segments("eval-e1-r0")
    connection = wh.connect()
    assert connection.sql("SELECT count(DISTINCT rollout_id) FROM eval_segments").fetchall() == [(2,)]
    assert connection.sql("SELECT count(*) FROM rollouts").fetchall() == [(0,)]  # collection untouched


def test_eval_runs_round_trip_and_sql(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    assert wh.read_eval_run("e1") is None
    wh.write_eval_run(make_eval_run("e1", True))
    wh.write_eval_run(make_eval_run("e2", False, avg_at_n=0.5, pass_at_k=((1, 0.5), (2, 0.6), (4, 0.9))))
    stored = wh.read_eval_run("e1")
    assert stored.pass_at_k == ((1, 0.25), (2, 0.5), (4, 0.75)) and math.isnan(stored.first_call_error_rate)
    assert dataclasses.replace(stored, first_call_error_rate=0.0) == dataclasses.replace(
        make_eval_run("e1", True, created_at=stored.created_at), first_call_error_rate=0.0)
    rows = wh.connect().sql("SELECT eval_id, pass_at_k[4] FROM eval_runs ORDER BY avg_at_n DESC").fetchall()
    assert rows == [("e2", 0.9), ("e1", 0.75)]


def test_read_rollout_finds_evaluation_rollouts(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    wh.write_eval_batch("e1", [make_rollout("eval-e1-r0")], make_segments("eval-e1-r0"))
    rollout, segments = wh.read_rollout("eval-e1-r0")
    assert rollout.rollout_id == "eval-e1-r0" and [s.seq for s in segments] == [0, 1, 2, 3, 4, 5]
    assert wh.read_rollout("r0")[0].rollout_id == "r0"
    assert wh.read_rollout("nope") == (None, [])
