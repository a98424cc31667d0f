"""Purify pipeline on hand-built rollouts, with a fake scorer whose answer is checkable."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cleaner.config import PurifyConfig
from cleaner.engine.purify.pipeline import purify_iteration, render_iteration
from tests.factories import ROLLOUTS, SEGMENTS, FakeScorer

# ----------------------------------------------------------------------------------------------
# Four rollouts, each: prompt, a failed call, a similar successful retry, a final answer


def raw(b):
    return (b + 1, b + 2, b + 10, b + 11, b + 12, b + 13, b + 20, b + 21, b + 22, b + 23, b + 30)


def shallow(b):
    return (b + 1, b + 2, b + 10, b + 11, b + 21, b + 22, b + 23, b + 30)


def deep(b):
    return (b + 1, b + 2, b + 20, b + 21, b + 22, b + 23, b + 30)


HALF = PurifyConfig(gamma=0.5, rollback_prob=0.5)
POSITIVE = PurifyConfig(gamma=0.5, rollback_prob=1.0, purify_when="positive")
DEEP = PurifyConfig(gamma=1.5, rollback_prob=1.0)


# ----------------------------------------------------------------------------------------------
# render_iteration


def test_render_iteration_follows_the_draw():
    rows, stats = render_iteration(ROLLOUTS, list(reversed(SEGMENTS)), HALF, decode=None)
    assert [row.rollout_id for row in rows] == ["r1", "r2", "r3", "r4"]
    assert [row.rolled_back for row in rows] == [True, False, True, True]  # draw < 0.5
    assert [row.token_ids for row in rows] == [shallow(100), raw(200), shallow(300), shallow(400)]
    assert all(set(row.old_logprobs) == {0.0} and row.config_id == HALF.config_id for row in rows)
    assert rows[0].loss_mask == (0, 0, 1, 1, 1, 1, 0, 1)
    assert rows[0].behavior_logprobs == pytest.approx((0, 0, -0.11, -0.111, -0.121, -0.122, 0, -0.13))
    assert (stats.n_rollouts, stats.n_rolled_back, stats.n_shallow, stats.n_deep) == (4, 3, 3, 0)
    assert (stats.n_unrecovered, stats.tokens_removed) == (0, 9)
    assert stats.errors_by_type == (("NameError", 3), ("timeout", 1))


def test_errors_are_counted_by_type_most_first_ties_by_name():
    """A failed call's exception name, else its status; the commonest first, ties alphabetical."""
    from cleaner.engine.purify.pipeline import errors_by_type
    from tests.factories import selection_rollout

    _, segments = selection_rollout(0, 1.0, ("error", "error", "error", "timeout", "ok"))
    tools = [s for s in segments if s.kind == "tool"]
    names = ["ZeroDivisionError", "NameError", "ZeroDivisionError", None, None]
    segments = [*(dataclasses.replace(s, error_type=name) for s, name in zip(tools, names, strict=True)),
                *(dataclasses.replace(tools[0], seq=99, error_type="AssertionError"),)]
    assert errors_by_type(segments) == (("ZeroDivisionError", 2), ("AssertionError", 1), ("NameError", 1),
                                        ("timeout", 1))


def test_an_infrastructure_fault_is_a_failed_generation_or_a_call_that_still_met_one():
    from cleaner.engine.purify.pipeline import infra_fault
    from tests.factories import selection_rollout

    clean, clean_segments = selection_rollout(0, 1.0, ("error", "ok"))
    assert not infra_fault(clean, clean_segments)
    assert infra_fault(dataclasses.replace(clean, finish_reason="error"), clean_segments)
    faulted, faulted_segments = selection_rollout(1, 1.0, ("infra_error", "ok"))
    assert faulted.finish_reason == "answer" and infra_fault(faulted, faulted_segments)


def test_advantages_per_group():
    rows, _ = render_iteration(ROLLOUTS, SEGMENTS, HALF, decode=None)
    spread = 0.5 / (math.sqrt(0.5) + HALF.advantage_eps)  # g1: rewards 1, 0; sample std sqrt(1/2)
    assert [row.advantage for row in rows] == pytest.approx([spread, -spread, 0.0, 0.0])


def test_positive_purifies_only_rewards_above_group_mean():
    rows, stats = render_iteration(ROLLOUTS, SEGMENTS, POSITIVE, decode=None)
    # r1 beats its group; r2 is below; g2's rewards are all equal (advantage 0).
    assert [row.rolled_back for row in rows] == [True, False, False, False]
    assert [row.token_ids for row in rows] == [shallow(100), raw(200), raw(300), raw(400)]
    assert stats.n_rolled_back == 1


WHITENED = PurifyConfig(gamma=0.5, rollback_prob=0.5, adv_estimator="reinforce_plus_plus_baseline")


def test_a_whole_batch_estimator_whitens_over_each_configs_own_renderings():
    """reinforce_plus_plus_baseline whitens over the loss tokens of the rows the config rendered:
    the shallow merge leaves r1 5 loss tokens where the raw view has 7, so a config that purifies
    nothing (p = 0) whitens otherwise. g2's equal rewards take part as 0 and stay 0."""
    from cleaner.engine.purify.advantages import advantages

    nothing = dataclasses.replace(WHITENED, rollback_prob=0.0)
    for config in (WHITENED, nothing):
        rows, _ = render_iteration(ROLLOUTS, SEGMENTS, config, decode=None)
        tokens = [sum(row.loss_mask) for row in rows]
        assert [row.advantage for row in rows] == pytest.approx(advantages(
            config, [r.group_id for r in ROLLOUTS], [r.reward for r in ROLLOUTS], tokens), rel=1e-12)
        assert rows[2].advantage == rows[3].advantage == 0.0
    purified, raw_rows = (render_iteration(ROLLOUTS, SEGMENTS, c, decode=None)[0] for c in (WHITENED, nothing))
    assert sum(purified[0].loss_mask) == 5 and sum(raw_rows[0].loss_mask) == 7
    assert purified[0].advantage != pytest.approx(raw_rows[0].advantage)


def test_whitening_counts_every_loss_token_after_a_one_token_prompt_too():
    """The first token after the prompt is a loss token wherever the prompt ends, at position 1 too."""
    from cleaner.engine.purify.advantages import advantages
    from cleaner.records import SegmentKind

    short = [dataclasses.replace(s, token_ids=s.token_ids[:1]) if s.kind == SegmentKind.PROMPT else s
             for s in SEGMENTS]
    rows, _ = render_iteration(ROLLOUTS, short, WHITENED, decode=None)
    assert {row.prompt_len for row in rows} == {1} and all(row.loss_mask[1] == 1 for row in rows)
    tokens = [sum(row.loss_mask) for row in rows]
    assert [row.advantage for row in rows] == pytest.approx(advantages(
        WHITENED, [r.group_id for r in ROLLOUTS], [r.reward for r in ROLLOUTS], tokens), rel=1e-12)
    (scored,) = purify_iteration(ROLLOUTS, short, [WHITENED], FakeScorer(), None, "v")  # scored from position 1
    for row in scored.rows:
        assert row.old_logprobs == pytest.approx(
            [-0.01 * token if mask else 0.0 for token, mask in zip(row.token_ids, row.loss_mask, strict=True)])


def test_a_whole_batch_estimators_positive_rollouts_are_those_above_their_groups_mean():
    rows, _ = render_iteration(ROLLOUTS, SEGMENTS, dataclasses.replace(WHITENED, rollback_prob=1.0,
                                                                         purify_when="positive"), decode=None)
    assert [row.rolled_back for row in rows] == [True, False, False, False]


def test_negative_sample_pushes_go_on_the_whitened_advantage():
    config = dataclasses.replace(WHITENED, rollback_prob=1.0, negative_samples=True)
    (result,) = purify_iteration(ROLLOUTS, SEGMENTS, [config], FakeScorer(), None, "v")
    first = next(row for row in result.rows if row.rollout_id == "r1" and not row.is_negative)
    pushed = [value - first.advantage for value in first.token_advantages]
    assert max(pushed) > 0 and min(pushed) == 0.0  # the fix's call tokens, on top of the whitened advantage
    assert max(pushed) <= config.dpo_max_adjustment_ratio * abs(first.advantage) + 1e-12  # the relative cap


def test_rollout_without_segments_is_an_error():
    with pytest.raises(ValueError, match=r"^rollouts without segments: \['r4'\]$"):
        render_iteration(ROLLOUTS, SEGMENTS[:-6], HALF, decode=None)
    many = [dataclasses.replace(ROLLOUTS[0], rollout_id=f"m{i}") for i in range(7)]
    with pytest.raises(ValueError, match=r"^rollouts without segments: \['m0', 'm1', 'm2', 'm3', 'm4'\]$"):
        render_iteration([*ROLLOUTS, *many], SEGMENTS, HALF, decode=None)  # the first five named


def test_segments_of_rollouts_not_in_the_input_are_skipped_and_counted(caplog):
    strays = [dataclasses.replace(segment, rollout_id="stray") for segment in SEGMENTS[:3]]
    with caplog.at_level("WARNING", logger="cleaner.engine.purify.pipeline"):
        rows, _ = render_iteration(ROLLOUTS, [*strays, *SEGMENTS], HALF, decode=None)
    assert [row.rollout_id for row in rows] == ["r1", "r2", "r3", "r4"]
    assert [record.getMessage() for record in caplog.records] == [
        "skipping 3 segments whose rollout is not in the input"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="cleaner.engine.purify.pipeline"):
        render_iteration(ROLLOUTS, SEGMENTS, HALF, decode=None)
    assert caplog.records == []


@pytest.mark.parametrize("config", [PurifyConfig(negative_samples=True), PurifyConfig(rollback_is_threshold=0.5)])
def test_render_iteration_refuses_what_needs_old_log_probs(config):
    with pytest.raises(ValueError, match=r"^IS gating and negative samples need old log-probs: use purify_iteration$"):
        render_iteration(ROLLOUTS, SEGMENTS, config, decode=None)


def test_render_iteration_renders_what_purify_iteration_stores_but_the_scores():
    """Without a scorer, the same rows and stats (the premise's failed-call credit included), each
    row unscored: zeros for old log-probs and no scorer named. Calls compared by their decoded
    tokens need the decoding passed on."""
    config = dataclasses.replace(HALF, similarity_on="call")

    def decode(ids):
        return " ".join(map(str, ids))

    rows, stats = render_iteration(ROLLOUTS, SEGMENTS, config, decode)
    [stored] = purify_iteration(ROLLOUTS, SEGMENTS, [config], FakeScorer(), decode, "v7")
    assert stats == stored.stats and stats.premise is not None
    assert [dataclasses.replace(row, old_logprobs=scored.old_logprobs, scorer_version="v7")
            for row, scored in zip(rows, stored.rows, strict=True)] == stored.rows
    assert all(row.scorer_version == "" and set(row.old_logprobs) == {0.0} for row in rows)


# ----------------------------------------------------------------------------------------------
# purify_iteration


def test_an_is_gated_config_keeps_raw_each_chain_whose_merge_is_unlikely_under_the_old_policy():
    """IS = exp(sum over the retry's kept call tokens of old - behaviour log-prob): the fake scorer's
    -0.01 x id against the segments' -id / 1000, -0.009 x id a token. r<i>'s shallow merge keeps
    tokens 100i + 21 and 100i + 22: IS = exp(-0.009 (200i + 43)) = 0.112, 0.0186, 0.0031, 0.0005.
    tau 0.05 gates r2, r3 and r4 (raw rows), and r1 is purified."""
    config = PurifyConfig(gamma=0.5, rollback_prob=1.0, rollback_is_threshold=0.05)
    (result,) = purify_iteration(ROLLOUTS, SEGMENTS, [config], FakeScorer(), None, "v")
    assert [math.exp(-0.009 * (200 * i + 43)) < 0.05 for i in (1, 2, 3, 4)] == [False, True, True, True]
    assert [row.token_ids for row in result.rows] == [shallow(100), raw(200), raw(300), raw(400)]
    assert [row.n_gated for row in result.rows] == [0, 1, 1, 1] and result.stats.n_gated == 3
    for row in result.rows:  # each scored under the rendering it ended with
        assert row.old_logprobs == pytest.approx(
            [-0.01 * token if mask else 0.0 for token, mask in zip(row.token_ids, row.loss_mask, strict=True)])


def test_an_infrastructure_fault_is_counted_marked_and_left_out_of_the_premise():
    """r4's generation failed: its row says so, takes advantage 0, and neither it nor g2's statistics
    count it, so the premise is r1..r3's alone."""
    faulted = [*ROLLOUTS[:3], dataclasses.replace(ROLLOUTS[3], finish_reason="error")]
    rows, stats = render_iteration(faulted, SEGMENTS, HALF, decode=None)
    assert [row.infra_fault for row in rows] == [False, False, False, True] and stats.n_infra_fault == 1
    assert rows[3].advantage == 0.0
    _, without = render_iteration(ROLLOUTS[:3], SEGMENTS[:18], HALF, decode=None)
    assert stats.premise == without.premise
    assert rows[0].iteration == ROLLOUTS[0].iteration == 3


def test_one_scorer_call_for_all_configs_and_old_logprobs_scattered():
    scorer = FakeScorer()
    results = purify_iteration(ROLLOUTS, SEGMENTS, [HALF, POSITIVE, DEEP], scorer, None, "v7")
    assert len(scorer.calls) == 1
    sequences, starts = scorer.calls[0]
    expected = {shallow(100), raw(200), shallow(300), shallow(400), raw(300), raw(400),
                deep(100), deep(200), deep(300), deep(400)}
    assert len(sequences) == 10 and set(sequences) == expected  # each distinct row sent once
    assert set(starts) == {2}  # scoring starts after the prompt
    assert [result.config for result in results] == [HALF, POSITIVE, DEEP]
    for result in results:
        assert len(result.rows) == 4
        assert result.stats.config_id == result.config.config_id
        for row in result.rows:
            assert row.scorer_version == "v7"
            assert row.old_logprobs == pytest.approx(
                [-0.01 * token if mask else 0.0 for token, mask in zip(row.token_ids, row.loss_mask, strict=True)])
    deep_r1 = results[2].rows[0]
    assert deep_r1.token_ids == deep(100)
    assert deep_r1.old_logprobs == pytest.approx((0, 0, -1.20, -1.21, -1.22, 0, -1.30))
    assert (results[2].stats.n_deep, results[2].stats.tokens_removed) == (4, 16)


def test_scorer_with_wrong_lengths_is_rejected():
    class ShortScorer(FakeScorer):
        def score_rows(self, sequences, starts):
            return [scores[:-1] for scores in super().score_rows(sequences, starts)]

    with pytest.raises(ValueError, match="logprobs"):
        purify_iteration(ROLLOUTS, SEGMENTS, [HALF], ShortScorer(), None, "v")


# ----------------------------------------------------------------------------------------------
# Edit mask (docs/architecture.md §4)

MASK = PurifyConfig(gamma=0.5, rollback_prob=1.0, edit="mask")
REPLACE = PurifyConfig(gamma=0.5, rollback_prob=1.0)
BASELINE = PurifyConfig(rollback_prob=0.0)  # the raw view
MASK_POSITIVE = PurifyConfig(gamma=0.5, rollback_prob=1.0, purify_when="positive", edit="mask")


def raw_mask(b):
    return tuple(int(t in (b + 10, b + 11, b + 12, b + 20, b + 21, b + 22, b + 30)) for t in raw(b))


def masked_call(b):
    """The shallow merge drops a_0's call (b+12) and a_1's reasoning (b+20); a_1 succeeded, so
    only the call is masked."""
    return tuple(0 if t == b + 12 else m for t, m in zip(raw(b), raw_mask(b), strict=True))


def test_mask_rows_are_the_raw_rows_with_the_failed_call_untrained():
    scorer = FakeScorer()
    replace, mask, baseline = purify_iteration(ROLLOUTS, SEGMENTS, [REPLACE, MASK, BASELINE], scorer, None, "v")
    assert len(scorer.calls) == 1  # one scorer pass; a masked row's tokens are the raw row's
    sequences, _ = scorer.calls[0]
    assert sorted(sequences) == sorted({shallow(b) for b in (100, 200, 300, 400)} | {raw(b) for b in (100, 200, 300, 400)})
    for b, row, base in zip((100, 200, 300, 400), mask.rows, baseline.rows, strict=True):
        assert row.token_ids == raw(b) == base.token_ids and base.loss_mask == raw_mask(b)
        assert row.loss_mask == masked_call(b) and row.rolled_back
        assert row.advantage == base.advantage and row.reward == base.reward
        assert row.old_logprobs == tuple(o if m else 0.0 for o, m in zip(base.old_logprobs, row.loss_mask, strict=True))
        assert (row.n_shallow, row.n_deep, row.tokens_removed) == (1, 0, 0)
    assert [r.advantage for r in replace.rows] == [r.advantage for r in baseline.rows]
    assert (mask.stats.n_shallow, mask.stats.tokens_removed, mask.stats.tokens_masked) == (4, 0, 4)
    assert replace.stats.tokens_masked == 0


def test_an_ablation_of_replace_and_mask_scores_what_replace_and_the_raw_view_score():
    with_mask, with_raw = FakeScorer(), FakeScorer()
    purify_iteration(ROLLOUTS, SEGMENTS, [REPLACE, MASK], with_mask, None, "v")
    purify_iteration(ROLLOUTS, SEGMENTS, [REPLACE, BASELINE], with_raw, None, "v")
    assert len(with_mask.calls) == len(with_raw.calls) == 1
    assert sorted(with_mask.calls[0][0]) == sorted(with_raw.calls[0][0])


def test_mask_positive_masks_only_above_mean_rollouts():
    (mask,) = purify_iteration(ROLLOUTS, SEGMENTS, [MASK_POSITIVE], FakeScorer(), None, "v")
    # r1 beats its group (advantage > 0); r2 is below its mean; g2's rewards are all equal
    assert [row.advantage > 0 for row in mask.rows] == [True, False, False, False]
    assert [row.rolled_back for row in mask.rows] == [True, False, False, False]
    assert mask.rows[0].loss_mask == masked_call(100)
    assert [row.loss_mask for row in mask.rows[1:]] == [raw_mask(b) for b in (200, 300, 400)]  # nothing masked
    assert all(row.token_ids == raw(b) for b, row in zip((100, 200, 300, 400), mask.rows, strict=True))
    assert mask.stats.tokens_masked == 1


def test_masking_rollouts_collected_purified_is_warned_about(caplog):
    purify_iteration(ROLLOUTS, SEGMENTS, [REPLACE], FakeScorer(), None, "v")
    assert "edit mask" not in caplog.text
    purify_iteration(ROLLOUTS, SEGMENTS, [MASK], FakeScorer(), None, "v")
    assert [record.getMessage() for record in caplog.records] == [
        "edit mask on rollouts collected with the purified view (4 of 4): their turns after a failed call were "
        "sampled in SAAR's context, so the raw rows mask trains are off-policy there; collect with --collect-view "
        "raw (cleaner run --edit mask does)"]


def test_mask_and_negative_samples_are_refused():
    with pytest.raises(ValueError, match="does not combine with negative_samples"):
        PurifyConfig(edit="mask", negative_samples=True)
    with pytest.raises(ValueError, match="edit must be one of"):
        PurifyConfig(edit="splice")


@pytest.mark.parametrize("config", [
    HALF, POSITIVE, DEEP, PurifyConfig(gamma=0.5, rollback_is_threshold=0.05),
    PurifyConfig(gamma=0.5, negative_samples=True), PurifyConfig(gamma=0.5, edit="mask"),
    PurifyConfig(gamma=0.5, down_sample="uniform", down_sample_to=1), PurifyConfig(gamma=0.5, void_turn_filter=True),
], ids=["half", "positive", "deep", "gated", "negatives", "mask", "uniform", "void"])
def test_a_configs_stats_from_its_stored_rows_are_the_stats_purify_computed(config):
    """What `cleaner purify` reports for a config purified in an earlier run (stats_from_rows,
    masked_tokens, iteration_premise over its stored rows) is what purifying it computed, every
    field: here on the four rollouts with r4's generation failed (an infrastructure fault)."""
    from cleaner.engine.purify.pipeline import iteration_premise, masked_tokens, stats_from_rows

    faulted = [*ROLLOUTS[:3], dataclasses.replace(ROLLOUTS[3], finish_reason="error")]
    (result,) = purify_iteration(faulted, SEGMENTS, [config], FakeScorer(), None, "v")
    masked = masked_tokens(result.rows, SEGMENTS) if config.edit == "mask" else 0
    again = stats_from_rows(config.config_id, result.rows, result.stats.errors_by_type,
                            iteration_premise(faulted, SEGMENTS, result.rows), masked)
    assert again == result.stats
    plain = stats_from_rows(config.config_id, result.rows)  # a config's stats without the iteration's
    assert (plain.errors_by_type, plain.premise, plain.tokens_masked) == ((), None, 0)
    # a rollout without a row of the config (another shard's) counts in the premise at advantage 0
    zero = [dataclasses.replace(row, advantage=0.0) for row in result.rows[1:3] if not row.is_negative]
    some = [row for row in result.rows if row.rollout_id not in {z.rollout_id for z in zero}]
    assert iteration_premise(faulted, SEGMENTS, some) == iteration_premise(faulted, SEGMENTS, some + zero)
    assert (result.stats.n_infra_fault, result.stats.n_negatives > 0, result.stats.tokens_masked > 0) == (
        1, config.negative_samples, config.edit == "mask")
