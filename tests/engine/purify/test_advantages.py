"""The advantage estimators (purify/advantages.py) against hand-computed values and verl's
(tests/verl_core_algos.py), and cleaner's departures under each: a lone sample or equal rewards get
0, an infrastructure fault no say."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cleaner.config import PurifyConfig
from cleaner.engine.purify.advantages import (
    GroupStage,
    advantages,
    group_advantages,
    group_stage,
    grpo_advantages,
)
from tests import verl_core_algos as verl
from tests.factories import objective_rows


def test_two_groups_against_hand_values():
    # Group a: rewards 1, 0, 0, 1 -> mean 0.5, sample std sqrt(1/3) = 0.57735.
    # Group b: rewards 3, 1 -> mean 2, sample std sqrt(2) = 1.41421.
    group_ids = ["a", "b", "a", "a", "b", "a"]
    rewards = [1.0, 3.0, 0.0, 0.0, 1.0, 1.0]
    eps = 0.01
    std_a, std_b = math.sqrt(1 / 3), math.sqrt(2)
    expected = [0.5 / (std_a + eps), 1 / (std_b + eps), -0.5 / (std_a + eps),
                -0.5 / (std_a + eps), -1 / (std_b + eps), 0.5 / (std_a + eps)]
    assert grpo_advantages(group_ids, rewards, eps) == pytest.approx(expected, rel=1e-12)


def test_lone_sample_and_equal_rewards_get_zero():
    group_ids = ["solo", "same", "same", "same"]
    rewards = [1.0, 0.1, 0.1, 0.1]  # mean of three 0.1s is not exactly 0.1 in floats
    assert grpo_advantages(group_ids, rewards, 1e-6) == [0.0, 0.0, 0.0, 0.0]


def test_bad_input_is_rejected():
    assert grpo_advantages([], [], 1e-6) == []
    with pytest.raises(ValueError, match="group ids"):
        grpo_advantages(["a"], [1.0, 2.0], 1e-6)
    with pytest.raises(ValueError, match="advantage_eps must be > 0, got 0.0"):
        grpo_advantages(["a"], [1.0], 0.0)
    assert group_stage(PurifyConfig(adv_estimator="reinforce_plus_plus_baseline"), [], []) == GroupStage([], [])
    assert advantages(PurifyConfig(adv_estimator="reinforce_plus_plus_baseline"), [], [], []) == []


def test_rows_not_counted_get_zero_and_leave_their_group_statistics_alone():
    # Group a without the infra row (reward 0, "x"): rewards 1, 0, 1 -> mean 2/3, sample std
    # sqrt(1/3). The infra row would have dragged the mean to 1/2 had it been counted.
    group_ids = ["a", "a", "a", "a", "b", "b"]
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    counted = [True, True, True, False, True, False]
    eps = 1e-6
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / (std + eps), (-2 / 3) / (std + eps), (1 / 3) / (std + eps), 0.0,
                0.0, 0.0]  # group b has one counted row left: no signal
    assert grpo_advantages(group_ids, rewards, eps, counted) == pytest.approx(expected, rel=1e-12)
    without = grpo_advantages(group_ids[:3], rewards[:3], eps)
    assert grpo_advantages(group_ids, rewards, eps, counted)[:3] == pytest.approx(without, rel=1e-12)
    with pytest.raises(ValueError, match="counted"):
        grpo_advantages(["a"], [1.0], eps, [True, False])


# ---------------------------------------------------------------------------
# Every estimator (advantages.py): by hand, against verl's, and cleaner's departures

ESTIMATORS = {"grpo": {}, "grpo-no-std": {"norm_adv_by_std": False}, "rloo": {"adv_estimator": "rloo"},
              "reinforce_plus_plus_baseline": {"adv_estimator": "reinforce_plus_plus_baseline"}}


def test_rloo_and_dr_grpo_by_hand():
    group_ids, rewards = ["a", "a", "a", "b", "b"], [1.0, 0.0, 0.0, 3.0, 1.0]
    # rloo: r minus the mean of the group's others; Dr.GRPO: r minus the group's mean
    assert group_advantages(PurifyConfig(adv_estimator="rloo"), group_ids, rewards) == pytest.approx(
        [1.0, -0.5, -0.5, 2.0, -2.0], rel=1e-12)
    assert group_advantages(PurifyConfig(norm_adv_by_std=False), group_ids, rewards) == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, 1.0, -1.0], rel=1e-12)


def test_reinforce_plus_plus_baseline_whitens_over_the_loss_tokens_by_hand():
    """Centred scores 2/3, -1/3, -1/3 (group a) and 1, -1 (group b) on 2, 1, 3, 1, 1 loss tokens:
    their token-weighted mean is 0 and their Bessel-corrected variance (8/9 + 1/9 + 3/9 + 1 + 1) / 7
    = 10/21, so each advantage is its score / sqrt(10/21)."""
    config = PurifyConfig(adv_estimator="reinforce_plus_plus_baseline")
    values = advantages(config, ["a", "a", "a", "b", "b"], [1.0, 0.0, 0.0, 3.0, 1.0], [2, 1, 3, 1, 1])
    scale = math.sqrt((10 / 3) / (8 + 1e-8) * 8 / 7 + 1e-8)  # verl's 1e-8 in the mean's denominator
    assert values == pytest.approx([2 / 3 / scale, -1 / 3 / scale, -1 / 3 / scale, 1 / scale, -1 / scale],
                                   rel=1e-12)
    # a mean away from 0, with verl's 1e-8 in its denominator: (1.5 - 0.5) / (4 + 1e-8) on 3 and 1 tokens
    skewed = advantages(config, ["a", "a"], [1.0, 0.0], [3, 1])
    mean = (3 * 0.5 - 0.5) / (4 + 1e-8)
    variance = (3 * (0.5 - mean) ** 2 + (-0.5 - mean) ** 2) / (4 + 1e-8) * 4 / 3
    assert skewed == pytest.approx([(0.5 - mean) / math.sqrt(variance + 1e-8),
                                    (-0.5 - mean) / math.sqrt(variance + 1e-8)], rel=1e-12)
    # the loss tokens weigh the statistics: more tokens on a row moves the mean towards its score
    heavier = advantages(config, ["a", "a", "a", "b", "b"], [1.0, 0.0, 0.0, 3.0, 1.0], [20, 1, 3, 1, 1])
    assert sum(n * v for n, v in zip([20, 1, 3, 1, 1], heavier, strict=True)) == pytest.approx(0.0, abs=1e-6)
    assert heavier[0] < values[0]


ORACLES = [None]
if verl.verl_core_algos() is not None:  # tools/verl-reference/setup.sh's environment
    ORACLES.append(verl.verl_core_algos())


def _verl_advantages(name: str, settings: dict, rows, module=None) -> list[torch.Tensor]:
    """verl's estimator on the rows as its padded batch (the transcription's, or `module`'s, verl's
    own): each row's advantages at its loss tokens."""
    mask = torch.zeros(len(rows), max(len(r.token_ids) - r.prompt_len for r in rows), dtype=torch.float64)
    for index, row in enumerate(rows):
        response = row.loss_mask[row.prompt_len:]
        mask[index, : len(response)] = torch.tensor(response, dtype=torch.float64)
    function = verl.estimator_of(module, settings.get("adv_estimator", "grpo"))
    extra = {"norm_adv_by_std_in_grpo": settings["norm_adv_by_std"]} if "norm_adv_by_std" in settings else {}
    scores, _ = function(verl.outcome_rewards([r.reward for r in rows], mask), mask,
                         verl.index_array(r.group_id for r in rows), 1e-6, **extra)
    return [scores[index][mask[index] > 0] for index in range(len(rows))]


@pytest.mark.parametrize("module", ORACLES, ids=["transcribed", "verl"][: len(ORACLES)])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_equals_verls_on_warehouse_rows(name, module):
    """Groups of four with different rewards (so no departure applies), multi-token prompts, tool
    spans, a rejected row and a one-token row: each row's advantage is verl's on each of its loss
    tokens (the rejected row has none: whatever it holds trains nothing, as verl's is masked)."""
    config = PurifyConfig(**ESTIMATORS[name])
    for seed in range(3):
        rows = objective_rows(seed)
        ours = advantages(config, [r.group_id for r in rows], [r.reward for r in rows],
                          [sum(r.loss_mask[1:]) for r in rows])
        for row, value, theirs in zip(rows, ours, _verl_advantages(name, ESTIMATORS[name], rows, module), strict=True):
            assert theirs.tolist() == pytest.approx([value] * len(theirs), rel=1e-9, abs=1e-12), (seed, row.rollout_id)
        assert len(_verl_advantages(name, ESTIMATORS[name], rows)[3]) == 0  # the rejected row


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_lone_sample_and_equal_rewards_get_zero_under_every_estimator(name):
    config = PurifyConfig(**ESTIMATORS[name])
    group_ids = ["solo", "same", "same", "same", "a", "a"]
    values = advantages(config, group_ids, [1.0, 0.1, 0.1, 0.1, 1.0, 0.0], [3, 2, 2, 2, 4, 4])
    assert values[:4] == [0.0, 0.0, 0.0, 0.0]
    assert values[4] > 0 > values[5]


@pytest.mark.parametrize("module", ORACLES, ids=["transcribed", "verl"][: len(ORACLES)])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_an_infrastructure_fault_is_left_out_of_the_statistics_under_every_estimator(name, module):
    """The fault's row gets 0, and the others get what verl gives the batch without it (for the
    whitening too)."""
    config = PurifyConfig(**ESTIMATORS[name])
    rows = objective_rows(1)
    counted = [index != 6 for index in range(len(rows))]
    ours = advantages(config, [r.group_id for r in rows], [r.reward for r in rows],
                      [sum(r.loss_mask[1:]) for r in rows], counted)
    assert ours[6] == 0.0
    kept = [row for row, count in zip(rows, counted, strict=True) if count]
    theirs = _verl_advantages(name, ESTIMATORS[name], kept, module)
    for value, verl_values in zip([v for v, c in zip(ours, counted, strict=True) if c], theirs, strict=True):
        assert verl_values.tolist() == pytest.approx([value] * len(verl_values), rel=1e-9, abs=1e-12)


def test_whitening_a_group_without_signal_counts_it_as_zero_and_keeps_it_zero():
    """An equal-reward group (centred 0, as in verl) is in the statistics with its loss tokens, and
    stays 0 after (verl gives it -mean / std); fewer than two loss tokens in all: no variance, 0."""
    config = PurifyConfig(adv_estimator="reinforce_plus_plus_baseline")
    with_zero_group = advantages(config, ["a", "a", "z", "z"], [1.0, 0.0, 2.0, 2.0], [1, 3, 4, 4])
    n, v = [1, 3, 4, 4], [0.5, -0.5, 0.0, 0.0]
    mean = sum(a * b for a, b in zip(n, v, strict=True)) / (12 + 1e-8)
    variance = sum(a * (b - mean) ** 2 for a, b in zip(n, v, strict=True)) / (12 + 1e-8) * 12 / 11
    assert with_zero_group == pytest.approx([(0.5 - mean) / math.sqrt(variance + 1e-8),
                                             (-0.5 - mean) / math.sqrt(variance + 1e-8), 0.0, 0.0], rel=1e-9)
    assert advantages(config, ["a", "a"], [1.0, 0.0], [1, 0]) == [0.0, 0.0]
    assert advantages(config, ["a", "a", "a"], [0.0, 1.0, 0.5], [0, 0, 1]) == [0.0, 0.0, 0.0]  # its score is 0
    two = advantages(config, ["a", "a"], [1.0, 0.0], [1, 1])  # two tokens have a variance, verl's 1e-8s in it
    variance = 0.5 / (2 + 1e-8) * 2
    assert two == pytest.approx([0.5 / math.sqrt(variance + 1e-8), -0.5 / math.sqrt(variance + 1e-8)], rel=1e-12)


@pytest.mark.parametrize("module", ORACLES, ids=["transcribed", "verl"][: len(ORACLES)])
def test_whitening_with_an_equal_reward_group_gives_every_other_row_verls_value(module):
    """The departure is the equal group's own 0 (verl gives it -mean / std): its zeros are in the
    statistics as in verl's, so every row with a signal gets exactly verl's advantage."""
    config = PurifyConfig(adv_estimator="reinforce_plus_plus_baseline")
    rows = [dataclasses.replace(row, reward=1.0) if row.group_id == "g1" else row for row in objective_rows(2)]
    ours = advantages(config, [r.group_id for r in rows], [r.reward for r in rows], [sum(r.loss_mask[1:]) for r in rows])
    theirs = _verl_advantages("reinforce_plus_plus_baseline", ESTIMATORS["reinforce_plus_plus_baseline"], rows, module)
    for row, value, verl_values in zip(rows, ours, theirs, strict=True):
        if row.group_id == "g1":
            assert value == 0.0 and all(v != 0.0 for v in verl_values.tolist())
        else:
            assert verl_values.tolist() == pytest.approx([value] * len(verl_values), rel=1e-9, abs=1e-12)
