"""Sharded collect and purify (docs/architecture.md §5): shares are disjoint sets of whole prompts,
and the shards of an iteration together write what one unsharded run writes (token for token; the
log-probs within float rounding), also when a shard is SIGKILLed and resumed on its own."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest
import torch
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import CollectConfig, PurifyConfig, Shard
from cleaner.engine.collect.job import CollectRequest, collect_job, load_tasks
from cleaner.engine.model import load_backend
from cleaner.engine.purify.job import PurifyRequest, purify_job
from cleaner.errors import JobError
from cleaner.sandbox import SandboxConfig
from cleaner.warehouse import Warehouse
from tests.helpers import BATCH_ATOL, assert_same_collection, cli, sigkill_when

# ---------------------------------------------------------------------------------------------
# The shard itself


def test_shard_parses_i_of_n_and_rejects_anything_else():
    assert Shard.parse("1/4") == Shard(1, 4) and Shard.parse(" 0/1 ") == Shard()
    for text in ("2/2", "0/0", "-1/2", "1", "a/b", "1/2/3", ""):
        with pytest.raises(ValueError, match="--shard takes i/N with 0 <= i < N"):
            Shard.parse(text)


def test_shares_are_disjoint_cover_every_prompt_and_depend_on_the_prompt_alone():
    prompts = [f"toy-7-{index}" for index in range(300)]
    owners = [[shard for shard in range(3) if Shard(shard, 3).owns(p)] for p in prompts]
    assert all(len(found) == 1 for found in owners)
    assert all(Shard().owns(p) for p in prompts)
    sizes = [sum(found == [shard] for found in owners) for shard in range(3)]
    assert min(sizes) > 70  # a hash share, close to 100 each
    # the share of a prompt does not change with the other prompts of the iteration
    assert [Shard(1, 3).owns(p) for p in prompts[:10]] == [found == [1] for found in owners[:10]]


def test_cli_rejects_a_bad_shard_in_one_line(tmp_path):
    for command in ("collect", "purify"):
        result = CliRunner().invoke(app, [command, "-w", str(tmp_path / "w"), "--shard", "2/2"])
        assert result.exit_code == 1
        assert "error: invalid option: --shard takes i/N with 0 <= i < N, got '2/2'" in " ".join(result.output.split())
    assert not (tmp_path / "w").exists()


# ---------------------------------------------------------------------------------------------
# Sharded equals unsharded


def _config(policy) -> CollectConfig:
    # seed 0's six toy prompts fall 1 / 5 into shards 0/2 and 1/2
    return CollectConfig(model=str(policy), n_prompts=6, group_size=2, max_turns=2, max_new_tokens=24,
                         max_response_tokens=48, batch_rollouts=2, sandbox=SandboxConfig(workers=1))


def _collected(warehouse: Warehouse) -> tuple[list, list]:
    """Every rollout (without its write time) and every segment of iteration 0, in a fixed order."""
    rollouts = sorted((dataclasses.replace(r, created_at=None) for r in warehouse.read_rollouts(0)),
                      key=lambda r: r.rollout_id)
    segments = sorted(warehouse.read_segments(0), key=lambda s: (s.rollout_id, s.seq))
    return rollouts, segments


def _without_logprobs(row) -> dict:
    fields = dataclasses.asdict(row)
    del fields["old_logprobs"], fields["behavior_logprobs"]
    return fields


@pytest.fixture(scope="module")
def backend(random_policy):
    return load_backend("torch", str(random_policy), device="cpu")


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, random_policy, backend):
    warehouse = Warehouse(tmp_path_factory.mktemp("unsharded") / "wh")
    collect_job(warehouse, CollectRequest(_config(random_policy)), backend=backend, progress=False)
    return warehouse


def test_two_shards_collect_and_purify_exactly_what_one_run_does(tmp_path, random_policy, backend, unsharded):
    config = _config(random_policy)
    owned = [sum(Shard(i, 2).owns(t.prompt_id) for t in load_tasks(config)) for i in range(2)]
    assert owned == [1, 5]
    warehouse = Warehouse(tmp_path / "wh")
    outcomes = [collect_job(warehouse, CollectRequest(config, Shard(i, 2)), backend=backend, progress=False) for i in range(2)]
    assert [(o.n_planned, o.n_written) for o in outcomes] == [(2, 2), (10, 10)]
    assert [o.summary.rollouts for o in outcomes] == [2, 10]  # each summary is of its share
    assert_same_collection(_collected(warehouse), _collected(unsharded))
    assert sum(len(s.token_ids) for s in _collected(warehouse)[1]) > 0
    assert warehouse.collect_config(0) == unsharded.collect_config(0)
    assert sorted(p.name for p in (warehouse.root / "configs").iterdir()) == [
        "collect-iteration=0.json", "collect-plan-iteration=0.json"]  # the shards' one config and plan
    with pytest.raises(JobError, match="iteration 0 shard 1/2 already holds 10 rollouts; pass --resume"):
        collect_job(warehouse, CollectRequest(config, Shard(1, 2)), backend=backend, progress=False)

    purify = [PurifyConfig(gamma=0.3), PurifyConfig(rollback_prob=0.5)]
    whole = purify_job(unsharded, PurifyRequest(0, purify), backend=backend, progress=False)
    shards = [purify_job(warehouse, PurifyRequest(0, purify, Shard(i, 2)), backend=backend, progress=False) for i in range(2)]
    assert [len(s.results[0].rows) for s in shards] == [2, 10]
    for config in purify:
        expected = sorted(unsharded.read_purified(0, config.config_id), key=lambda r: r.rollout_id)
        assert len(expected) == 12
        rows = sorted(warehouse.read_purified(0, config.config_id), key=lambda r: r.rollout_id)
        # Everything but the log-probs is equal exactly: the same tokens, masks and group advantages.
        # The scorer packs another set of rows into its forwards, and collection decoded another set
        # of rollouts together, which moves a float32 log-prob by rounding only (docs/architecture.md §6).
        assert [_without_logprobs(r) for r in rows] == [_without_logprobs(r) for r in expected]
        for row, reference in zip(rows, expected, strict=True):
            assert row.old_logprobs == pytest.approx(reference.old_logprobs, abs=1e-5)
            assert row.behavior_logprobs == pytest.approx(reference.behavior_logprobs, abs=BATCH_ATOL)
    assert whole.results[0].stats.n_rollouts == 12
    again = purify_job(warehouse, PurifyRequest(0, purify, Shard(0, 2)), backend=backend, progress=False)
    assert again.computed == [] and again.scorer_stats is None  # the shard's rows are stored
    assert warehouse.connect().sql("SELECT count(*) FROM purify_configs").fetchall() == [(2,)]


def test_purify_resumes_a_share_whose_groups_are_partly_stored(tmp_path, random_policy, backend, unsharded):
    """A shard of another split already wrote some groups: the rest are purified, none twice."""
    import shutil

    shutil.copytree(unsharded.root, tmp_path / "wh", ignore=shutil.ignore_patterns("purified", "purify_configs"))
    warehouse = Warehouse(tmp_path / "wh")
    config = PurifyConfig(gamma=0.3)
    purify_job(warehouse, PurifyRequest(0, [config], Shard(0, 2)), backend=backend, progress=False)
    outcome = purify_job(warehouse, PurifyRequest(0, [config]), backend=backend, progress=False)  # unsharded now
    assert outcome.computed == [config.config_id]
    assert len(outcome.results[0].rows) == 12
    rows = warehouse.read_purified(0, config.config_id)
    assert sorted(r.rollout_id for r in rows) == sorted(r.rollout_id for r in unsharded.read_rollouts(0))


def test_sigkill_one_shard_then_resume_it_has_every_rollout_once(tmp_path, random_policy, backend, unsharded):
    warehouse = tmp_path / "wh"
    args = ["collect", "-w", str(warehouse), "--prompts", "6", "--group-size", "2", "--batch-rollouts", "2",
            "--max-concurrent-rollouts", "3", "--model", str(random_policy), "--max-turns", "2", "--max-new-tokens", "24",
            "--max-response-tokens", "48", "--sandbox-workers", "1"]
    # A forward's float rounding depends on the thread count: the subprocesses use this process's.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    rollouts_dir = warehouse / "rollouts" / "iteration=0"
    sigkill_when(cli(*args, "--shard", "1/2"), lambda: len(list(rollouts_dir.glob("part-*.parquet"))) >= 1, 120, env)
    assert len(Warehouse(warehouse).rollout_ids(0)) < 10, "killed too late to test resume"
    # shard 0 runs on, unaffected by its killed sibling (in this process, to spare a model load)
    other = collect_job(Warehouse(warehouse), CollectRequest(_config(random_policy), Shard(0, 2)), backend=backend,
                        progress=False)
    assert other.n_written == 2
    refused = CliRunner().invoke(app, args[:1] + ["--shard", "1/2"] + args[1:])
    output = " ".join(refused.output.split())
    assert refused.exit_code == 1 and "shard 1/2 already holds" in output and "--resume" in output
    finished = subprocess.run(cli(*args, "--shard", "1/2", "--resume"), capture_output=True, text=True, env=env)
    assert finished.returncode == 0, finished.stderr
    assert_same_collection(_collected(Warehouse(warehouse)), _collected(unsharded))
    connection = Warehouse(warehouse).connect()
    assert connection.sql("SELECT count(*), count(DISTINCT rollout_id) FROM rollouts").fetchall() == [(12, 12)]
    assert connection.sql(
        "SELECT count(*) FROM (SELECT rollout_id, seq FROM segments GROUP BY 1, 2 HAVING count(*) > 1)"
    ).fetchall() == [(0,)]


def test_a_shard_with_another_config_is_refused(tmp_path, random_policy, backend):
    warehouse = Warehouse(tmp_path / "wh")
    config = _config(random_policy)
    collect_job(warehouse, CollectRequest(config, Shard(0, 2)), backend=backend, progress=False)
    with pytest.raises(JobError, match=r"collected with another config \(--max-turns 2 then, 3 now; --temperature "
                                       r"1.0 then, 0.5 now\); resuming it"):
        collect_job(warehouse, CollectRequest(dataclasses.replace(config, temperature=0.5, max_turns=3), Shard(1, 2)),
                    backend=backend, progress=False)
