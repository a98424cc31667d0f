"""Negative samples: the one route by which a recovered failure gets a push down (docs/architecture.md §7).

The reference's `save_negative_samples` / `use_dpo_on_tool_calls` (off in the paper's scripts).
Purifying a recovered chain removes the failed call from the row, so the outcome reward can no
longer reach it. A negative sample puts it back as a row of its own: the failed call in its
rendered context, trained only on its call tokens, paired with the fix in the purified row. A
SimPO-style term on the old log-probs moves the pair's advantages apart:

    delta = mean log pi(fix call tokens) - mean log pi(failed call tokens)
    s     = sigmoid(-beta * delta)                    (large while the fix is not yet preferred)
    fix call tokens:    advantage += min(beta * s / n_fix,    cap)
    failed call tokens: advantage -= min(beta * s / n_failed, cap)

Design decisions:
- The log-probs are the rows' old log-probs (the scorer's, under each row's own context), as the
  reference uses its recomputed old_log_probs; the term is a constant added to the advantages,
  not a differentiated loss.
- cap: `dpo_cap = relative` (the default) caps at dpo_max_adjustment_ratio * |the purified row's
  advantage|, so the term never outweighs the outcome signal and vanishes in an all-equal group;
  `absolute` caps at dpo_max_adjustment_ratio itself, as the reference's code does (its docstring
  says relative; docs/architecture.md §10).
- Every failed attempt of a recovered chain gives a pair with that chain's fix (the reference keeps
  the latest failure of a position); a fix paired with several failures gets every push.
- A negative row has advantage 0 and stays out of every group statistic: its only non-zero
  advantages are the pushes on its call tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.config import DpoCap


@dataclass(frozen=True)
class AdvantageShift:
    """The per-token advantage changes of one (fix, failure) pair; both are >= 0."""

    delta: float  # mean old log-prob of the fix's call tokens minus the failure's
    fix: float  # added to each fix call token
    failed: float  # subtracted from each failed call token


def dpo_push(fix_logprobs: Sequence[float], failed_logprobs: Sequence[float], beta: float,
             max_ratio: float, cap: DpoCap, advantage: float) -> AdvantageShift:
    """The pair's push; `advantage` is the purified row's (for the relative cap)."""
    if not fix_logprobs or not failed_logprobs:
        return AdvantageShift(0.0, 0.0, 0.0)
    delta = math.fsum(fix_logprobs) / len(fix_logprobs) - math.fsum(failed_logprobs) / len(failed_logprobs)
    s = 1.0 / (1.0 + math.exp(beta * delta))  # sigmoid(-beta * delta)
    limit = max_ratio * abs(advantage) if cap == DpoCap.RELATIVE else max_ratio
    return AdvantageShift(delta, min(beta * s / len(fix_logprobs), limit), min(beta * s / len(failed_logprobs), limit))


def with_pushes(advantage: float, length: int, ranges: Sequence[tuple[int, int, float]]) -> tuple[float, ...]:
    """Per-token advantages of a row: `advantage` everywhere, plus `amount` on each [start, end)."""
    values = [advantage] * length
    for start, end, amount in ranges:
        for index in range(start, end):
            values[index] += amount
    return tuple(values)
