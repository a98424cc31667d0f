"""The stages' jobs (cleaner/engine/<stage>/job.py): what needs no model, or only the tiny one."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest

from cleaner.engine.purify.job import _cyclic_gc_paused


def test_cyclic_gc_is_paused_inside_and_restored_after_an_error():
    assert gc.isenabled()
    with _cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _cyclic_gc_paused():
        raise RuntimeError("a failing job")
    assert gc.isenabled()


def test_a_collector_disabled_by_the_caller_stays_disabled():
    gc.disable()
    try:
        with _cyclic_gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_purify_job_runs_with_the_collector_paused(tmp_path):
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.errors import JobError
    from cleaner.warehouse import Warehouse

    seen = []

    class EmptyWarehouse(Warehouse):
        def read_rollouts(self, iteration):
            seen.append(gc.isenabled())
            return []

    with pytest.raises(JobError, match="no rollouts"):
        purify_job(EmptyWarehouse(tmp_path / "empty"), PurifyRequest(0, []))
    assert seen == [False]
    assert gc.isenabled()


# ---------------------------------------------------------------------------------------------
# The glue on a real warehouse: the committed tiny policy collects 6 prompts x 2 samples


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    from typer.testing import CliRunner

    from cleaner.cli import app

    root = tmp_path_factory.mktemp("glue") / "wh"
    result = CliRunner().invoke(app, ["collect", "-w", str(root), "--prompts", "6", "--group-size", "2",
                                      "--seed", "3"])
    assert result.exit_code == 0, result.output
    return root


def _copy(collected, tmp_path):
    import shutil

    from cleaner.warehouse import Warehouse

    shutil.copytree(collected, tmp_path / "wh")
    return Warehouse(tmp_path / "wh")


def test_purify_job_purifies_several_configs_and_skips_stored_ones(collected, tmp_path):
    from cleaner.config import PurifyConfig
    from cleaner.engine.purify.job import PurifyRequest, purify_job

    warehouse = _copy(collected, tmp_path)
    configs = [PurifyConfig(gamma=0.3), PurifyConfig(gamma=0.7), PurifyConfig(gamma=0.7, rollback_prob=0.5)]
    first = purify_job(warehouse, PurifyRequest(0, configs), progress=False)
    assert first.computed == [c.config_id for c in configs] and first.scorer_stats is not None
    assert [r.config for r in first.results] == configs
    assert all(len(r.rows) == 12 for r in first.results)
    assert warehouse.purify_config_ids() == {c.config_id for c in configs}
    more = [configs[2], PurifyConfig(gamma=1.5), configs[0]]
    second = purify_job(warehouse, PurifyRequest(0, more), progress=False)
    assert second.computed == [more[1].config_id]  # only the new config is scored
    assert [r.config for r in second.results] == more  # in request order
    for stored, again in ((first.results[2], second.results[0]), (first.results[0], second.results[2])):
        assert [row.token_ids for row in again.rows] == [row.token_ids for row in stored.rows]
        assert again.stats == stored.stats  # rebuilt from the stored rows
    third = purify_job(warehouse, PurifyRequest(0, more), progress=False)
    assert third.computed == [] and third.scorer_stats is None


def test_replace_and_mask_share_one_scorer_pass_and_mask_scores_the_raw_rows(collected, tmp_path):
    from cleaner.config import PurifyConfig
    from cleaner.engine.purify.job import PurifyRequest, purify_job

    replace, mask, raw = PurifyConfig(), PurifyConfig(edit="mask"), PurifyConfig(rollback_prob=0.0)
    warehouse = _copy(collected, tmp_path / "a")
    ablation = purify_job(warehouse, PurifyRequest(0, [replace, mask]), progress=False)
    reference = purify_job(_copy(collected, tmp_path / "b"), PurifyRequest(0, [replace, raw]), progress=False)
    # one pass over the trie of both configs, which forwards exactly what replace and the raw view need
    assert ablation.scorer_stats.tokens_forwarded == reference.scorer_stats.tokens_forwarded
    assert ablation.scorer_stats.tokens_naive == reference.scorer_stats.tokens_naive
    masked, raw_rows = ablation.results[1], reference.results[1]
    assert masked.stats.n_shallow + masked.stats.n_deep > 0 and masked.stats.tokens_masked > 0
    for row, base in zip(masked.rows, raw_rows.rows, strict=True):
        assert row.token_ids == base.token_ids and row.advantage == base.advantage
        assert all(m <= b for m, b in zip(row.loss_mask, base.loss_mask, strict=True))
        assert row.old_logprobs == tuple(o if m else 0.0 for o, m in zip(base.old_logprobs, row.loss_mask, strict=True))
    again = purify_job(warehouse, PurifyRequest(0, [mask]), progress=False)  # rebuilt from the stored rows
    assert again.computed == [] and again.results[0].stats == masked.stats


def test_train_job_writes_the_checkpoint_and_its_steps(collected, tmp_path):
    from cleaner.config import DEFAULT_POLICY, PurifyConfig, TrainConfig
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.engine.train.job import TrainRequest, train_job
    from cleaner.errors import JobError

    warehouse = _copy(collected, tmp_path)
    config = PurifyConfig()
    with pytest.raises(JobError, match="run `cleaner purify` first"):
        train_job(warehouse, TrainRequest(0, config.config_id, DEFAULT_POLICY, tmp_path / "out", TrainConfig()),
                  progress=False)
    purify_job(warehouse, PurifyRequest(0, [config]), progress=False)
    train = TrainConfig(lr=1e-4, mini_batch_size=6, micro_batch_size=3)
    outcome = train_job(warehouse, TrainRequest(0, config.config_id, DEFAULT_POLICY, tmp_path / "out", train),
                        progress=False)
    assert outcome.result.out_path == (tmp_path / "out").resolve() and outcome.seconds > 0
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "optimizer" / "state.pt").is_file()
    steps = warehouse.connect().sql("SELECT step, optimizer_step, train_config_id FROM train_steps ORDER BY step").fetchall()
    resolved = dataclasses.replace(train, compute_dtype="float32")  # `auto` is stored as what it resolved to
    assert steps == [(s.step, s.optimizer_step, resolved.config_id) for s in outcome.result.steps] and len(steps) == 2
    # the config by its id, which the rows name; another training of the iteration adds its own
    assert warehouse.load_config(f"train-config={resolved.config_id}") == resolved.to_json()
    other = dataclasses.replace(train, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=64)
    train_job(warehouse, TrainRequest(0, config.config_id, DEFAULT_POLICY, tmp_path / "out2", other), progress=False)
    other = dataclasses.replace(other, compute_dtype="float32")
    assert warehouse.load_config(f"train-config={resolved.config_id}") == resolved.to_json()
    assert warehouse.load_config(f"train-config={other.config_id}") == other.to_json()
    ids = warehouse.connect().sql("SELECT DISTINCT train_config_id FROM train_steps ORDER BY 1").fetchall()
    assert sorted(ids) == sorted([(resolved.config_id,), (other.config_id,)])


def test_purify_ablate_and_train_commands(collected, tmp_path):
    from typer.testing import CliRunner

    from cleaner.cli import app
    from cleaner.config import DEFAULT_POLICY, PurifyConfig

    warehouse = _copy(collected, tmp_path)
    cli = CliRunner()
    purified = cli.invoke(app, ["purify", "-w", str(warehouse.root), "--gamma", "0.7"])
    assert purified.exit_code == 0, purified.output
    config_id = PurifyConfig(gamma=0.7).config_id
    assert config_id[:8] in purified.output and "1 config(s)" in purified.output
    ablated = cli.invoke(app, ["ablate", "-w", str(warehouse.root), "--gamma", "0.3,0.7", "--rollback-prob", "1.0"])
    assert ablated.exit_code == 0, ablated.output
    assert f"already stored, not recomputed: {config_id}" in ablated.output
    assert "2 config(s)" in ablated.output
    trained = cli.invoke(app, ["train", "-w", str(warehouse.root), "--config-id", config_id, "--policy",
                               str(DEFAULT_POLICY), "--out", str(tmp_path / "ckpt"), "--lr", "1e-4",
                               "--mini-batch-size", "12", "--micro-batch-size", "4"])
    assert trained.exit_code == 0, trained.output
    assert "1 steps" in trained.output and f"checkpoint -> {tmp_path / 'ckpt'}" in trained.output
    assert warehouse.connect().sql("SELECT count(*) FROM train_steps").fetchall() == [(1,)]
    missing = cli.invoke(app, ["train", "-w", str(warehouse.root), "--config-id", "nope", "--policy",
                               str(DEFAULT_POLICY), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "run `cleaner purify` first" in missing.output


# ---------------------------------------------------------------------------------------------
# What no policy produced: refused where a warehouse written by an older version holds it


def _rewritten(collected, tmp_path, segment_change=None, row_change=None):
    """A warehouse holding `collected`'s iteration 0 as an older cleaner would have stored it with
    `segment_change(segment) -> segment` applied (and, purified under the default config,
    `row_change(row) -> row`): (warehouse, the rollout ids changed)."""
    from cleaner.config import PurifyConfig
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.warehouse import Warehouse
    from tests.factories import make_purify_config

    source = _copy(collected, tmp_path / "source")
    rollouts, segments = source.read_rollouts(0), source.read_segments(0)
    changed = set()
    if segment_change is not None:
        segments = [segment_change(s) for s in segments]
        changed = {s.rollout_id for s, o in zip(segments, source.read_segments(0), strict=True) if s != o}
    warehouse = Warehouse(tmp_path / "wh")
    warehouse.save_collect_config(0, source.collect_config(0))
    warehouse.write_rollouts(0, rollouts, segments)
    if row_change is not None:
        config = PurifyConfig()
        purify_job(source, PurifyRequest(0, [config]), progress=False)
        rows = [row_change(row) for row in source.read_purified(0, config.config_id)]
        changed = {r.rollout_id for r, o in zip(rows, source.read_purified(0, config.config_id), strict=True) if r != o}
        warehouse.write_purified(0, make_purify_config(config.config_id), rows)
    return warehouse, changed


def _assistant_of(rollout_id: str, change):
    """A segment change applied to `rollout_id`'s first assistant segment only."""
    def apply(segment):
        if segment.rollout_id == rollout_id and segment.kind == "assistant" and segment.seq == 1:
            return change(segment)
        return segment
    return apply


@pytest.mark.parametrize(("change", "why"), [
    (lambda s: dataclasses.replace(s, logprobs=(float("nan"),) + s.logprobs[1:]), "log-prob nan at position 0"),
    (lambda s: dataclasses.replace(s, logprobs=(0.5,) + s.logprobs[1:]), "log-prob 0.5 at position 0"),
    (lambda s: dataclasses.replace(s, token_ids=(512,) + s.token_ids[1:]), "token id 512 at position 0 is outside the vocabulary"),
])
def test_purify_refuses_what_an_older_version_stored_unchecked_naming_the_rollout(collected, tmp_path, change, why):
    from typer.testing import CliRunner

    from cleaner.cli import app

    rollout_id = _copy(collected, tmp_path / "ids").read_rollouts(0)[3].rollout_id
    warehouse, changed = _rewritten(collected, tmp_path, segment_change=_assistant_of(rollout_id, change))
    assert changed == {rollout_id}
    result = CliRunner().invoke(app, ["purify", "-w", str(warehouse.root)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert f"1 rollout(s) hold tokens or log-probs no policy produced: {rollout_id} (seq 1: {why}" in line, line
    assert not list(warehouse.root.glob("purified/**/*.parquet"))


def test_train_refuses_rows_holding_nan_naming_the_rollout(collected, tmp_path):
    from cleaner.config import DEFAULT_POLICY, PurifyConfig, TrainConfig
    from cleaner.engine.train.job import TrainRequest, train_job
    from cleaner.errors import JobError

    def nan_old(row):
        if row.rollout_id != target:
            return row
        trained = row.loss_mask.index(1)
        old = list(row.old_logprobs)
        old[trained] = float("nan")
        return dataclasses.replace(row, old_logprobs=tuple(old))

    target = _copy(collected, tmp_path / "ids").read_rollouts(0)[5].rollout_id
    warehouse, changed = _rewritten(collected, tmp_path, row_change=nan_old)
    assert changed == {target}
    request = TrainRequest(0, PurifyConfig().config_id, DEFAULT_POLICY, tmp_path / "out",
                           TrainConfig(lr=1e-4, mini_batch_size=6, micro_batch_size=3))
    with pytest.raises(JobError, match=f"1 rollout\\(s\\) hold values no policy produced: {target} \\(old log-prob nan"):
        train_job(warehouse, request, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_train_job_whose_loss_is_never_finite_fails_and_saves_nothing(collected, tmp_path):
    """The policy's forward gives NaN (a broken checkpoint): every step's loss is NaN, every step
    is skipped, and the job says so in one line instead of saving the policy and succeeding."""
    import shutil

    import torch
    from typer.testing import CliRunner

    from cleaner.cli import app
    from cleaner.config import DEFAULT_POLICY, PurifyConfig
    from cleaner.engine.model.loading import load_policy

    warehouse = _copy(collected, tmp_path)
    assert CliRunner().invoke(app, ["purify", "-w", str(warehouse.root)]).exit_code == 0
    broken = tmp_path / "broken"
    shutil.copytree(DEFAULT_POLICY, broken)
    model = load_policy(broken, "cpu", torch.float32)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    result = CliRunner().invoke(app, ["train", "-w", str(warehouse.root), "--config-id", PurifyConfig().config_id,
                                      "--policy", str(broken), "--out", str(tmp_path / "ckpt"), "--lr", "1e-4",
                                      "--mini-batch-size", "6", "--micro-batch-size", "3"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "iteration 0: the loss is not finite at any of its 2 steps" in line
    assert not (tmp_path / "ckpt").exists()
    assert warehouse.connect().sql("SELECT count(*) FROM train_steps").fetchall() == [(0,)]


def test_purify_stores_nothing_its_scorer_made_non_finite(collected, tmp_path):
    """The collecting policy's scorer gives NaN (a forward that overflowed): the rows' old log-probs
    would train as numbers, so purify refuses in one line naming the rollouts and stores no row."""
    import torch

    from cleaner.config import DEFAULT_POLICY, PurifyConfig
    from cleaner.engine.model.torch_backend import TorchBackend
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.errors import JobError

    warehouse = _copy(collected, tmp_path)
    backend = TorchBackend(DEFAULT_POLICY)
    try:
        with torch.no_grad():
            backend.model.model.norm.weight.fill_(float("nan"))
        with pytest.raises(JobError) as raised:
            purify_job(warehouse, PurifyRequest(0, [PurifyConfig()]), backend=backend, progress=False)
    finally:
        backend.close()
    message = str(raised.value)
    assert "\n" not in message and f"iteration 0: the scorer of {DEFAULT_POLICY} gave 12 rollout(s) hold rows " \
        "no policy produced: " in message and "old log-prob nan at position 0 " in message, message
    assert message.count(" (old log-prob nan") == 5 and "and 7 more; score with a checkpoint" in message
    assert warehouse.purified_rollout_ids(0, PurifyConfig().config_id) == frozenset()
    assert not list(warehouse.root.glob("purified/**/*.parquet"))


def test_a_whole_batch_estimator_is_purified_whole_or_refused(collected, tmp_path):
    """reinforce_plus_plus_baseline whitens over the iteration: rows under it for part of the
    iteration (a collection resumed after its purify) cannot be completed, and a shard is refused
    before anything is read."""
    from cleaner.config import PurifyConfig, Shard
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.errors import JobError
    from tests.factories import make_purify_config

    config = PurifyConfig(adv_estimator="reinforce_plus_plus_baseline")
    whole = _copy(collected, tmp_path / "whole")
    rows = purify_job(whole, PurifyRequest(0, [config]), progress=False).results[0].rows
    part = _copy(collected, tmp_path / "part")
    half = rows[: len(rows) // 2]
    part.write_purified(0, make_purify_config(config.config_id), half)
    with pytest.raises(JobError, match=rf"rows under purify config {config.config_id} for {len(half)} of its "
                                       rf"{len(rows)} rollouts, and adv_estimator reinforce_plus_plus_baseline"):
        purify_job(part, PurifyRequest(0, [config]), progress=False)
    with pytest.raises(JobError, match="--shard 0/2: adv_estimator reinforce_plus_plus_baseline whitens"):
        purify_job(part, PurifyRequest(0, [config], Shard(0, 2)), progress=False)
    grpo = purify_job(part, PurifyRequest(0, [PurifyConfig()], Shard(0, 2)), progress=False)  # grpo shards
    assert grpo.results[0].rows


def test_train_job_recomputes_advantages_with_the_stored_purify_configs_estimator(collected, tmp_path, monkeypatch):
    from cleaner.config import DEFAULT_POLICY, PurifyConfig, TrainConfig
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.engine.train import job
    from cleaner.engine.train.trainer import TrainResult

    warehouse = _copy(collected, tmp_path)
    config = PurifyConfig(adv_estimator="rloo")
    purify_job(warehouse, PurifyRequest(0, [config]), progress=False)
    seen = {}

    def trained(rows, policy, out, train, iteration, **handles):
        seen.update(handles)
        return TrainResult(out_path=Path(out), steps=[], model=None, optimization=None, main_process=False)

    monkeypatch.setattr(job, "train_iteration", trained)
    job.train_job(warehouse, job.TrainRequest(0, config.config_id, DEFAULT_POLICY, tmp_path / "out", TrainConfig()),
                  progress=False)
    assert seen["purify"] == config
