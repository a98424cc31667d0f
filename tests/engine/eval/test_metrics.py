"""pass@k, maj@n and the per-evaluation metrics against hand-computed values."""

from __future__ import annotations

import dataclasses

import pytest

from cleaner.engine.eval.metrics import eval_metrics, k_values, majority_correct, pass_at_k
from tests.factories import make_rollout, make_segments


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),  # pass@1 = c / n
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (16, 3, 4, 1 - 715 / 1820),  # 1 - C(13,4)/C(16,4)
    (4, 1, 4, 1.0),  # n = k: any correct sample is drawn
    (4, 0, 4, 0.0),  # n = k, c = 0
    (4, 0, 1, 0.0),  # c = 0
    (4, 4, 1, 1.0),  # c = n
    (16, 16, 16, 1.0),  # c = n = k
    (6, 4, 3, 1.0),  # n - c < k: every draw of 3 holds a correct one
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_k_values_are_powers_of_two_and_n():
    assert k_values(1) == (1,)
    assert k_values(4) == (1, 2, 4)
    assert k_values(16) == (1, 2, 4, 8, 16)
    assert k_values(10) == (1, 2, 4, 8, 10)


def _sample(prompt, index, answer, correct, calls=1, failed=0):
    return dataclasses.replace(
        make_rollout(f"{prompt}-s{index}"), prompt_id=prompt, sample_index=index, answer=answer, correct=correct,
        reward=float(correct), n_tool_calls=calls, n_failed_calls=failed)


def test_majority_vote_ties_go_to_the_first_sampled_answer():
    assert majority_correct([_sample("p", 0, "7", True), _sample("p", 1, "8", False), _sample("p", 2, "8", False)]) is False
    assert majority_correct([_sample("p", 1, "8", False), _sample("p", 0, "7", True)]) is True  # tie: sample 0 first
    assert majority_correct([_sample("p", 0, None, False), _sample("p", 1, None, False)]) is False


def test_eval_metrics_by_hand():
    # problem a: 2 of 4 right, majority "5" (right); problem b: 0 of 4, majority "1" (wrong).
    a = [_sample("a", 0, "5", True), _sample("a", 1, "5", True, calls=2, failed=1), _sample("a", 2, "6", False),
         _sample("a", 3, None, False)]
    b = [_sample("b", i, "1", False) for i in range(4)]
    segments = [s for r in a + b for s in make_segments(r.rollout_id)]
    metrics = eval_metrics(a + b, segments, 4)
    assert (metrics.problems, metrics.rollouts, metrics.n) == (2, 8, 4)
    assert metrics.avg_at_n == 2 / 8
    assert dict(metrics.pass_at_k) == pytest.approx({1: (0.5 + 0) / 2, 2: (1 - 1 / 6) / 2, 4: (1 + 0) / 2})
    assert metrics.maj_at_n == 0.5
    assert metrics.tool_calls_per_trajectory == 9 / 8 and metrics.failures_per_trajectory == 1 / 8
    # every rollout's segments (the factory's) fail their first call, and its retry fixes it
    assert metrics.first_call_error_rate == 1.0 and metrics.recovery_rate == 1.0


def test_eval_metrics_needs_n_samples_per_problem():
    with pytest.raises(ValueError, match="every problem needs 4 samples"):
        eval_metrics([_sample("a", 0, "5", True)], [], 4)
