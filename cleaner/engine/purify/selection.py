"""Which rollouts of a group a purify config trains, and which it masks (docs/architecture.md §7).

Two decisions beside SAAR's, made from the stored attempts, so `cleaner ablate` compares them with
SAAR on the same rollouts:

- **Down-sampling** (`down_sample`): GRPO-RoC (rStar2-Agent, arXiv 2508.20722; microsoft/rStar
  `rstar2_agent/down_sample/roc.py`, `resample_of_correct`) collects a larger group and keeps
  `down_sample_to` of it: the negatives (reward <= 0) and the positives in proportion (Python's
  `round`, as the reference), at least `roc_min_negatives` / `roc_min_positives` of each where the
  group has them; the positives with the lowest penalty first (a stable sort: ties in sample
  order), the negatives in sample order, as the reference takes them. A group smaller than
  `down_sample_to` is dropped whole, as the reference drops it. (The reference also keeps a group
  whole when both rounded shares fall below their minimums; the two shares add up to at least
  down_sample_to - 1, so with the minimums at most down_sample_to, which it asserts and
  PurifyConfig checks, that never happens, and cleaner has no such branch.) `uniform` keeps
  `down_sample_to` members chosen uniformly (the smallest sha256 of their rollout ids: the same
  choice on every replay), the control that makes RoC's comparison fair. The advantages are the
  kept rows' (pipeline.py); the dropped rows are stored, marked, and never trained. Where the
  reference's two rounded shares do not add up to down_sample_to, its assertion stops training
  (an odd down_sample_to with a group of twice its size can do it); cleaner gives the positives
  what the negatives leave.
- **Void turns** (`void_turn_filter`): SimpleTIR (arXiv 2509.02479; ltzheng/SimpleTIR
  `recipe/simpletir/agent_utils.py`, `mask_void_turns`) leaves out of the loss every trajectory
  with a turn that holds neither a complete call nor a final answer; its row stays in the batch with
  a zero loss mask, and in its group's statistics, as SimpleTIR's trainer keeps it.

Departures from the references, where cleaner's format differs:
- A tool response failed iff its status is not `ok` (the reference looks for "error" in the
  response text); infrastructure faults are not the policy's, so they count neither as a response
  nor as a failure. No tool response gives the reference's 0.5.
- The answer-format penalty reads the task's own answer format (`grading.programs.final_answers`:
  `\\boxed{}`, a ```python block for code) where the reference reads `<answer>` tags: 1 without an
  answer, else min((answers - 1) / assistant turns, 1).
- A rollout an infrastructure fault decided is no candidate: its reward says nothing of the policy.
- A void turn is a turn without a call and without a final answer (the last one: the rollout
  ended there, as SimpleTIR's does at a void turn), or a call that does not parse (`format_error`)
  in a turn without a final answer. SimpleTIR stops at a void turn; cleaner's agent loop retries a
  call that does not parse, so later turns can follow it.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.config import DownSample, PurifyConfig
from cleaner.engine.grading.programs import final_answers
from cleaner.engine.model.chat import TOOL_CALL_OPEN
from cleaner.records import Rollout, Segment, SegmentKind, ToolStatus

NO_TOOL_RESPONSE_PENALTY = 0.5  # the reference's error ratio of a trajectory without a tool response


@dataclass(frozen=True)
class Selection:
    """A config's choice over an iteration's rollouts, aligned with them."""

    kept: tuple[bool, ...]  # trained (False: dropped by down-sampling: no row is trained, no say in its group)
    void: tuple[bool, ...]  # holds a void turn (masked when void_turn_filter is on)
    groups_dropped: int = 0  # groups with fewer candidates than down_sample_to, dropped whole


# ---------------------------------------------------------------------------------------------
# Penalties and void turns


def _turn_text(segment: Segment) -> str:
    """An assistant turn's text before its call: an answer inside the call's code is not an answer."""
    return segment.text.split(TOOL_CALL_OPEN, 1)[0] if segment.has_call else segment.text


def tool_error_ratio(segments: Sequence[Segment]) -> float:
    """Failed tool responses over tool responses, infrastructure faults left out; 0.5 without any."""
    statuses = [s.tool_status for s in segments if s.kind == SegmentKind.TOOL and s.tool_status != ToolStatus.INFRA_ERROR]
    if not statuses:
        return NO_TOOL_RESPONSE_PENALTY
    return sum(status != ToolStatus.OK for status in statuses) / len(statuses)


def answer_format_penalty(segments: Sequence[Segment], data_source: str) -> float:
    """1 without a final answer, else min((answers - 1) / assistant turns, 1): repeated answers cost."""
    turns = [s for s in segments if s.kind == SegmentKind.ASSISTANT]
    answers = sum(final_answers(_turn_text(s), data_source) for s in turns)
    if not turns or answers == 0:
        return 1.0
    return min((answers - 1) / len(turns), 1.0)


def roc_penalty(segments: Sequence[Segment], data_source: str, config: PurifyConfig) -> float:
    """The reference's penalty weight: the error ratio and the format penalty, each where switched on."""
    penalty = tool_error_ratio(segments) if config.roc_error_ratio else 0.0
    return penalty + (answer_format_penalty(segments, data_source) if config.roc_answer_format else 0.0)


def has_void_turn(segments: Sequence[Segment], data_source: str) -> bool:
    """True if a turn holds neither a complete call nor a final answer (module notes)."""
    status = {s.seq - 1: s.tool_status for s in segments if s.kind == SegmentKind.TOOL}  # the call each answers
    for segment in segments:
        if segment.kind != SegmentKind.ASSISTANT or final_answers(_turn_text(segment), data_source):
            continue
        if not segment.has_call or status.get(segment.seq) == ToolStatus.FORMAT_ERROR:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Down-sampling one group


def roc_choice(rewards: Sequence[float], penalties: Sequence[float], n: int, min_negatives: int,
               min_positives: int) -> list[int] | None:
    """The members (positions in sample order) rStar's `resample_of_correct` keeps of one group;
    None when the group is smaller than n (the reference drops it)."""
    size = len(rewards)
    if size < n:
        return None
    if size == n:
        return list(range(size))
    negatives = [i for i in range(size) if rewards[i] <= 0]
    positives = sorted((i for i in range(size) if rewards[i] > 0), key=lambda i: penalties[i])  # stable
    n_negatives, n_positives = round(len(negatives) * n / size), round(len(positives) * n / size)
    if n_negatives <= min(min_negatives, len(negatives)):
        n_negatives = min(min_negatives, len(negatives))
        n_positives = n - n_negatives
    if n_positives <= min(min_positives, len(positives)):
        n_positives = min(min_positives, len(positives))
        n_negatives = n - n_positives
    # where the two rounded shares do not add up to n, the reference's assertion fails (an odd n with
    # a group of 2n, say): the positives take what the negatives leave, which is at most their number
    return sorted(positives[:n - n_negatives] + negatives[:n_negatives])


def uniform_choice(rollout_ids: Sequence[str], n: int) -> list[int] | None:
    """n members chosen uniformly: those whose rollout ids hash lowest; None below n, as RoC's."""
    if len(rollout_ids) < n:
        return None
    ranked = sorted(range(len(rollout_ids)), key=lambda i: hashlib.sha256(f"uniform:{rollout_ids[i]}".encode()).digest())
    return sorted(ranked[:n])


# ---------------------------------------------------------------------------------------------
# A config over an iteration


def select(rollouts: Sequence[Rollout], grouped: dict[str, list[Segment]], config: PurifyConfig,
           faults: Sequence[bool]) -> Selection:
    """Which rollouts the config trains and which hold a void turn; `faults` marks the rollouts an
    infrastructure fault decided (never candidates: they are not trained under any config)."""
    void = tuple(has_void_turn(grouped[r.rollout_id], r.data_source) for r in rollouts)
    if config.down_sample == DownSample.NONE:
        return Selection(tuple(True for _ in rollouts), void)
    members: dict[str, list[int]] = defaultdict(list)
    for index, (rollout, fault) in enumerate(zip(rollouts, faults, strict=True)):
        if not fault:
            members[rollout.group_id].append(index)
    kept, dropped_groups = [False] * len(rollouts), 0
    for indices in members.values():
        indices.sort(key=lambda i: rollouts[i].sample_index)  # sample order, as the reference's batch
        chosen = _choose(rollouts, grouped, indices, config)
        dropped_groups += chosen is None
        for position in chosen or ():
            kept[indices[position]] = True
    return Selection(tuple(kept), void, dropped_groups)


def _choose(rollouts: Sequence[Rollout], grouped: dict[str, list[Segment]], indices: list[int],
            config: PurifyConfig) -> list[int] | None:
    group = [rollouts[i] for i in indices]
    if config.down_sample == DownSample.UNIFORM:
        return uniform_choice([r.rollout_id for r in group], config.down_sample_to)
    penalties = [roc_penalty(grouped[r.rollout_id], r.data_source, config) for r in group]
    return roc_choice([r.reward for r in group], penalties, config.down_sample_to, config.roc_min_negatives,
                      config.roc_min_positives)
