"""The premise diagnostic: classes of rollouts and their statistics (cleaner/engine/premise.py)."""

from __future__ import annotations

import math

import pytest

from cleaner.engine.config import PurifyConfig
from cleaner.engine.premise import ClassStats, RolloutClass, classify, premise_stats
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.engine.records import ToolStatus
from tests.engine.purify.test_pipeline import ROLLOUTS, SEGMENTS, rollout
from tests.engine.test_render import (
    answered_chain,
    assistant,
    exhausted_chain,
    prompt,
    three_attempts_chain,
    tool,
)


def test_classes_of_hand_built_rollouts():
    clean = [prompt(0, (1,)), assistant(1, 0, 0, (10,), (11,), code="print(1)"), tool(2, 0, 0, (12,)),
             assistant(3, 1, 0, (20,))]
    assert classify(clean) == RolloutClass.CLEAN
    assert classify(three_attempts_chain()) == RolloutClass.RECOVERED  # fails twice, then succeeds
    assert classify(exhausted_chain()) == RolloutClass.UNRECOVERED  # step 0 never recovered
    assert classify(answered_chain()) == RolloutClass.UNRECOVERED  # a retry answered instead
    late_failure = clean[:3] + [assistant(3, 1, 0, (20,), (21,), code="x"), tool(4, 1, 0, (22,), ToolStatus.ERROR),
                                assistant(5, 1, 1, (30,), (31,), code="y"), tool(6, 1, 1, (32,))]
    assert classify(late_failure) == RolloutClass.RECOVERED
    assert classify(list(reversed(late_failure))) == RolloutClass.RECOVERED  # order does not matter


def test_statistics_per_class_against_hand_values():
    rollouts = [rollout(i, "g", reward, 0.5) for i, reward in enumerate([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])]
    classes = [RolloutClass.CLEAN, RolloutClass.CLEAN, RolloutClass.CLEAN, RolloutClass.RECOVERED, None,
               RolloutClass.UNRECOVERED]
    advantages = [0.5, 0.5, -1.0, 0.5, 0.0, -1.0]
    stats = premise_stats(rollouts, classes, advantages)
    assert stats.clean == ClassStats(3, pytest.approx(2 / 3), pytest.approx(0.0))
    assert stats.recovered == ClassStats(1, 1.0, 0.5)
    assert stats.unrecovered == ClassStats(1, 0.0, -1.0)  # the None (an infra fault) is in no class
    assert stats.recovered_over_clean == pytest.approx(1.5)
    empty = premise_stats(rollouts[:1], [RolloutClass.CLEAN], [0.0])
    assert empty.recovered == ClassStats(0, None, None)
    assert math.isnan(empty.recovered_over_clean)


def test_purify_stats_carry_the_premise():
    _, stats = render_iteration(ROLLOUTS, SEGMENTS, PurifyConfig(), decode=None)
    # every rollout of test_pipeline fails once and recovers: all recovered, accuracy 3 / 4
    assert stats.premise.clean.rollouts == 0 and stats.premise.recovered.rollouts == 4
    assert stats.premise.recovered.accuracy == pytest.approx(0.75)
    assert stats.premise.recovered.mean_advantage == pytest.approx(0.0, abs=1e-9)  # +A, -A, 0, 0
