"""The premise diagnostic: is there anything for CLEANER to clean? (docs/architecture.md §4)

CLEANER's premise: a model often fails a tool call, fixes it, and still reaches the right answer, so
an outcome-only reward reinforces the failed call together with the success. Whether that holds on
a dataset can be read off one collected iteration by sorting its rollouts into three classes:

- clean: no failed call;
- recovered: at least one failed call, and every step with a failure ended in a successful call;
- unrecovered: some step's failures were never fixed (retries ran out, or a retry answered).

If recovered rollouts are about as accurate as clean ones, their failed calls are noise the reward
cannot see, and purifying them removes it. If they are much less accurate, the reward already
punishes failures, and purifying a wrong-answer rollout only moves its negative advantage onto
clean-looking code. Rollouts that an infrastructure fault decided are left out of every class.

The credit of failed calls says the same in the currency GRPO trains with. The *failed-call
tokens* of a rollout are the assistant tokens (reasoning and call) of every attempt whose call
failed, in the raw view: the tokens outcome-only GRPO trains with the rollout's advantage although
their call failed. Over the rollouts of the classes above, their token-weighted mean advantage and
the share of them that sits in a positive-advantage rollout measure what the baseline does to
failures: positive credit reinforces them (the paper's premise, where cleaning can help), negative
credit already pushes them down.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from cleaner.records import Rollout, Segment, SegmentKind, ToolStatus


class RolloutClass(StrEnum):
    CLEAN = "clean"
    RECOVERED = "recovered"
    UNRECOVERED = "unrecovered"


def classify(segments: Sequence[Segment]) -> RolloutClass:
    """The class of one rollout from its segments (any order)."""
    last_status: dict[int | None, tuple[int, bool]] = {}  # step -> (attempt, ok) of its last call
    failed_steps: set[int | None] = set()
    for segment in segments:
        if segment.kind != SegmentKind.TOOL:
            continue
        ok = segment.tool_status == ToolStatus.OK
        if not ok:
            failed_steps.add(segment.step)
        attempt = segment.attempt or 0
        if segment.step not in last_status or attempt >= last_status[segment.step][0]:
            last_status[segment.step] = (attempt, ok)
    if not failed_steps:
        return RolloutClass.CLEAN
    if all(last_status[step][1] for step in failed_steps):
        return RolloutClass.RECOVERED
    return RolloutClass.UNRECOVERED


@dataclass(frozen=True)
class ClassStats:
    rollouts: int
    accuracy: float | None  # share correct; None for an empty class
    mean_advantage: float | None  # over the advantages as stored (float32); None for an empty class


def failed_call_tokens(segments: Sequence[Segment]) -> int:
    """The rollout's failed-call tokens: every token of each assistant attempt whose call a tool
    segment (same step and attempt) answered with a status other than ok."""
    failed = {(s.step, s.attempt) for s in segments if s.kind == SegmentKind.TOOL and s.tool_status != ToolStatus.OK}
    return sum(len(s.token_ids) for s in segments
               if s.kind == SegmentKind.ASSISTANT and s.call_start is not None and (s.step, s.attempt) in failed)


@dataclass(frozen=True)
class FailedCallCredit:
    """What outcome-only GRPO does to failed calls (module docstring)."""

    tokens: int  # failed-call tokens of the classified rollouts
    mean_advantage: float | None  # token-weighted mean of their rollouts' advantages; None without tokens
    positive_share: float | None  # share of them in rollouts whose advantage is > 0; None without tokens


NO_CREDIT = FailedCallCredit(0, None, None)


@dataclass(frozen=True)
class PremiseStats:
    clean: ClassStats
    recovered: ClassStats
    unrecovered: ClassStats
    credit: FailedCallCredit = NO_CREDIT  # the credit of failed calls under the raw view

    @property
    def recovered_over_clean(self) -> float:
        """Accuracy of recovered rollouts relative to clean ones (the premise holds near 1); NaN
        when either class is empty or no clean rollout is correct."""
        if not self.clean.accuracy or self.recovered.accuracy is None:
            return math.nan
        return self.recovered.accuracy / self.clean.accuracy


def premise_stats(rollouts: Sequence[Rollout], classes: Sequence[RolloutClass | None],
                  advantages: Sequence[float], failed_tokens: Sequence[int] | None = None) -> PremiseStats:
    """Count, accuracy and mean advantage per class, and with `failed_tokens` (each rollout's
    `failed_call_tokens`) the credit of failed calls; a class of None (an infra fault) is skipped.

    Advantages are rounded to float32 first, as the purified rows store them, so the statistics of
    a config purified now equal those rebuilt later from its stored rows."""
    stored = np.asarray(advantages, dtype=np.float32).tolist()
    credit = NO_CREDIT if failed_tokens is None else _credit(classes, stored, failed_tokens)

    def one(kind: RolloutClass) -> ClassStats:
        picked = [(r.correct, a) for r, c, a in zip(rollouts, classes, stored, strict=True) if c == kind]
        if not picked:
            return ClassStats(0, None, None)
        return ClassStats(len(picked), sum(c for c, _ in picked) / len(picked),
                          math.fsum(a for _, a in picked) / len(picked))

    return PremiseStats(one(RolloutClass.CLEAN), one(RolloutClass.RECOVERED), one(RolloutClass.UNRECOVERED), credit)


def _credit(classes: Sequence[RolloutClass | None], advantages: Sequence[float],
            failed_tokens: Sequence[int]) -> FailedCallCredit:
    weighted = [(n, a) for c, a, n in zip(classes, advantages, failed_tokens, strict=True) if c is not None and n]
    tokens = sum(n for n, _ in weighted)
    if not tokens:
        return NO_CREDIT
    return FailedCallCredit(tokens, math.fsum(n * a for n, a in weighted) / tokens,
                            sum(n for n, a in weighted if a > 0) / tokens)
