"""The paper's evaluation metrics over n samples per problem (docs/architecture.md §12).

Definitions:
- avg@n: the mean reward over every sample (rewards are 0/1, so it is also pass@1).
- pass@k: the unbiased estimator of Chen et al. 2021, 1 - C(n-c, k) / C(n, k) for a problem with c
  correct samples out of n, averaged over problems, for k = 1, 2, 4, ... and n itself.
- maj@n: the share of problems whose most frequent extracted answer is correct. Answers are
  compared as strings (math-verify equivalences such as "0.5" and "1/2" are not merged); a tie goes
  to the answer sampled first (lowest sample index); a problem without any answer counts wrong.
- tool calls and failures per trajectory: executed calls and failed calls of the raw trajectories
  (every attempt, whatever the context showed the model), over all samples.
- first-call error rate: the share of first attempts at a step whose call failed (the collect
  summary's definition); recovery rate: failed steps that a retry fixed.
Rates with an empty denominator are NaN, never a made-up 0.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.engine.collect.summary import summarize
from cleaner.records import Rollout, Segment


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of the n samples, drawn without replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return (*ks, n)


def majority_correct(samples: Sequence[Rollout]) -> bool:
    """Whether the most frequent answer among `samples` (in sample order) is a correct one."""
    ordered = sorted(samples, key=lambda rollout: rollout.sample_index)
    votes = Counter(rollout.answer for rollout in ordered if rollout.answer is not None)
    if not votes:
        return False
    winner, _ = votes.most_common(1)[0]  # most_common keeps first-seen order among ties
    return next(rollout.correct for rollout in ordered if rollout.answer == winner)


@dataclass(frozen=True)
class EvalMetrics:
    problems: int
    rollouts: int
    n: int  # samples per problem
    avg_at_n: float
    pass_at_k: tuple[tuple[int, float], ...]  # (k, pass@k) for k in k_values(n)
    maj_at_n: float
    tool_calls_per_trajectory: float
    failures_per_trajectory: float
    first_call_error_rate: float
    recovery_rate: float


def eval_metrics(rollouts: Sequence[Rollout], segments: Sequence[Segment], n: int) -> EvalMetrics:
    """The metrics of an evaluation in which every problem has exactly n samples."""
    by_problem: dict[str, list[Rollout]] = defaultdict(list)
    for rollout in rollouts:
        by_problem[rollout.prompt_id].append(rollout)
    short = {prompt_id: len(samples) for prompt_id, samples in by_problem.items() if len(samples) != n}
    if short or not by_problem:
        raise ValueError(f"every problem needs {n} samples; got {short or 'no problems'}")
    correct = [sum(rollout.correct for rollout in samples) for samples in by_problem.values()]
    problems = len(by_problem)
    summary = summarize(rollouts, segments)
    return EvalMetrics(
        problems=problems, rollouts=len(rollouts), n=n,
        avg_at_n=sum(float(rollout.reward) for rollout in rollouts) / len(rollouts),
        pass_at_k=tuple((k, sum(pass_at_k(n, c, k) for c in correct) / problems) for k in k_values(n)),
        maj_at_n=sum(majority_correct(samples) for samples in by_problem.values()) / problems,
        tool_calls_per_trajectory=sum(rollout.n_tool_calls for rollout in rollouts) / len(rollouts),
        failures_per_trajectory=sum(rollout.n_failed_calls for rollout in rollouts) / len(rollouts),
        first_call_error_rate=summary.first_attempt_error_rate,
        recovery_rate=summary.recovery_rate,
    )
