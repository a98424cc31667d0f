"""`cleaner eval` end to end with the committed tiny policy and the real sandbox.

The toy problems are written in the AIME 2024 layout (`Problem`, `Answer`, `data_source`), so the
layout detection, the bare prompts the policy was trained on, math-verify rewards, both SAAR
settings, the warehouse, SQL, `cleaner show`, seeding and resuming are all the real ones.
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import DEFAULT_POLICY, EvalConfig
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.eval.job import eval_job
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.sandbox import SandboxConfig
from cleaner.warehouse import Warehouse, schema
from tests.factories import as_format_1
from tests.helpers import assert_same_collection, comparable, scalars

runner = CliRunner()

# The tiny policy's sampling as trained and measured in docs/experiments.md (temperature 1, top-p 1), and
# its token budgets; the paper's top-p 0.6 makes it almost never fail a call.
TINY = ["--prompt-style", "bare", "--top-p", "1.0", "--max-new-tokens", "160", "--max-response-tokens", "768",
        "--sandbox-workers", "1"]


@pytest.fixture(scope="module")
def toy_aime(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "toy_aime24.parquet"
    rows = [{"Problem": task.messages[-1]["content"], "Answer": int(task.ground_truth), "data_source": "AIME2024"}
            for task in toy_tasks(16, seed=5)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def backend():
    return TorchBackend(DEFAULT_POLICY)


def test_eval_prints_both_settings_stores_them_and_reprints_as_json(tmp_path, toy_aime):
    warehouse = tmp_path / "wh"
    args = ["eval", "--model", str(DEFAULT_POLICY), "--dataset", f"toy={toy_aime}", "--n", "4", "--saar",
            "--no-saar", *TINY, "-w", str(warehouse)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    for text in ("avg@4", "pass@4", "maj@4", "fail/traj", "latency x", "2 evaluation(s) run"):
        assert text in result.stdout
    # stored: reprinted, not run again, and mirrored to TensorBoard at the given step
    result = runner.invoke(app, [*args, "--format", "json", "--log-to", "tensorboard", "--log-step", "7"])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    logged = scalars(tmp_path / "tensorboard")  # beside the warehouse by default
    for record in records:
        section = f"eval/toy/{DEFAULT_POLICY.name}/{'saar' if record['saar'] else 'raw'}"
        assert logged[f"{section}/avg_at_n"] == [(7, pytest.approx(record["avg_at_n"], rel=1e-6))]
        assert logged[f"{section}/pass_at_4"] == [(7, pytest.approx(record["pass_at_k"]["4"], rel=1e-6))]
        assert logged[f"{section}/failures_per_trajectory"] == [
            (7, pytest.approx(record["failures_per_trajectory"], rel=1e-6))]
    assert [(r["dataset"], r["saar"], r["n"], r["problems"], r["rollouts"]) for r in records] == [
        ("toy", True, 4, 16, 64), ("toy", False, 4, 16, 64)]
    for record in records:
        # The policy answers ~70% of toy problems at temperature 1 (docs/experiments.md: 70.3% over 256 rollouts,
        # 71.5% over 512); 64 rollouts have a standard error near 0.06, so 0.4-0.95 only fails if
        # the prompts, the sampling or the reward are broken.
        assert 0.4 <= record["avg_at_n"] <= 0.95
        assert record["pass_at_k"]["1"] == pytest.approx(record["avg_at_n"])
        assert record["pass_at_k"]["1"] <= record["pass_at_k"]["2"] <= record["pass_at_k"]["4"]
        assert record["failures_per_trajectory"] > 0  # the policy fails some calls at top-p 1
    saar, raw = records
    assert saar["latency_ratio"] > 0 and raw["latency_ratio"] is None
    query = runner.invoke(app, ["sql", "SELECT saar, rollouts, pass_at_k[4] AS p4 FROM eval_runs ORDER BY saar",
                                "-w", str(warehouse), "-f", "json"])
    assert json.loads(query.stdout) == [{"saar": False, "rollouts": 64, "p4": raw["pass_at_k"]["4"]},
                                        {"saar": True, "rollouts": 64, "p4": saar["pass_at_k"]["4"]}]
    connection = Warehouse(warehouse).connect()
    ((rollout_id,),) = connection.sql(
        f"SELECT rollout_id FROM eval_rollouts WHERE collect_config_id = '{saar['eval_id']}' "
        "AND n_failed_calls > 0 ORDER BY rollout_id LIMIT 1").fetchall()
    shown = runner.invoke(app, ["show", rollout_id, "-w", str(warehouse)])
    assert shown.exit_code == 0, shown.output
    assert f"a rollout of evaluation {saar['eval_id']}" in " ".join(shown.output.split())


def test_bad_datasets_fail_with_one_line_before_anything_is_written(tmp_path):
    other = tmp_path / "other.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "Q", "target": "1", "data_source": "x"}]), other)
    warehouse = tmp_path / "wh"
    for dataset, expected in ((f"mine={other}", "no known dataset layout"), (str(other), "NAME=PATH")):
        result = runner.invoke(app, ["eval", "--model", str(DEFAULT_POLICY), "--dataset", dataset,
                                     "-w", str(warehouse)])
        assert result.exit_code == 1 and result.output.count("error:") == 1, result.output
        assert expected in " ".join(result.output.split())
    assert not warehouse.exists()


def _config(toy_aime, **changes) -> EvalConfig:
    config = EvalConfig(models=(str(DEFAULT_POLICY),), datasets=(("toy", str(toy_aime)),), n=2, limit=2,
                        prompt_style="bare", top_p=1.0, max_new_tokens=160, max_response_tokens=768,
                        batch_rollouts=4, sandbox=SandboxConfig(workers=1), seed=7)
    return dataclasses.replace(config, **changes)


def _stored(warehouse: Warehouse, eval_id: str) -> tuple[list, list]:
    return comparable(warehouse.read_eval_rollouts(eval_id), warehouse.read_eval_segments(eval_id))


def test_same_seed_same_results(tmp_path, toy_aime, backend):
    config = _config(toy_aime)
    first = eval_job(Warehouse(tmp_path / "a"), config, backends={config.models[0]: backend}, progress=False)
    second = eval_job(Warehouse(tmp_path / "b"), config, backends={config.models[0]: backend}, progress=False)
    (row_a,), (row_b,) = first.rows, second.rows
    assert row_a.eval_id == row_b.eval_id
    assert_same_collection(_stored(Warehouse(tmp_path / "a"), row_a.eval_id), _stored(Warehouse(tmp_path / "b"), row_b.eval_id))
    assert (row_a.avg_at_n, row_a.pass_at_k, row_a.maj_at_n) == (row_b.avg_at_n, row_b.pass_at_k, row_b.maj_at_n)
    assert _config(toy_aime, seed=8).collect_config(str(DEFAULT_POLICY), str(toy_aime), True, 2).config_id != row_a.eval_id


def test_every_setting_an_evaluation_shares_with_collect_reaches_its_collection(toy_aime):
    """What `cleaner eval` is told about the servers, timeouts and sampling is what its collections
    run with: each field EvalConfig shares with CollectConfig is carried over as it was given."""
    from cleaner.config import CollectConfig

    given = {"backend": "sglang", "sglang_url": "http://127.0.0.1:1", "sglang_request_timeout_s": 7.5,
             "sglang_mem_fraction": 0.5, "reward_timeout_s": 12.0, "test_timeout_s": 3.0, "seed": 4,
             "batch_rollouts": 8, "max_concurrent_rollouts": 16, "gamma": 0.7, "max_turns": 5, "temperature": 0.8,
             "top_p": 0.9}
    config = EvalConfig(models=(str(DEFAULT_POLICY),), datasets=(("toy", str(toy_aime)),), **given)
    collect = config.collect_config(config.models[0], config.datasets[0][1], True, 2)
    assert collect.sglang_request_timeout_s == 7.5
    shared = {f.name for f in dataclasses.fields(EvalConfig)} & {f.name for f in dataclasses.fields(CollectConfig)}
    assert set(given) <= shared
    assert {name: getattr(collect, name) for name in shared} == {name: getattr(config, name) for name in shared}


class _Killed(Exception):
    pass


def test_an_evaluation_an_earlier_version_stored_is_not_run_again(tmp_path, toy_aime, backend):
    """Format 1's ids hashed every field (how rollouts were batched included): a complete evaluation
    stored under such an id, with its config, is found through that config; in a warehouse of this
    format an id is its config's own."""
    config = _config(toy_aime)
    new = Warehouse(tmp_path / "new")
    (row,) = eval_job(new, config, backends={config.models[0]: backend}, progress=False).rows
    earlier = "0123456789ab"  # the id format 1 gave it (tests/warehouse/test_frozen_main.py has main's own)
    for version in (2, 1):
        old = Warehouse(tmp_path / f"format-{version}")
        old.write_eval_run(dataclasses.replace(row, eval_id=earlier))
        old.save_eval_config(earlier, new.eval_config(row.eval_id))
        if version == 1:
            as_format_1(old.root)
        again = eval_job(Warehouse(old.root), config, backends={config.models[0]: backend}, progress=False)
        assert [r.eval_id for r in again.rows] == [earlier if version == 1 else row.eval_id]
        assert again.computed == ([] if version == 1 else [row.eval_id])


def test_an_interrupted_eval_resumes_to_exactly_the_uninterrupted_rollouts(tmp_path, toy_aime, backend, monkeypatch):
    config = _config(toy_aime, batch_rollouts=2)  # two batches; the second one is lost
    backends = {config.models[0]: backend}
    whole = eval_job(Warehouse(tmp_path / "whole"), config, backends=backends, progress=False)
    broken = Warehouse(tmp_path / "broken")
    write_batch, calls = Warehouse.write_eval_batch, []

    def dies_on_the_second_batch(self, eval_id, rollouts, segments):
        calls.append(eval_id)
        if len(calls) == 2:  # the writer dies after the segments part, before the committing rollouts part
            self._write(schema.EVAL_SEGMENTS, segments, "part-dead.parquet", eval=eval_id)
            raise _Killed
        write_batch(self, eval_id, rollouts, segments)

    monkeypatch.setattr(Warehouse, "write_eval_batch", dies_on_the_second_batch)
    with pytest.raises(_Killed):
        eval_job(broken, config, backends=backends, progress=False)
    monkeypatch.undo()
    (before,) = whole.rows
    assert len(broken.eval_rollout_ids(before.eval_id)) == 2 and broken.read_eval_run(before.eval_id) is None
    assert len(list((broken.root / "eval_segments").rglob("part-*.parquet"))) == 2  # one of them uncommitted
    resumed = eval_job(broken, config, backends=backends, progress=False)
    (after,) = resumed.rows
    assert resumed.computed == [before.eval_id] == [after.eval_id]
    assert_same_collection(_stored(broken, after.eval_id), _stored(Warehouse(tmp_path / "whole"), before.eval_id))
    assert (after.avg_at_n, after.pass_at_k, after.maj_at_n, after.failures_per_trajectory) == (
        before.avg_at_n, before.pass_at_k, before.maj_at_n, before.failures_per_trajectory)
    assert (before.rollouts_generated, after.rollouts_generated) == (4, 2)
    assert eval_job(broken, config, backends=backends, progress=False).computed == []  # complete: not run again
