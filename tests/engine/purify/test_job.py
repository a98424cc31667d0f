"""The purify job (cleaner/engine/purify/job.py) on a hand-built warehouse and a fake backend.

The warehouse holds iteration 3 of tests/factories.py: four rollouts r1..r4 in groups g1 and g2, each
a prompt, a failed call, a similar retry and an answer, with the plan and collect config `collect`
records. The backend serves a checkpoint folder that is only a config.json (its vocabulary), and its
scorer is the factories' FakeScorer (log pi(token) = -0.01 * token id). What the job stores is
checked against the pipeline (`purify_iteration`, tested on its own) run on the same rollouts: the
job's part is what it reads, what it refuses, what it skips, what it stores and where. The tests
build no model and no collection, so they run in seconds (the mutation batch `purify-job`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest

from cleaner.config import UNSHARDED, CollectConfig, PurifyConfig, Shard
from cleaner.engine.collect.agent import rollout_key
from cleaner.engine.collect.summary import summarize
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.model.base import ScorerStats
from cleaner.engine.purify import job as purify_module
from cleaner.engine.purify.job import (
    PurifyRequest,
    check_down_sampling,
    check_whole_batch,
    purify_job,
    stored_iteration,
)
from cleaner.engine.purify.pipeline import purify_iteration
from cleaner.errors import JobError
from cleaner.warehouse import Warehouse, schema
from cleaner.warehouse.configs import CollectPlan
from cleaner.warehouse.gate import Refused
from cleaner.warehouse.lock import LockHeld
from cleaner.warehouse.parts import WarehouseError
from tests.factories import ROLLOUTS, SEGMENTS, FakeScorer, make_purify_config

ITERATION = 3  # the factories' purify iteration
VOCAB = 1000  # the checkpoint's vocabulary: every stored token id (101..430) is below it
HALF = PurifyConfig(gamma=0.5, rollback_prob=0.5)
DEEP = PurifyConfig(gamma=1.5, rollback_prob=1.0)
BY_CALL = PurifyConfig(gamma=0.5, rollback_prob=1.0, similarity_on="call")  # needs the tokenizer's decode
MASK = PurifyConfig(gamma=0.5, rollback_prob=1.0, edit="mask")
WHOLE = PurifyConfig(adv_estimator="reinforce_plus_plus_baseline")  # whitens over the whole iteration
PLAN = CollectPlan(("g1", "g2"), 2)  # a group of two of each prompt


class FakeTokenizer:
    """The two special tokens ChatFormat needs, and a decode that spells every id."""

    SPECIAL = {"</tool_call>": 9001, "<|im_end|>": 9002}

    def encode(self, text, add_special_tokens=False):
        return [self.SPECIAL[text]]

    def decode(self, token_ids, skip_special_tokens=False):
        return " ".join(f"t{token % 10}" for token in token_ids)  # ids of one rollout differ by 100s


def decode(token_ids):
    return FakeTokenizer().decode(list(token_ids))


class CountingScorer(FakeScorer):
    version = "fake"

    def __init__(self, nan: bool = False) -> None:
        super().__init__()
        self.stats = ScorerStats()
        self.nan = nan

    def score_rows(self, sequences, starts):
        self.stats.n_forwards += 1
        scores = super().score_rows(sequences, starts)
        return [[math.nan] * len(row) for row in scores] if self.nan else scores


class FakeBackend:
    """What purify asks of a backend: its checkpoint, tokenizer, policy version and scorer."""

    def __init__(self, model_path, nan: bool = False) -> None:
        self.model_path = str(model_path)
        self.tokenizer = FakeTokenizer()
        self.policy_version = "v7"
        self.nan = nan
        self.scorers: list[tuple[CountingScorer, bool, dict]] = []  # each scorer, its progress and options
        self.closed = False

    def scorer(self, progress=True, **options):
        scorer = CountingScorer(self.nan)
        self.scorers.append((scorer, progress, options))
        return scorer

    def sequences(self) -> set[tuple[int, ...]]:
        return {row for scorer, _, _ in self.scorers for sequences, _ in scorer.calls for row in sequences}

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def policy(tmp_path):
    """A checkpoint folder as purify reads it: its config.json's vocabulary."""
    folder = tmp_path / "policy"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return folder


def build(root, policy, rollouts=ROLLOUTS, segments=SEGMENTS, plan: CollectPlan | None = PLAN,
          **collect) -> Warehouse:
    """Iteration 3 as `collect` leaves it: its rollouts, its collect config and (unless None) its plan."""
    warehouse = Warehouse(root)
    warehouse.write_rollouts(ITERATION, rollouts, segments)
    config = dict(model=str(policy), iteration=ITERATION, n_prompts=2, group_size=2) | collect
    warehouse.save_collect_config(ITERATION, CollectConfig(**config).to_json())
    if plan is not None:
        warehouse.save_plan(ITERATION, plan)
    return warehouse


def expected(configs, warehouse):
    """The pipeline's results for the configs over the warehouse's iteration as it reads back (its
    log-probs in float32), as the job must store them (config id -> result)."""
    results = purify_iteration(warehouse.read_rollouts(ITERATION), warehouse.read_segments(ITERATION), configs,
                               FakeScorer(), decode, scorer_version="fake:v7")
    return {result.config.config_id: result for result in results}


def by_rollout(rows):
    return sorted(rows, key=lambda row: (row.rollout_id, row.negative_seq or -1))


def as_stored(rows):
    """Rows as the warehouse stores them (its log-probs and advantages in float32), by rollout."""
    return by_rollout(schema.from_table(schema.PURIFIED, schema.to_table(schema.PURIFIED, rows)))


def stored_files(root):
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


# ---------------------------------------------------------------------------------------------
# What it stores


def test_every_configs_rows_are_stored_as_the_pipeline_renders_them_with_their_config(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    backend = FakeBackend(policy)
    configs = [HALF, DEEP, BY_CALL]
    outcome = purify_job(warehouse, PurifyRequest(ITERATION, tuple(configs)), backend=backend, progress=False)
    reference = expected(configs, warehouse)
    assert [result.config for result in outcome.results] == configs  # in request order
    assert outcome.computed == [config.config_id for config in configs]
    for config, result in zip(configs, outcome.results, strict=True):
        assert result.rows == reference[config.config_id].rows
        assert result.stats == reference[config.config_id].stats
        assert as_stored(warehouse.read_purified(ITERATION, config.config_id)) == as_stored(result.rows)
        assert all(row.scorer_version == "fake:v7" for row in result.rows)  # scorer's version : policy's
        params = warehouse.purify_params(config.config_id)
        assert params == config.to_json()
        assert warehouse.load_config(f"purify-iteration={ITERATION}-config={config.config_id}") == params
    (scorer, progress, options), = backend.scorers  # one scorer pass for every config
    assert outcome.scorer_stats is scorer.stats and scorer.stats.n_forwards == len(scorer.calls) >= 1
    assert (progress, options) == (False, {})  # no memory budget asked for: the scorer's own
    assert not backend.closed  # the caller's backend stays open
    assert 0 < outcome.seconds < 60


def test_the_config_rows_stored_hold_its_settings(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    purify_job(warehouse, PurifyRequest(ITERATION, (BY_CALL, MASK)), backend=FakeBackend(policy), progress=False)
    rows = {row["config_id"]: row for row in warehouse.connect().sql("SELECT * FROM purify_configs").pl().to_dicts()}
    assert set(rows) == {BY_CALL.config_id, MASK.config_id}
    for config in (BY_CALL, MASK):
        row = rows[config.config_id]
        assert (row["gamma"], row["rollback_prob"], row["similarity_on"], row["purify_when"], row["edit"]) == (
            config.gamma, config.rollback_prob, config.similarity_on.value, config.purify_when.value, config.edit.value)
        assert row["params_json"] == config.to_json()


def test_a_purify_again_computes_only_the_new_configs_and_rebuilds_the_rest_from_the_stored_rows(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    first = purify_job(warehouse, PurifyRequest(ITERATION, (HALF, MASK)), backend=FakeBackend(policy), progress=False)
    backend = FakeBackend(policy)
    second = purify_job(warehouse, PurifyRequest(ITERATION, (MASK, DEEP, HALF)), backend=backend, progress=False)
    assert second.computed == [DEEP.config_id]
    reference = expected([MASK, DEEP, HALF], warehouse)
    for result in second.results:  # stored ones rebuilt with their stats, the mask's masked tokens and errors too
        assert as_stored(result.rows) == as_stored(reference[result.config.config_id].rows)
        assert result.stats == reference[result.config.config_id].stats
    assert second.results[0].stats == first.results[1].stats and second.results[0].stats.tokens_masked > 0
    assert second.results[2].stats.errors_by_type == (("NameError", 3), ("timeout", 1))
    (scorer, _, _), = backend.scorers
    assert second.scorer_stats is scorer.stats
    for config in (HALF, MASK, DEEP):  # nothing stored twice
        assert len(warehouse.read_purified(ITERATION, config.config_id)) == len(reference[config.config_id].rows)
    untouched = FakeBackend(policy)
    third = purify_job(warehouse, PurifyRequest(ITERATION, (DEEP,)), backend=untouched, progress=False)
    assert (third.computed, third.scorer_stats, untouched.scorers) == ([], None, [])
    assert third.results[0].stats == reference[DEEP.config_id].stats


def test_a_config_stored_for_one_group_is_finished_with_the_other_group_alone(tmp_path, policy):
    """Whole groups are purified (advantages see the whole group); the rows stored already are
    neither scored nor written again, and the result covers every rollout."""
    warehouse = build(tmp_path / "wh", policy)
    reference = expected([HALF], warehouse)[HALF.config_id]
    warehouse.write_purified(ITERATION, make_purify_config(HALF.config_id),
                             [row for row in reference.rows if row.group_id == "g1"])
    backend = FakeBackend(policy)
    outcome = purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=backend, progress=False)
    assert outcome.computed == [HALF.config_id]
    assert backend.sequences() and all(token // 100 in (3, 4) for row in backend.sequences() for token in row)
    assert as_stored(outcome.results[0].rows) == as_stored(reference.rows)
    assert outcome.results[0].stats == reference.stats  # rebuilt over all four, not the two just computed
    assert as_stored(warehouse.read_purified(ITERATION, HALF.config_id)) == as_stored(reference.rows)


def test_a_config_given_twice_is_purified_once_and_the_request_keeps_the_first_order(tmp_path, policy):
    request = PurifyRequest(ITERATION, [DEEP, HALF, PurifyConfig(gamma=1.5, rollback_prob=1.0), HALF])
    assert request.configs == (DEEP, HALF)
    outcome = purify_job(build(tmp_path / "wh", policy), request, backend=FakeBackend(policy), progress=False)
    assert outcome.computed == [DEEP.config_id, HALF.config_id] and len(outcome.results) == 2


def test_a_request_runs_on_torch_on_the_cpu_with_the_scorers_own_budget_by_default():
    request = PurifyRequest(0, ())
    assert (request.shard, request.backend_kind, request.sglang_url, request.device, request.scorer_memory_gb) == (
        UNSHARDED, "torch", None, "cpu", None)


def test_without_a_backend_the_requested_one_is_loaded_with_the_collecting_policy_and_closed(tmp_path, policy,
                                                                                            monkeypatch):
    loaded = []

    def load_backend(kind, model_path, device="cpu", sglang_url=None):
        loaded.append((kind, model_path, device, sglang_url, FakeBackend(policy)))
        return loaded[-1][-1]

    monkeypatch.setattr(purify_module, "load_backend", load_backend)
    monkeypatch.setattr(purify_module, "check_device", lambda device: None)  # as if this machine had the GPU
    warehouse = build(tmp_path / "wh", policy)
    request = PurifyRequest(ITERATION, (HALF,), backend_kind="sglang", sglang_url="http://127.0.0.1:9", device="cuda:3",
                            scorer_memory_gb=3.0)
    outcome = purify_job(warehouse, request, progress=True)
    (kind, model_path, device, url, backend), = loaded
    assert (kind, model_path, device, url) == ("sglang", str(policy), "cuda:3", "http://127.0.0.1:9")
    assert backend.closed
    (scorer, progress, options), = backend.scorers
    assert (progress, options) == (True, {"memory_bytes": 3_000_000_000})
    assert outcome.results[0].rows == expected([HALF], warehouse)[HALF.config_id].rows


def test_a_backend_serving_the_policy_under_another_path_scores(tmp_path, policy):
    link = tmp_path / "link"
    link.symlink_to(policy)
    warehouse = build(tmp_path / "wh", policy)
    outcome = purify_job(warehouse, PurifyRequest(ITERATION, (HALF,), device="cuda:7"),
                         backend=FakeBackend(link), progress=False)  # a given backend: no device is loaded
    assert outcome.results[0].rows == expected([HALF], warehouse)[HALF.config_id].rows


# ---------------------------------------------------------------------------------------------
# A share of the iteration


def owner_of(prompt_ids, count):
    """(index of a shard owning the first prompt only, index of one owning none), of `count` shards."""
    owners = [[Shard(index, count).owns(prompt) for prompt in prompt_ids] for index in range(count)]
    first = next(index for index, owns in enumerate(owners) if owns == [True, False])
    empty = next(index for index, owns in enumerate(owners) if not any(owns))
    return first, empty


def test_a_shard_purifies_and_stores_its_share_only_and_the_iteration_reads_whole_once_every_shard_has(tmp_path,
                                                                                                      policy):
    first, _ = owner_of(["g1", "g2"], 4)
    other = next(index for index in range(4) if Shard(index, 4).owns("g2"))
    warehouse = build(tmp_path / "wh", policy)
    backend = FakeBackend(policy)
    outcome = purify_job(warehouse, PurifyRequest(ITERATION, (HALF,), Shard(first, 4)), backend=backend, progress=False)
    reference = expected([HALF], warehouse)[HALF.config_id]
    assert as_stored(outcome.results[0].rows) == [row for row in as_stored(reference.rows) if row.group_id == "g1"]
    assert all(token // 100 in (1, 2) for row in backend.sequences() for token in row)
    assert warehouse.purified_rollout_ids(ITERATION, HALF.config_id) == {"r1", "r2"}
    with pytest.raises(JobError) as raised:
        stored_iteration(warehouse, ITERATION, HALF)
    assert str(raised.value) == (f"{warehouse.root}: 2 rollouts of iteration 3 have no rows under purify config "
                                 f"{HALF.config_id}; purify every shard first")
    purify_job(warehouse, PurifyRequest(ITERATION, (HALF,), Shard(other, 4)), backend=FakeBackend(policy),
               progress=False)
    whole = stored_iteration(warehouse, ITERATION, HALF)
    assert whole.summary == summarize(ROLLOUTS, SEGMENTS)
    assert as_stored(whole.result.rows) == as_stored(reference.rows) and whole.result.stats == reference.stats
    again = purify_job(warehouse, PurifyRequest(ITERATION, (HALF,), Shard(first, 4)), backend=FakeBackend(policy),
                       progress=False)  # rebuilt from the share's stored rows and segments only
    assert again.computed == [] and as_stored(again.results[0].rows) == as_stored(outcome.results[0].rows)
    assert again.results[0].stats == outcome.results[0].stats
    with pytest.raises(JobError) as raised:
        stored_iteration(warehouse, ITERATION, DEEP)
    assert str(raised.value) == (f"{warehouse.root}: 4 rollouts of iteration 3 have no rows under purify config "
                                 f"{DEEP.config_id}; purify every shard first")


def test_a_shard_is_purified_while_the_others_are_still_missing_or_being_collected(tmp_path, policy):
    """The gate reads a shard's share: the other shards' prompts may be uncollected, or being collected."""
    first, _ = owner_of(["g1", "g2"], 4)
    other = next(index for index in range(4) if Shard(index, 4).owns("g2"))
    g1 = {rollout.rollout_id for rollout in ROLLOUTS if rollout.group_id == "g1"}
    warehouse = build(tmp_path / "wh", policy, [r for r in ROLLOUTS if r.rollout_id in g1],
                      [s for s in SEGMENTS if s.rollout_id in g1])
    with warehouse.writer("collect", ITERATION, (other, 4)):
        outcome = purify_job(warehouse, PurifyRequest(ITERATION, (HALF,), Shard(first, 4)), backend=FakeBackend(policy),
                             progress=False)
    assert {row.rollout_id for row in outcome.results[0].rows} == g1
    with pytest.raises(Refused, match=r"iteration 3 holds 2 of the 4 rollouts its collection planned"):
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)


def add_iteration(warehouse, policy, iteration):
    """Another iteration holding the same rollouts under the same ids (ids are an iteration's own)."""
    rollouts = [dataclasses.replace(rollout, iteration=iteration) for rollout in ROLLOUTS]
    warehouse.write_rollouts(iteration, rollouts, [dataclasses.replace(s, iteration=iteration) for s in SEGMENTS])
    config = CollectConfig(model=str(policy), iteration=iteration, n_prompts=2, group_size=2)
    warehouse.save_collect_config(iteration, config.to_json())
    warehouse.save_plan(iteration, PLAN)


def test_another_iterations_rollouts_and_rows_are_never_read_as_this_ones(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    add_iteration(warehouse, policy, 5)
    purify_job(warehouse, PurifyRequest(5, (HALF, DEEP)), backend=FakeBackend(policy), progress=False)
    reference = expected([HALF, DEEP], warehouse)
    first = purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert first.computed == [HALF.config_id] and as_stored(first.results[0].rows) == as_stored(reference[HALF.config_id].rows)
    with pytest.raises(JobError, match=f"4 rollouts of iteration 3 have no rows under purify config {DEEP.config_id}"):
        stored_iteration(warehouse, ITERATION, DEEP)  # iteration 5's rows under it are not iteration 3's
    again = purify_job(warehouse, PurifyRequest(ITERATION, (HALF, DEEP)), backend=FakeBackend(policy), progress=False)
    assert again.computed == [DEEP.config_id]
    for result in again.results:
        assert as_stored(result.rows) == as_stored(reference[result.config.config_id].rows)
        assert result.stats == reference[result.config.config_id].stats
    whole = stored_iteration(warehouse, ITERATION, HALF)
    assert whole.summary == summarize(ROLLOUTS, SEGMENTS) and len(whole.result.rows) == 4
    with pytest.raises(JobError, match="must be smaller than iteration 3's group size"):
        purify_job(warehouse, PurifyRequest(ITERATION, (PurifyConfig(down_sample="roc", down_sample_to=2, roc_min_negatives=1,
                                                                  roc_min_positives=1),)),
                   backend=FakeBackend(policy), progress=False)


def test_a_shard_that_owns_no_prompt_is_refused(tmp_path, policy):
    _, empty = owner_of(["g1", "g2"], 4)
    with pytest.raises(JobError) as raised:
        purify_job(build(tmp_path / "wh", policy), PurifyRequest(ITERATION, (HALF,), Shard(empty, 4)),
                   backend=FakeBackend(policy), progress=False)
    assert str(raised.value) == (f"{tmp_path / 'wh'}: shard {empty}/4 of iteration 3 holds no rollouts (more shards "
                                 "than prompts?)")


def test_an_iteration_without_rollouts_is_refused(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    with pytest.raises((JobError, Refused)) as raised:
        purify_job(warehouse, PurifyRequest(ITERATION + 1, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert "iteration 4" in str(raised.value)
    plain = build(tmp_path / "plain", policy)
    plain.save_collect_config(ITERATION + 1, CollectConfig(model=str(policy), iteration=4).to_json())
    plain.save_plan(ITERATION + 1, CollectPlan((), 2))
    with pytest.raises(JobError) as raised:
        purify_job(plain, PurifyRequest(ITERATION + 1, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert str(raised.value) == f"{plain.root}: iteration 4 has no rollouts; run `cleaner collect` first"


# ---------------------------------------------------------------------------------------------
# Refusals: one line, nothing written


def test_a_whole_batch_estimator_on_a_shard_is_refused_before_anything_is_made(tmp_path, policy):
    root = tmp_path / "absent"
    with pytest.raises(JobError) as raised:
        purify_job(Warehouse(root), PurifyRequest(ITERATION, (HALF, WHOLE), Shard(0, 2)), backend=FakeBackend(policy))
    assert str(raised.value) == ("--shard 0/2: adv_estimator reinforce_plus_plus_baseline whitens the advantages over "
                                 "the whole iteration, which a shard does not see; purify unsharded (one process), or "
                                 "use adv_estimator grpo or rloo")
    assert not root.exists()
    with pytest.raises(JobError, match=r"^--shards 2: adv_estimator reinforce_plus_plus_baseline whitens"):
        check_whole_batch([HALF, WHOLE], Shard(1, 2), what="--shards 2")
    check_whole_batch([HALF, WHOLE], UNSHARDED)
    check_whole_batch([HALF], Shard(1, 2))


def test_a_whole_batch_config_is_purified_whole_or_refused_when_stored_for_part_of_the_iteration(tmp_path, policy):
    whole = build(tmp_path / "whole", policy)
    rows = purify_job(whole, PurifyRequest(ITERATION, (WHOLE,)), backend=FakeBackend(policy), progress=False).results[0].rows
    assert as_stored(rows) == as_stored(expected([WHOLE], whole)[WHOLE.config_id].rows)
    assert purify_job(whole, PurifyRequest(ITERATION, (WHOLE,)), backend=FakeBackend(policy)).computed == []
    part = build(tmp_path / "part", policy)
    part.write_purified(ITERATION, make_purify_config(WHOLE.config_id), [row for row in rows if row.rollout_id != "r4"])
    with pytest.raises(JobError) as raised:
        purify_job(part, PurifyRequest(ITERATION, (HALF, WHOLE)), backend=FakeBackend(policy), progress=False)
    assert str(raised.value) == (
        f"{part.root}: iteration 3 has rows under purify config {WHOLE.config_id} for 3 of its 4 rollouts, and "
        "adv_estimator reinforce_plus_plus_baseline whitens over the whole iteration: rows added now would be "
        "whitened apart; purify the iteration into another warehouse, or use adv_estimator grpo or rloo")
    assert part.purified_rollout_ids(ITERATION, HALF.config_id) == frozenset()


def test_a_read_only_warehouse_and_a_run_directory_are_refused_before_a_lock_file_is_made(tmp_path, policy):
    build(tmp_path / "wh", policy)
    before = stored_files(tmp_path / "wh")
    with pytest.raises(WarehouseError, match="opened read-only; nothing may be written"):
        purify_job(Warehouse(tmp_path / "wh", read_only=True), PurifyRequest(ITERATION, (HALF,)),
                   backend=FakeBackend(policy))
    assert stored_files(tmp_path / "wh") == before
    run = tmp_path / "run"
    run.mkdir()
    (tmp_path / "wh").rename(run / "warehouse")
    with pytest.raises(WarehouseError, match="not a warehouse but a run directory"):
        purify_job(Warehouse(run), PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy))
    assert sorted(os.listdir(run)) == ["warehouse"]


def test_a_backend_that_cannot_run_is_refused_before_a_lock_file_is_made(tmp_path, policy):
    from cleaner.errors import CleanerError

    build(tmp_path / "wh", policy)
    before = stored_files(tmp_path / "wh")
    for request, words in ((PurifyRequest(ITERATION, (HALF,), backend_kind="tpu"), "backend must be one of"),
                           (PurifyRequest(ITERATION, (HALF,), sglang_url="http://127.0.0.1:9"), "needs --backend sglang"),
                           (PurifyRequest(ITERATION, (HALF,), device="cuda:7"), "device 'cuda:7'")):
        with pytest.raises(CleanerError, match=words):
            purify_job(Warehouse(tmp_path / "wh"), request)
        assert stored_files(tmp_path / "wh") == before


def test_a_second_purify_of_the_iteration_or_its_shard_is_refused_while_one_runs(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    first, _ = owner_of(["g1", "g2"], 4)
    with warehouse.writer("purify", ITERATION):
        with pytest.raises(LockHeld):
            purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    with warehouse.writer("purify", ITERATION, (first, 4)):
        with pytest.raises(LockHeld):
            purify_job(warehouse, PurifyRequest(ITERATION, (HALF,), Shard(first, 4)), backend=FakeBackend(policy),
                       progress=False)
    with warehouse.writer("collect", ITERATION):  # another phase's writer is the gate's business
        with pytest.raises(Refused, match="iteration 3 is being collected"):
            purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert warehouse.purified_rollout_ids(ITERATION, HALF.config_id) == frozenset()


def test_an_iteration_short_of_its_plan_is_refused(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy, plan=CollectPlan(("g1", "g2", "g3"), 2))
    with pytest.raises(Refused, match="iteration 3"):
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert warehouse.purified_rollout_ids(ITERATION, HALF.config_id) == frozenset()


def legacy(n_prompts=2, group_size=2, drop=0):
    """Rollouts of the toy prompts an older cleaner's collect config names (it recorded no plan),
    with the ids collect gives them; the last `drop` left out."""
    rollouts, segments = [], []
    template = {rollout.rollout_id: rollout for rollout in ROLLOUTS}
    for number, (task, sample) in enumerate(
            ((task, sample) for task in toy_tasks(n_prompts, seed=_seed(n_prompts)) for sample in range(group_size)), 1):
        rollout_id, group_id = rollout_key(ITERATION, task.prompt_id, sample)
        source = template[f"r{1 + (number - 1) % 4}"]
        rollouts.append(dataclasses.replace(source, rollout_id=rollout_id, group_id=group_id, prompt_id=task.prompt_id,
                                            sample_index=sample))
        segments += [dataclasses.replace(s, rollout_id=rollout_id) for s in SEGMENTS if s.rollout_id == source.rollout_id]
    kept = rollouts[:len(rollouts) - drop]
    ids = {rollout.rollout_id for rollout in kept}
    return kept, [s for s in segments if s.rollout_id in ids]


def _seed(n_prompts):
    from cleaner.engine.collect.job import iteration_seed

    return iteration_seed(CollectConfig(iteration=ITERATION, n_prompts=n_prompts, group_size=2))


def test_an_older_iterations_completeness_is_counted_from_its_collect_config(tmp_path, policy):
    rollouts, segments = legacy()
    complete = build(tmp_path / "complete", policy, rollouts, segments, plan=None)
    outcome = purify_job(complete, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert len(outcome.results[0].rows) == 4
    rollouts, segments = legacy(drop=1)
    short = build(tmp_path / "short", policy, rollouts, segments, plan=None)
    with pytest.raises(JobError) as raised:
        purify_job(short, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert str(raised.value) == (
        f"{short.root}: iteration 3 holds 3 of the 4 rollouts its collection planned: it was interrupted; finish it "
        "with `cleaner collect --iteration 3 --resume` (and its other options) before purifying, so the rows cover "
        "the whole iteration")
    first, short_prompt = (task.prompt_id for task in toy_tasks(2, seed=_seed(2)))  # the short one is the second
    shard = next(Shard(index, count) for count in range(2, 9) for index in range(count)
                 if Shard(index, count).owns(short_prompt) and not Shard(index, count).owns(first))
    with pytest.raises(JobError) as raised:  # a shard counts its own prompts' rollouts
        purify_job(short, PurifyRequest(ITERATION, (HALF,), shard), backend=FakeBackend(policy), progress=False)
    assert f"{short.root}: iteration 3 shard {shard} holds 1 of the 2 rollouts its collection planned" in str(raised.value)
    other = next(Shard(index, shard.count) for index in range(shard.count) if Shard(index, shard.count).owns(first))
    assert len(purify_job(short, PurifyRequest(ITERATION, (HALF,), other), backend=FakeBackend(policy),
                          progress=False).results[0].rows) == 2


def test_an_older_iteration_whose_prompts_cannot_be_read_is_refused(tmp_path, policy):
    rollouts, segments = legacy()
    warehouse = build(tmp_path / "wh", policy, rollouts, segments, plan=None, data=str(tmp_path / "moved.parquet"))
    with pytest.raises(JobError) as raised:
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    message = str(raised.value)
    assert message.startswith(f"{warehouse.root}: cannot tell whether iteration 3 is complete: the prompts its "
                              f"collection planned cannot be read ({tmp_path / 'moved.parquet'}")
    assert message.endswith("); purify where its collect config's paths are readable, so the rows cover the whole "
                            "iteration") and "\n" not in message


def test_an_iteration_without_a_collect_config_is_refused(tmp_path, policy):
    warehouse = Warehouse(tmp_path / "wh")
    warehouse.write_rollouts(ITERATION, ROLLOUTS, SEGMENTS)
    with pytest.raises(JobError) as raised:
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    assert str(raised.value) == f"{warehouse.root}: iteration 3 has no collect config; was it collected?"


def test_down_sampling_must_keep_fewer_than_a_group(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy, group_size=4)
    keep = dict(down_sample="roc", roc_min_negatives=1, roc_min_positives=1)
    check_down_sampling(warehouse, ITERATION, [HALF, PurifyConfig(down_sample_to=3, **keep)])
    with pytest.raises(JobError) as raised:
        check_down_sampling(warehouse, ITERATION, [PurifyConfig(down_sample_to=3, **keep),
                                                   PurifyConfig(down_sample_to=4, **keep),
                                                   PurifyConfig(down_sample_to=5, **keep)])
    assert str(raised.value) == ("invalid option: --down-sample-to 4 must be smaller than iteration 3's group size "
                                 "(4): nothing to choose; collect larger groups (--group-size 8, as GRPO-RoC "
                                 "collects 2N to keep N)")
    plain = Warehouse(tmp_path / "plain")  # no collect config: nothing to check against
    check_down_sampling(plain, ITERATION, [PurifyConfig(down_sample_to=5, **keep)])


@pytest.mark.parametrize("change, why", [
    (dict(token_ids=(301, 302, 5000)), "token id 5000"),
    (dict(logprobs=(-0.3, 0.5, -0.3)), "log-prob 0.5"),
])
def test_stored_segments_no_policy_produced_are_refused_naming_the_rollout(tmp_path, policy, change, why):
    segments = [dataclasses.replace(s, **change) if (s.rollout_id, s.seq) == ("r3", 1) else s for s in SEGMENTS]
    warehouse = build(tmp_path / "wh", policy, segments=segments)
    with pytest.raises(JobError) as raised:
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(policy), progress=False)
    message = str(raised.value)
    assert message.startswith(f"{warehouse.root}: iteration 3: 1 rollout(s) hold tokens or log-probs no policy "
                              f"produced: r3 (") and why in message
    assert message.endswith("; an older cleaner stored its engine's answers unchecked: collect the iteration again "
                            "(into another warehouse or --iteration) before purifying")
    assert warehouse.purified_rollout_ids(ITERATION, HALF.config_id) == frozenset()


def test_a_backend_serving_another_policy_is_refused(tmp_path, policy):
    other = tmp_path / "other"
    other.mkdir()
    warehouse = build(tmp_path / "wh", policy)
    with pytest.raises(JobError) as raised:
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF,)), backend=FakeBackend(other), progress=False)
    assert str(raised.value) == (f"iteration 3 was collected by {policy}, but the backend serves {other}; purify "
                                 "scores with the policy that collected")


def test_rows_a_scorer_made_non_finite_are_refused_and_nothing_is_stored(tmp_path, policy):
    warehouse = build(tmp_path / "wh", policy)
    with pytest.raises(JobError) as raised:
        purify_job(warehouse, PurifyRequest(ITERATION, (HALF, DEEP)), backend=FakeBackend(policy, nan=True),
                   progress=False)
    message = str(raised.value)
    assert message.startswith(f"{warehouse.root}: iteration 3: the scorer of {policy} gave 4 rollout(s) hold rows no "
                              "policy produced: ") and "old log-prob nan" in message
    assert message.endswith("; score with a checkpoint whose forward is finite")
    assert not list(warehouse.root.glob("purified/**/*.parquet")) and warehouse.purify_config_ids() == set()
