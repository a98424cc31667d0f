"""The premise diagnostic: classes of rollouts and their statistics (cleaner/engine/saar/premise.py)."""

from __future__ import annotations

import math

import pytest

from cleaner.config import PurifyConfig
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.engine.saar.premise import ClassStats, RolloutClass, classify, premise_stats
from cleaner.records import ToolStatus
from tests.factories import (
    ROLLOUTS,
    SEGMENTS,
    answered_chain,
    assistant,
    exhausted_chain,
    iteration_rollout,
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
    rollouts = [iteration_rollout(i, "g", reward, 0.5) for i, reward in enumerate([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])]
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


# ----------------------------------------------------------------------------------------------
# The credit of failed calls


def seg(rollout_id, seq, kind, step, attempt, ids, call_start=None, status=None):
    from cleaner.records import Segment

    return Segment(rollout_id, 3, seq, kind, step, attempt, tuple(ids),
                   tuple(-0.1 for _ in ids) if kind == "assistant" else None, "", call_start, None, status)


def credit_group():
    """One group of five: r0 clean and right; r1 fails once (a 2 + 2 token attempt), recovers, right;
    r2 fails twice (3 + 2 tokens), never recovers, wrong; r3 answers without a call, wrong; r4 meets
    an infrastructure fault after a failed call of its own (out of every statistic)."""
    ok, error, infra = ToolStatus.OK, ToolStatus.ERROR, ToolStatus.INFRA_ERROR
    segments = [
        seg("r0", 0, "prompt", None, None, (1,)), seg("r0", 1, "assistant", 0, 0, (10, 11, 12), 1),
        seg("r0", 2, "tool", 0, 0, (13,), status=ok), seg("r0", 3, "assistant", 1, 0, (14,)),
        seg("r1", 0, "prompt", None, None, (1,)), seg("r1", 1, "assistant", 0, 0, (20, 21, 22, 23), 2),
        seg("r1", 2, "tool", 0, 0, (24,), status=error), seg("r1", 3, "assistant", 0, 1, (25, 26), 1),
        seg("r1", 4, "tool", 0, 1, (27,), status=ok), seg("r1", 5, "assistant", 1, 0, (28,)),
        seg("r2", 0, "prompt", None, None, (1,)), seg("r2", 1, "assistant", 0, 0, (30, 31, 32), 1),
        seg("r2", 2, "tool", 0, 0, (33,), status=error), seg("r2", 3, "assistant", 0, 1, (34, 35), 0),
        seg("r2", 4, "tool", 0, 1, (36,), status=error), seg("r2", 5, "assistant", 1, 0, (37, 38)),
        seg("r3", 0, "prompt", None, None, (1,)), seg("r3", 1, "assistant", 0, 0, (40, 41)),
        seg("r4", 0, "prompt", None, None, (1,)), seg("r4", 1, "assistant", 0, 0, (50, 51), 1),
        seg("r4", 2, "tool", 0, 0, (52,), status=error), seg("r4", 3, "assistant", 0, 1, (53, 54), 1),
        seg("r4", 4, "tool", 0, 1, (55,), status=infra), seg("r4", 5, "assistant", 1, 0, (56,)),
    ]
    rollouts = [iteration_rollout(i, "g", reward, 0.5) for i, reward in enumerate([1.0, 1.0, 0.0, 0.0, 0.0])]
    return rollouts, segments


def test_failed_call_tokens_are_every_token_of_each_failed_attempt():
    from cleaner.engine.saar.premise import failed_call_tokens

    _, segments = credit_group()
    counts = [failed_call_tokens([s for s in segments if s.rollout_id == f"r{i}"]) for i in range(5)]
    assert counts == [0, 4, 5, 0, 4]  # r4: its error (2) and its infra_error (2) are both failed calls


def test_the_credit_of_failed_calls_against_hand_values():
    rollouts, segments = credit_group()
    _, stats = render_iteration(rollouts, segments, PurifyConfig(rollback_prob=0.0), decode=None)
    # r4 is out of the group: rewards 1, 1, 0, 0, mean 0.5, sample std sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + PurifyConfig().advantage_eps)  # 0.8660
    credit = stats.premise.credit
    assert credit.tokens == 9  # r1's 4 at +a, r2's 5 at -a; r4's are an infra fault's
    assert credit.mean_advantage == pytest.approx((4 * a - 5 * a) / 9, rel=1e-6)  # -0.0962
    assert credit.positive_share == pytest.approx(4 / 9)
    assert stats.premise.recovered.mean_advantage == pytest.approx(a, rel=1e-6)
    none = premise_stats(rollouts[:1], [RolloutClass.CLEAN], [0.0], [0])
    assert (none.credit.tokens, none.credit.mean_advantage, none.credit.positive_share) == (0, None, None)


# ----------------------------------------------------------------------------------------------
# The saar batch's survivors (docs/mutants.md)


def test_a_rollout_read_backwards_takes_each_steps_last_attempt():
    # three_attempts_chain backwards: attempt 2 (ok) is met first; attempts 1 and 0 (errors) are
    # earlier attempts and do not replace it
    assert classify(list(reversed(three_attempts_chain()))) == RolloutClass.RECOVERED


def test_class_means_are_means_of_the_float32_advantages():
    rollouts = [iteration_rollout(i, "g", 1.0, 0.5) for i in range(3)]
    stats = premise_stats(rollouts, [RolloutClass.RECOVERED, RolloutClass.RECOVERED, RolloutClass.CLEAN],
                          [0.5, 0.25, 0.1])
    assert stats.recovered == ClassStats(2, 1.0, 0.375)
    assert stats.clean.mean_advantage == 0.10000000149011612  # float32(0.1), not 0.1


def test_a_failed_call_in_a_rollout_of_advantage_zero_is_not_positive_credit():
    rollouts = [iteration_rollout(i, "g", 1.0, 0.5) for i in range(2)]
    credit = premise_stats(rollouts, [RolloutClass.RECOVERED] * 2, [0.0, 1.0], [3, 1]).credit
    assert (credit.tokens, credit.mean_advantage, credit.positive_share) == (4, 0.25, 0.25)


def test_per_rollout_inputs_of_different_lengths_are_refused():
    rollouts = [iteration_rollout(i, "g", 1.0, 0.5) for i in range(2)]
    with pytest.raises(ValueError, match=r"zip\(\) argument"):
        premise_stats(rollouts, [RolloutClass.CLEAN], [0.0, 0.0])
    with pytest.raises(ValueError, match=r"zip\(\) argument"):
        premise_stats(rollouts, [RolloutClass.CLEAN] * 2, [0.0, 0.0], [1])
