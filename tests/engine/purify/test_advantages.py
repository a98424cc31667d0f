"""GRPO advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest

from cleaner.engine.purify.advantages import grpo_advantages


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
    with pytest.raises(ValueError, match="eps"):
        grpo_advantages(["a"], [1.0], 0.0)


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
