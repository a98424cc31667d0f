"""The exported rows, one function per kind (docs/architecture.md §15): a rollout's conversation
(sft, messages), the pair of each failure-correction chain SAAR purifies, and outcome pairs within
a group. Records in, plain rows out; the folder (folder.py) gives them their Arrow types.

Design decisions:
- A conversation is the stored rollout (raw view: every segment, the text the collection
  decoded) or its purified row (SAAR's rendering as purify stored it: the response split into
  turns where its loss mask changes, assistant tokens being trained and tool tokens context, each
  turn decoded from its token ids), so an IS-gated config exports exactly what it trained.
- A chain pair is read off SAAR's own walk (`saar.explain`, the IS gate off: the pair needs no old
  policy): for each recovered chain (shallow, deep or mixed), `prompt` is the conversation as SAAR
  renders it up to the chain (earlier failures purified, raw after an unrecovered step, as the
  walk renders it), `rejected` the chain's first attempt as generated (the turn the policy wrote at
  that context), `chosen` the merged turn SAAR puts in its place (the same reasoning with the fixed
  call for a shallow merge, the fixing attempt for a deep one). A chain whose calls met an
  infrastructure fault is no pair: the failure was not the policy's.
- An outcome pair matches, within one GRPO group, the i-th correct rollout with the i-th incorrect
  one, each in sample order; min(correct, incorrect) pairs, every rollout in at most one. Rollouts
  an infrastructure fault decided take no part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Protocol, TypeVar

from cleaner.engine.export.conversation import (
    Template,
    Turn,
    as_dicts,
    assistant_message,
    turn_messages,
)
from cleaner.engine.saar.walk import Outcome, RenderSettings, StepOutcome, explain
from cleaner.records import FinishReason, PurifiedRow, Rollout, Segment, SegmentKind, ToolStatus

Decode = Callable[[Sequence[int]], str]
RECOVERED = (Outcome.SHALLOW, Outcome.DEEP, Outcome.MIXED)


class Stored(Protocol):
    """A rollout with its segments, as the job reads them."""

    @property
    def rollout(self) -> Rollout: ...

    @property
    def segments(self) -> Sequence[Segment]: ...


S = TypeVar("S", bound=Stored)


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    exact: bool  # the template renders `messages` back to the stored token ids
    prompt_length: int  # the prompt's messages, the first of `messages`


# ---------------------------------------------------------------------------------------------
# Conversations


def raw_conversation(segments: Sequence[Segment], template: Template) -> Conversation:
    prompt, body = _prompt_text(segments), [s for s in segments if s.kind != SegmentKind.PROMPT]
    turns = [Turn(segment.kind == SegmentKind.ASSISTANT, segment.text) for segment in body]
    return _conversation(prompt, turns, [t for segment in segments for t in segment.token_ids], template)


def purified_conversation(segments: Sequence[Segment], row: PurifiedRow, template: Template,
                          decode: Decode) -> Conversation:
    response, mask = row.token_ids[row.prompt_len:], row.loss_mask[row.prompt_len:]
    turns, start = [], 0
    for trained, run in groupby(range(len(response)), key=lambda index: mask[index]):
        length = sum(1 for _ in run)
        turns.append(Turn(bool(trained), decode(response[start:start + length])))
        start += length
    return _conversation(_prompt_text(segments), turns, row.token_ids, template)


def _conversation(prompt_text: str, turns: Sequence[Turn], token_ids: Sequence[int],
                  template: Template) -> Conversation:
    prompt, prompt_exact = template.prompt_messages(prompt_text)
    messages = as_dicts(prompt) + turn_messages(turns)
    return Conversation(messages, prompt_exact and template.exact(messages, token_ids), len(prompt))


def _prompt_text(segments: Sequence[Segment]) -> str:
    return "".join(segment.text for segment in segments if segment.kind == SegmentKind.PROMPT)


def infra_decided(collected: Stored) -> bool:
    """An infrastructure fault, not the policy, ended or broke the rollout."""
    return collected.rollout.finish_reason == FinishReason.ERROR or any(
        segment.tool_status == ToolStatus.INFRA_ERROR for segment in collected.segments)


# ---------------------------------------------------------------------------------------------
# Chain pairs


@dataclass(frozen=True)
class ChainPair:
    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]
    step: int
    depth: str  # shallow, deep or mixed (a chain with several retries merged both ways)
    error_type: str  # the failed call's exception name, else its status


def chain_pairs(segments: Sequence[Segment], view: RenderSettings, template: Template,
                decode: Decode) -> list[ChainPair]:
    """One pair per chain SAAR recovers in this rollout (module docstring)."""
    by_seq = {segment.seq: segment for segment in segments}
    prompt, _ = template.prompt_messages(_prompt_text(segments))
    context: list[Turn] = []
    pairs = []
    for step in explain(segments, view, decode):
        chain = [by_seq[seq] for seq in step.seqs]
        if step.outcome in RECOVERED and not any(s.tool_status == ToolStatus.INFRA_ERROR for s in chain):
            first, answer = chain[0], chain[1]
            merged = _turns(step, by_seq, decode)[0]
            pairs.append(ChainPair(
                prompt=as_dicts(prompt) + turn_messages(context),
                chosen=[assistant_message(merged.text)], rejected=[assistant_message(first.text)],
                step=first.step, depth=str(step.outcome), error_type=answer.error_type or str(answer.tool_status)))
        context.extend(_turns(step, by_seq, decode))
    return pairs


def _turns(step: StepOutcome, by_seq: dict[int, Segment], decode: Decode) -> list[Turn]:
    """The turns a step renders as: consecutive pieces of assistant segments are one turn (SAAR's
    merge), a whole segment keeps its stored text, a spliced turn is decoded from its tokens."""
    turns = []
    for assistant, pieces in groupby(step.kept, key=lambda piece: by_seq[piece.seq].kind == SegmentKind.ASSISTANT):
        pieces = list(pieces)
        whole = len(pieces) == 1 and pieces[0].start == 0 and pieces[0].end == len(by_seq[pieces[0].seq].token_ids)
        text = by_seq[pieces[0].seq].text if whole else decode(
            [t for piece in pieces for t in by_seq[piece.seq].token_ids[piece.start:piece.end]])
        turns.append(Turn(assistant, text))
    return turns


# ---------------------------------------------------------------------------------------------
# Outcome pairs


def outcome_pairs(group: Sequence[S]) -> list[tuple[S, S]]:
    """(correct, incorrect) pairs of one group (module docstring)."""
    eligible = sorted((c for c in group if not infra_decided(c)), key=lambda c: c.rollout.sample_index)
    correct = [c for c in eligible if c.rollout.correct]
    incorrect = [c for c in eligible if not c.rollout.correct]
    return list(zip(correct, incorrect, strict=False))
