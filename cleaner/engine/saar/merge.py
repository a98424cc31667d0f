"""SAAR on one chain: merging a failed call's retries (docs/architecture.md §4); the IS gate that
may reject a merge is gate.py's.

A *chain* is the run of segments of one step: a_0, t_0, a_1, t_1, ... (attempt i and the tool
response answering it). `render_chain` renders one chain given the tokens rendered before it;
`walk.py` walks the chains of a rollout and assembles the row.

Design decisions:
- Merge, as the reference: cur = a_0; for each later a_i, if both have a call and their
  similarity >= gamma, shallow (cur's reasoning + a_i's call tokens), else deep (cur = a_i). Token
  ids and behaviour log-probs are spliced per token, never re-tokenised. The merged turn's code is
  always that of the last attempt merged into it.
- Similarity: `code` compares the two `tool_code` strings and falls back to `call` when either is
  None; calls of two different tools are never alike by code (their `tool_code`s are arguments of
  different functions); `call` compares decode(token_ids[call_start:]) as the reference does. Ratios are memoised:
  an ablation grid compares the same pair of calls once per config.
- The IS gate (gate.py) sees each merge before it is made: a merge it rejects stops the merging,
  and the chain renders raw from there.
- Chains are decided left to right, each under the rendering of the chains before it, which is
  exactly the context the reference's online loop had when it decided.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

from cleaner.config import SaarMerge, SimilarityOn
from cleaner.engine.saar.gate import Gate
from cleaner.records import Segment, SegmentKind
from cleaner.tools.responses import TOOL_NAME

Decode = Callable[[Sequence[int]], str]


class Outcome(StrEnum):
    """How one step (chain) was rendered; also the kind of one merge (SHALLOW or DEEP)."""

    CLEAN = "clean"  # one attempt, no failed call: unchanged
    SHALLOW = "shallow"  # recovered; every merge kept the earlier reasoning
    DEEP = "deep"  # recovered; every merge replaced the whole turn
    MIXED = "mixed"  # recovered with both kinds of merge
    GATED = "gated"  # recovered, but a merge was too off-policy (IS < tau): raw from that merge on
    UNRECOVERED = "unrecovered"  # no successful call (retries exhausted, or still in progress)
    ANSWERED = "answered"  # a retry answered instead of calling
    RAW = "raw"  # rendered raw: the view is raw, or an earlier step was unrecovered


class KeptTokens(NamedTuple):
    """Tokens [start, end) of raw segment `seq` that appear in a rendering (a NamedTuple: render
    makes one per segment, and a frozen dataclass costs several times more to build)."""

    seq: int
    start: int
    end: int


@dataclass(frozen=True)
class MergeDecision:
    """One SAAR merge of attempt a_i into the turn built from the earlier attempts."""

    attempt: int  # i of the attempt merged in (>= 1)
    similarity: float | None  # difflib ratio; None when either side had no call (always deep)
    kind: Outcome  # SHALLOW or DEEP
    log_is: float | None = None  # log IS of the merge when the gate is on and knows it
    rejected: bool = False  # the gate rejected it: the chain renders raw from here


# ----------------------------------------------------------------------------------------------
# Spans: pieces of the output, each either trained (assistant) or context (prompt, tool)


@dataclass(frozen=True)
class Span:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # behaviour logprobs; zeros for context spans
    trained: bool
    call_start: int | None = None  # assistant spans: where the call begins
    code: str | None = None  # assistant spans: the code of the call
    origin: tuple[KeptTokens, ...] = ()  # the raw token ranges these tokens are, in order
    tool: str | None = None  # assistant spans with a call: the tool it names (None: the code interpreter)


def span_of(segment: Segment) -> Span:
    origin = (KeptTokens(segment.seq, 0, len(segment.token_ids)),)
    if segment.kind != SegmentKind.ASSISTANT:
        return Span(segment.token_ids, (0.0,) * len(segment.token_ids), trained=False, origin=origin)
    if segment.logprobs is None:
        raise ValueError(f"assistant segment {segment.rollout_id}#{segment.seq} has no logprobs")
    tool = None if segment.tool_name == TOOL_NAME else segment.tool_name  # older parts store no name
    return Span(segment.token_ids, segment.logprobs, True, segment.call_start, segment.tool_code, origin, tool)


def _cut_origin(origin: Sequence[KeptTokens], start: int, end: int) -> tuple[KeptTokens, ...]:
    """The provenance of tokens [start, end) of a span whose provenance is `origin`."""
    pieces: list[KeptTokens] = []
    offset = 0
    for piece in origin:
        length = piece.end - piece.start
        low, high = max(start, offset), min(end, offset + length)
        if low < high:
            pieces.append(KeptTokens(piece.seq, piece.start + low - offset, piece.start + high - offset))
        offset += length
    return tuple(pieces)


# ----------------------------------------------------------------------------------------------
# One chain


@dataclass(frozen=True)
class ChainResult:
    spans: tuple[Span, ...]
    n_shallow: int
    n_deep: int
    outcome: Outcome  # UNRECOVERED or ANSWERED: the rest of the trajectory renders raw
    merges: tuple[MergeDecision, ...] = ()
    failed_turns: tuple[tuple[int, Span], ...] = ()  # recovered: (seq of a_k, cur_k) per failed a_k
    n_gated: int = 0  # merges the IS gate rejected


def raw_chain(chain: Sequence[Segment]) -> ChainResult:
    return ChainResult(tuple(span_of(segment) for segment in chain), 0, 0, Outcome.RAW)


def render_chain(chain: Sequence[Segment], settings: SaarMerge, decode: Decode | None, prefix: tuple[int, ...],
                 gate: Gate | None) -> ChainResult:
    """One chain under SAAR's merge `settings`; `prefix` is everything rendered before it (the gate's context)."""
    pairs = _attempts(chain)
    if len(pairs) == 1 and (pairs[0][1] is None or not pairs[0][1].failed):
        return ChainResult(tuple(span_of(segment) for segment in chain), 0, 0, Outcome.CLEAN)  # unchanged

    def merge(count: int) -> _Merged:
        return _merge([a for a, _ in pairs[:count]], settings, decode, prefix, gate)

    for i, (assistant, tool) in enumerate(pairs):
        if i > 0 and not assistant.has_call:  # the retry answered instead of calling
            merged = merge(i)
            return _finish(chain, pairs, merged, Outcome.ANSWERED, tail=[pairs[i - 1][1], *chain[chain.index(assistant):]])
        if tool is not None and not tool.failed:  # first success at attempt i
            merged = merge(i + 1)
            return _finish(chain, pairs, merged, _recovered(merged), tail=[tool])
    # No success: exhausted, or in progress during collection; both render the same tokens.
    merged = merge(len(pairs))
    return _finish(chain, pairs, merged, Outcome.UNRECOVERED, tail=[t for t in (pairs[-1][1],) if t is not None])


def _finish(chain: Sequence[Segment], pairs, merged: _Merged, outcome: Outcome, tail: list[Segment]) -> ChainResult:
    """The chain's spans: the merged turn, then `tail`; or, if the gate rejected the merge of
    attempt k, the turn built from a_0..a_{k-1} and the chain as collected from t_{k-1} on."""
    if merged.rejected_at is None:
        failed = tuple((pairs[k][0].seq, merged.turns[k]) for k in range(len(merged.turns) - 1)) \
            if outcome in (Outcome.SHALLOW, Outcome.DEEP, Outcome.MIXED) else ()
        return ChainResult((merged.turn, *(span_of(s) for s in tail)), merged.n_shallow, merged.n_deep,
                           outcome, merged.decisions, failed)
    before = pairs[merged.rejected_at - 1][1]
    rest = chain[chain.index(before):]
    gated = Outcome.GATED if outcome in (Outcome.SHALLOW, Outcome.DEEP, Outcome.MIXED) else outcome
    return ChainResult((merged.turn, *(span_of(s) for s in rest)), merged.n_shallow, merged.n_deep,
                       gated, merged.decisions, n_gated=1)


def _recovered(merged: _Merged) -> Outcome:
    if merged.n_deep == 0:
        return Outcome.SHALLOW
    return Outcome.DEEP if merged.n_shallow == 0 else Outcome.MIXED


def _attempts(chain: Sequence[Segment]) -> list[tuple[Segment, Segment | None]]:
    """Pair each assistant attempt with the tool segment answering it; check the chain's shape."""
    pairs: list[tuple[Segment, Segment | None]] = []
    for segment in chain:
        where = f"rollout {segment.rollout_id} seq {segment.seq}"
        if segment.kind == SegmentKind.ASSISTANT:
            if pairs and pairs[-1][1] is None:
                raise ValueError(f"{where}: attempt follows an attempt with no tool response")
            if pairs and not pairs[-1][1].failed:
                raise ValueError(f"{where}: attempt follows a successful call at the same step")
            if segment.step is not None and segment.attempt != len(pairs):
                raise ValueError(f"{where}: expected attempt {len(pairs)}, got {segment.attempt}")
            pairs.append((segment, None))
        elif segment.kind == SegmentKind.TOOL:
            if not pairs or pairs[-1][1] is not None:
                raise ValueError(f"{where}: tool segment without the call it answers")
            pairs[-1] = (pairs[-1][0], segment)
    return pairs


# ----------------------------------------------------------------------------------------------
# SAAR merge


@dataclass(frozen=True)
class _Merged:
    turn: Span  # the merged turn (up to the rejected merge, if one was)
    n_shallow: int  # merges made
    n_deep: int
    decisions: tuple[MergeDecision, ...]
    turns: tuple[Span, ...] = field(default=())  # cur after merging a_0, a_1, ... (turns[0] = a_0)
    rejected_at: int | None = None  # the attempt whose merge the gate rejected


def _merge(attempts: Sequence[Segment], settings: SaarMerge, decode: Decode | None, prefix: tuple[int, ...],
           gate: Gate | None) -> _Merged:
    """cur = a_0; for each later a_i: shallow (prefix(cur) + call(a_i)) if similar enough, else deep;
    a merge the gate rejects stops the merging there."""
    current = span_of(attempts[0])
    turns, decisions = [current], []
    for index, attempt in enumerate(attempts[1:], start=1):
        following = span_of(attempt)
        both_call = current.call_start is not None and following.call_start is not None
        similarity = _similarity(current, following, settings.similarity_on, decode) if both_call else None
        shallow = similarity is not None and similarity >= settings.gamma
        kind = Outcome.SHALLOW if shallow else Outcome.DEEP
        log_is = None
        if gate is not None:
            cut, start = (current.call_start, following.call_start) if shallow else (0, 0)
            context = prefix + current.token_ids[:cut] if shallow else prefix
            log_is = gate.log_is(context, following.token_ids[start:], following.logprobs[start:])
            if gate.rejects(log_is):
                decisions.append(MergeDecision(attempt.attempt, similarity, kind, log_is, rejected=True))
                return _counted(current, decisions, turns, rejected_at=index)
        current = _shallow(current, following) if shallow else following
        turns.append(current)
        decisions.append(MergeDecision(attempt.attempt, similarity, kind, log_is))
    return _counted(current, decisions, turns, rejected_at=None)


def _counted(turn: Span, decisions: list[MergeDecision], turns: list[Span], rejected_at: int | None) -> _Merged:
    made = [d for d in decisions if not d.rejected]
    n_shallow = sum(d.kind == Outcome.SHALLOW for d in made)
    return _Merged(turn, n_shallow, len(made) - n_shallow, tuple(decisions), tuple(turns), rejected_at)


def _shallow(current: Span, following: Span) -> Span:
    """current's reasoning with following's call."""
    cut, start = current.call_start, following.call_start
    return Span(
        current.token_ids[:cut] + following.token_ids[start:],
        current.logprobs[:cut] + following.logprobs[start:],
        True,
        call_start=cut,
        code=following.code,
        origin=_cut_origin(current.origin, 0, cut) + _cut_origin(following.origin, start, len(following.token_ids)),
        tool=following.tool,
    )


def _similarity(earlier: Span, later: Span, similarity_on: SimilarityOn, decode: Decode | None) -> float:
    """difflib ratio of the two calls' code (`code`) or decoded call tokens (`call`). By code, calls
    of two different tools are not alike, whatever their arguments (a retry that changes tools is a
    new approach: deep)."""
    if similarity_on == SimilarityOn.CODE and earlier.tool != later.tool:
        return 0.0
    if similarity_on == SimilarityOn.CODE and earlier.code is not None and later.code is not None:
        return _ratio(earlier.code, later.code)
    if decode is None:
        raise ValueError("comparing calls by their tokens (similarity_on='call', or a call whose "
                         "code did not parse) needs a decode function")
    earlier_text = decode(earlier.token_ids[earlier.call_start:])
    later_text = decode(later.token_ids[later.call_start:])
    return _ratio(earlier_text, later_text)


def clear_similarity_cache() -> None:
    """Forget memoised similarities (benchmarks time a cold ablation)."""
    _ratio.cache_clear()


@functools.lru_cache(maxsize=65536)
def _ratio(earlier: str, later: str) -> float:
    """difflib's ratio, memoised: an ablation grid compares the same pair of calls once per config."""
    return difflib.SequenceMatcher(None, earlier, later).ratio()
