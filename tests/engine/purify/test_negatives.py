"""Negative samples: the push against hand-computed values, the rows purify makes, and how the
trainer keeps them out of group statistics (purify/negatives.py, docs/architecture.md §7)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cleaner.config import DpoCap, PurifyConfig, TrainConfig
from cleaner.engine.purify.negatives import dpo_push, with_pushes
from cleaner.engine.purify.pipeline import purify_iteration
from cleaner.engine.train.step import prepare_rows
from tests.factories import ROLLOUTS, SEGMENTS, FakeScorer


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_push_against_hand_values():
    # fix mean -2, failed mean -5: delta 3; s = sigmoid(-0.1 * 3) = 0.425557
    push = dpo_push([-1.0, -2.0, -3.0], [-4.0, -6.0], beta=0.1, max_ratio=1.0, cap=DpoCap.ABSOLUTE,
                    advantage=0.0)
    s = sigmoid(-0.3)
    assert push.delta == pytest.approx(3.0)
    assert (push.fix, push.failed) == pytest.approx((0.1 * s / 3, 0.1 * s / 2))
    # absolute cap 0.015: the fix's 0.014186 stays, the failure's 0.021278 is capped
    capped = dpo_push([-1.0, -2.0, -3.0], [-4.0, -6.0], 0.1, 0.015, DpoCap.ABSOLUTE, 0.0)
    assert (capped.fix, capped.failed) == pytest.approx((0.1 * s / 3, 0.015))
    # relative cap: 0.1 x |advantage 0.12| = 0.012 caps both
    relative = dpo_push([-1.0, -2.0, -3.0], [-4.0, -6.0], 0.1, 0.1, DpoCap.RELATIVE, -0.12)
    assert (relative.fix, relative.failed) == pytest.approx((0.012, 0.012))
    # a fix already preferred by far: the sigmoid, and so the push, nearly vanishes
    far = dpo_push([-0.1], [-50.0], 1.0, 1.0, DpoCap.ABSOLUTE, 0.0)
    assert far.fix == pytest.approx(sigmoid(-49.9)) and far.fix < 1e-20
    assert with_pushes(0.5, 5, [(1, 3, 0.25), (2, 4, -1.0)]) == (0.5, 0.75, -0.25, -0.5, 0.5)
    # a side without call tokens (nothing scored): no push either way
    for fix, failed in (([], [-4.0]), ([-1.0], []), ([], [])):
        push = dpo_push(fix, failed, 0.1, 1.0, DpoCap.ABSOLUTE, 0.5)
        assert (push.delta, push.fix, push.failed) == (0.0, 0.0, 0.0)


NEGATIVES = PurifyConfig(gamma=0.5, rollback_prob=1.0, negative_samples=True)


def test_purify_adds_one_negative_row_per_fixed_failure():
    (result,) = purify_iteration(ROLLOUTS, SEGMENTS, [NEGATIVES], FakeScorer(), None, "v")
    negatives = [row for row in result.rows if row.is_negative]
    positives = [row for row in result.rows if not row.is_negative]
    assert [row.rollout_id for row in positives] == ["r1", "r2", "r3", "r4"]
    assert [(row.rollout_id, row.negative_seq) for row in negatives] == [("r1", 1), ("r2", 1), ("r3", 1), ("r4", 1)]
    assert result.stats.n_negatives == 4 and result.stats.n_rollouts == 4
    neg = negatives[0]  # r1 (b = 100): the prompt, then a_0 = 110 111 112 whose call is 112
    assert neg.token_ids == (101, 102, 110, 111, 112)
    assert neg.loss_mask == (0, 0, 0, 0, 1) and neg.advantage == 0.0
    assert neg.behavior_logprobs == pytest.approx((0, 0, 0, 0, -0.112))
    assert neg.old_logprobs == pytest.approx((0, 0, 0, 0, -1.12))  # the fake scorer: -0.01 x id
    r1_rollout = ROLLOUTS[0]
    assert (neg.config_id, neg.iteration, neg.group_id, neg.prompt_len, neg.reward, neg.scorer_version) == (
        NEGATIVES.config_id, r1_rollout.iteration, r1_rollout.group_id, 2, r1_rollout.reward, "v")
    # a row of its own: rolled back (SAAR took its call out), and no merge of its own to count
    assert (neg.rolled_back, neg.n_shallow, neg.n_deep, neg.n_unrecovered, neg.tokens_removed) == (True, 0, 0, 0, 0)
    # The push: fix call tokens 121 122 (old mean -1.215), failed call 112 (-1.12): delta -0.095
    s = sigmoid(0.1 * 0.095)
    fix_push, failed_push = 0.1 * s / 2, 0.1 * s / 1
    r1 = positives[0]
    assert r1.token_ids == (101, 102, 110, 111, 121, 122, 123, 130)
    assert r1.scorer_version == "v" and r1.old_logprobs == pytest.approx(
        [-0.01 * token if mask else 0.0 for token, mask in zip(r1.token_ids, r1.loss_mask, strict=True)])
    expected = [r1.advantage] * 8
    expected[4] += fix_push
    expected[5] += fix_push
    assert r1.token_advantages == pytest.approx(expected)
    assert neg.token_advantages == pytest.approx((0, 0, 0, 0, -failed_push))
    # Group g2 has equal rewards (advantage 0): the relative cap leaves its pairs without a push.
    assert negatives[2].token_advantages == pytest.approx((0,) * 5)
    assert positives[2].token_advantages == pytest.approx((0,) * 8)


def test_negative_rows_change_no_group_statistic():
    plain = PurifyConfig(gamma=0.5, rollback_prob=1.0)
    (without,) = purify_iteration(ROLLOUTS, SEGMENTS, [plain], FakeScorer(), None, "v")
    (with_negatives,) = purify_iteration(ROLLOUTS, SEGMENTS, [NEGATIVES], FakeScorer(), None, "v")
    positives = [row for row in with_negatives.rows if not row.is_negative]
    assert [row.advantage for row in positives] == [row.advantage for row in without.rows]
    assert [row.token_ids for row in positives] == [row.token_ids for row in without.rows]
    absolute = dataclasses.replace(NEGATIVES, dpo_cap=DpoCap.ABSOLUTE)
    (pushed,) = purify_iteration(ROLLOUTS, SEGMENTS, [absolute], FakeScorer(), None, "v")
    assert pushed.rows[-1].token_advantages[-1] < 0  # absolute cap: g2's pair is pushed too


def test_the_trainer_keeps_negatives_out_of_groups():
    (result,) = purify_iteration(ROLLOUTS, SEGMENTS, [NEGATIVES], FakeScorer(), None, "v")
    rows = result.rows
    kept = prepare_rows(rows, TrainConfig(dynamic_sampling=True))
    # g2's rewards are all 1: the group goes, with its negatives; g1 stays with its two negatives
    assert sorted((row.rollout_id, row.is_negative) for row in kept) == [
        ("r1", False), ("r1", True), ("r2", False), ("r2", True)]
    shaped = prepare_rows(rows, TrainConfig(overlong_buffer=2, max_response_tokens=7))
    by_key = {(row.rollout_id, row.is_negative): row for row in shaped}
    for row in rows:  # negatives are left exactly as purify made them
        if row.is_negative:
            assert by_key[row.rollout_id, True] == row
    r1, before = by_key["r1", False], rows[0]
    shift = r1.advantage - before.advantage
    assert r1.token_advantages == pytest.approx([value + shift for value in before.token_advantages])
