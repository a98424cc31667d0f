"""The report's queries on hand-made warehouses; expected values are counted from the rows written here
and from tests/factories.py (every rollout there fails one call with NameError, then fixes it)."""

from __future__ import annotations

import dataclasses
from datetime import datetime

from cleaner.records import IterationRow, PurifiedRow, PurifyConfigRow, TrainStepRow
from cleaner.warehouse import Warehouse, queries
from tests.factories import make_eval_run, make_rollout, make_segments


def iteration_row(iteration: int, accuracy: float, created_at: datetime) -> IterationRow:
    return IterationRow(iteration, "policy", "out", "{}", "{}", "{}", 1.0, 2.0, 3.0, accuracy, 0.5, 1.0, 2, 1,
                        created_at, clean_rollouts=3, clean_accuracy=0.5, recovered_rollouts=1,
                        recovered_accuracy=1.0)


def purified(config_id: str, rollout_id: str, n_shallow: int, n_deep: int, rolled_back: bool = True,
             negative_seq: int | None = None) -> PurifiedRow:
    return PurifiedRow(config_id, 0, rollout_id, "it0-p0", (1, 2), 1, (0, 1), (0.0, -0.5), (0.0, -0.5), 1.0, 0.0,
                       rolled_back, n_shallow, n_deep, 0, 5 * (n_shallow + n_deep), "test",
                       negative_seq=negative_seq)


def config(config_id: str, gamma: float, params_json: str = "{}") -> PurifyConfigRow:
    return PurifyConfigRow(config_id, gamma, 1.0, "code", "always", params_json)


def test_iteration_curves_keep_the_latest_row_of_an_iteration(tmp_path):
    wh = Warehouse(tmp_path)
    wh.write_iteration(iteration_row(1, 0.25, datetime(2026, 1, 1, 10)))
    wh.write_iteration(iteration_row(0, 0.5, datetime(2026, 1, 1, 9)))
    wh.write_iteration(iteration_row(1, 0.75, datetime(2026, 1, 1, 11)))  # iteration 1 logged again
    curves = queries.iteration_curves(wh.connect())
    assert curves.select("iteration", "accuracy", "n_shallow", "clean_rollouts", "recovered_accuracy").rows() == [
        (0, 0.5, 2, 3, 1.0), (1, 0.75, 2, 3, 1.0)]
    assert curves["unrecovered_accuracy"].to_list() == [None, None]  # an empty class stays empty


def test_train_curves_are_in_optimiser_step_order(tmp_path):
    wh = Warehouse(tmp_path)
    wh.write_train_steps(1, [TrainStepRow(1, 0, 2, 0.5, 0.1, 0.01, 1.0, 2.0, 1e-4, 10)])
    wh.write_train_steps(0, [TrainStepRow(0, 1, 1, 0.25, 0.0, 0.0, 1.0, 1.5, 1e-4, 10),
                             TrainStepRow(0, 0, 0, 1.0, 0.0, 0.0, 1.0, 1.0, 1e-4, 10)])
    curves = queries.train_curves(wh.connect())
    assert curves.select("iteration", "step", "optimizer_step", "loss").rows() == [
        (0, 0, 0, 1.0), (0, 1, 1, 0.25), (1, 0, 2, 0.5)]


def test_error_types_count_per_rollout_and_name_a_status_when_there_is_no_exception(tmp_path):
    wh = Warehouse(tmp_path)
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1"), make_rollout("r2", n_failed=0)],
                      make_segments("r0") + make_segments("r1")
                      + [s for s in make_segments("r2") if s.seq in (0, 5)])  # r2 answers at once
    timeout = [dataclasses.replace(s, tool_status="timeout", error_type=None) if s.seq == 2 else s
               for s in make_segments("r3", iteration=1)]
    wh.write_rollouts(1, [make_rollout("r3", iteration=1)], timeout)
    errors = queries.error_types(wh.connect())
    assert errors.rows() == [(0, "NameError", 2, 2 / 3), (1, "timeout", 1, 1.0)]


def test_ablation_grid_holds_only_iterations_with_several_configs(tmp_path):
    wh = Warehouse(tmp_path)
    wh.write_purified(0, config("cfg-a", 0.3), [purified("cfg-a", "r0", 1, 0), purified("cfg-a", "r1", 1, 0),
                                               purified("cfg-a", "r1", 0, 0, negative_seq=3)])
    wh.write_purified(0, config("cfg-b", 0.9, '{"rollback_is_threshold": 0.5, "negative_samples": false}'),
                      [purified("cfg-b", "r0", 0, 1), purified("cfg-b", "r1", 0, 0, rolled_back=False)])
    lone = dataclasses.replace(purified("cfg-a", "r9", 1, 1), iteration=1)
    wh.write_purified(1, config("cfg-a", 0.3), [lone])  # one config only: not an ablation
    grid = queries.ablation_grid(wh.connect())
    columns = ["iteration", "config_id", "gamma", "is_threshold", "negative_samples", "rollouts", "rolled_back",
               "shallow", "deep", "tokens_removed", "negatives"]
    assert grid.select(columns).rows() == [
        (0, "cfg-a", 0.3, None, False, 2, 2, 2, 0, 10, 1),  # the negative row counted apart
        (0, "cfg-b", 0.9, 0.5, False, 2, 1, 0, 1, 5, 0),
    ]


def test_eval_results_read_the_eval_runs_of_the_warehouse(tmp_path):
    wh = Warehouse(tmp_path)
    wh.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    assert queries.eval_results(wh.connect()) is None  # no evaluation yet
    wh.write_eval_run(make_eval_run("e1", True, model="tiny", dataset="toy", avg_at_n=0.25,
                                    pass_at_k=((1, 0.25), (4, 0.5)), failures_per_trajectory=1.5))
    wh.write_eval_run(make_eval_run("e2", False, model="base", dataset="toy", avg_at_n=0.125,
                                    pass_at_k=((1, 0.125), (4, 0.25)), failures_per_trajectory=2.0))
    connection = wh.connect()
    runs = queries.eval_results(connection)
    assert runs.rows() == [("base", "toy", "false", 0.125, "{1=0.125, 4=0.25}", 2.0),
                           ("tiny", "toy", "true", 0.25, "{1=0.25, 4=0.5}", 1.5)]
    assert queries.counts(connection) == queries.Counts(rollouts=1, iterations_collected=1)
