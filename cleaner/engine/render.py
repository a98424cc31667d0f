"""The trajectory renderer: raw and purified (SAAR) views of one rollout (docs/architecture.md §4).

`render(segments, view)` turns the stored segments of ONE rollout into a token sequence with a loss
mask and behaviour log-probabilities. Assistant tokens are trained (loss_mask 1, their behaviour
logprobs); prompt and tool tokens are context (loss_mask 0, logprob 0.0). The same function builds
the agent loop's context during collection and the training rows during purify.

Design decisions:
- A *chain* is the maximal run of consecutive non-prompt segments sharing one `step`: a_0, t_0,
  a_1, t_1, ... (assistant attempt i, then the tool segment answering it). Each chain is rendered on
  its own; an unrecovered chain (no successful call, or a retry that answered instead of calling)
  switches the rest of the trajectory to the raw view, as the reference disables rollback after it.
- Exhausted vs in progress: render never looks at K. A chain whose last call failed renders as
  merged(a_0..a_last) + t_last whether retries ran out (the next segment has another step, rendered
  raw) or the retry has simply not been generated yet (nothing follows). Both give the same tokens,
  which is exactly the context the next retry must see during collection.
- Token ids and behaviour logprobs are spliced per token, never re-tokenised from text: a shallow
  merge keeps the earlier turn's reasoning tokens (with their logprobs) and takes the new call's.
- Similarity (`similarity_on`): `code` compares the two `tool_code` strings and falls back to `call`
  when either is None; `call` compares decode(token_ids[call_start:]) as the reference does. The
  merged turn's code and call tokens are always those of the last attempt merged into it.
- n_unrecovered counts chains rendered without a successful call, including a chain that is merely
  in progress during collection (stats of partial renders are not used).
- Malformed chains (attempt numbers out of order, an attempt after a successful call, a tool segment
  without its call) raise ValueError naming the rollout and seq: they are collector bugs.
- `explain(segments, view)` reports, per step, the outcome and every merge decision (similarity and
  shallow/deep) and which raw tokens survive. It reads them off the very walk `render` does (each
  span carries its provenance: the (seq, start, end) token ranges of the raw segments it came from),
  so the explanation cannot drift from the rendering; there is no second implementation of SAAR.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from cleaner.engine.config import SimilarityOn
from cleaner.engine.records import Segment, SegmentKind, enum_value

Decode = Callable[[Sequence[int]], str]

# ----------------------------------------------------------------------------------------------
# Public records


@dataclass(frozen=True)
class View:
    """How to render: raw, or purified with SAAR at threshold gamma."""

    purified: bool
    gamma: float = 0.5  # shallow merge iff similarity >= gamma (gamma > 1: always deep)
    similarity_on: SimilarityOn = SimilarityOn.CODE  # what the merge decision compares

    def __post_init__(self) -> None:
        object.__setattr__(self, "similarity_on", enum_value(SimilarityOn, self.similarity_on, "similarity_on"))
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")


RAW = View(purified=False)


@dataclass(frozen=True)
class RenderStats:
    n_shallow: int  # merges that kept the earlier reasoning and took the new call
    n_deep: int  # merges that replaced the whole assistant turn
    n_unrecovered: int  # chains rendered without a successful call
    tokens_removed: int  # len(raw view) - len(this view)


class KeptTokens(NamedTuple):
    """Tokens [start, end) of raw segment `seq` that appear in a rendering (a NamedTuple: render
    makes one per segment, and a frozen dataclass costs ~4x more to build)."""

    seq: int
    start: int
    end: int


@dataclass(frozen=True)
class MergeDecision:
    """One SAAR merge of attempt a_i into the turn built from the earlier attempts."""

    attempt: int  # i of the attempt merged in (>= 1)
    similarity: float | None  # difflib ratio; None when either side had no call (always deep)
    kind: Outcome  # SHALLOW or DEEP


class Outcome(StrEnum):
    """How one step (chain) was rendered; also the kind of one merge (SHALLOW or DEEP)."""

    CLEAN = "clean"  # one attempt, no failed call: unchanged
    SHALLOW = "shallow"  # recovered; every merge kept the earlier reasoning
    DEEP = "deep"  # recovered; every merge replaced the whole turn
    MIXED = "mixed"  # recovered with both kinds of merge
    UNRECOVERED = "unrecovered"  # no successful call (retries exhausted, or still in progress)
    ANSWERED = "answered"  # a retry answered instead of calling
    RAW = "raw"  # rendered raw: the view is raw, or an earlier step was unrecovered


@dataclass(frozen=True)
class StepOutcome:
    """How one step (chain) of a rollout was rendered."""

    step: int | None
    seqs: tuple[int, ...]  # the chain's raw segments, in order
    attempts: int  # assistant attempts at this step
    outcome: Outcome
    merges: tuple[MergeDecision, ...]  # in order of the attempts merged in
    kept: tuple[KeptTokens, ...]  # raw token ranges the rendering emits for this step, in order
    removed_seqs: tuple[int, ...]  # raw segments of which no token is emitted
    tokens_removed: int  # raw tokens of the chain minus emitted tokens


@dataclass(frozen=True)
class Rendered:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 = assistant token that is trained
    behavior_logprobs: tuple[float, ...]  # aligned with token_ids; 0.0 where loss_mask = 0
    prompt_len: int  # tokens of the leading prompt segment(s)
    stats: RenderStats


def view_for(
    rollback_draw: float, purified: bool, gamma: float, rollback_prob: float,
    similarity_on: SimilarityOn
) -> View:
    """The view of one rollout: purified iff `purified` and its draw u < p, else RAW (docs/architecture.md §4)."""
    if purified and rollback_draw < rollback_prob:
        return View(purified=True, gamma=gamma, similarity_on=similarity_on)
    return RAW


# ----------------------------------------------------------------------------------------------
# Spans: pieces of the output, each either trained (assistant) or context (prompt, tool)


@dataclass(frozen=True)
class _Span:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # behaviour logprobs; zeros for context spans
    trained: bool
    call_start: int | None = None  # assistant spans: where the call begins
    code: str | None = None  # assistant spans: the code of the call
    origin: tuple[KeptTokens, ...] = ()  # the raw token ranges these tokens are, in order


def _span(segment: Segment) -> _Span:
    origin = (KeptTokens(segment.seq, 0, len(segment.token_ids)),)
    if segment.kind != SegmentKind.ASSISTANT:
        return _Span(segment.token_ids, (0.0,) * len(segment.token_ids), trained=False, origin=origin)
    if segment.logprobs is None:
        raise ValueError(f"assistant segment {segment.rollout_id}#{segment.seq} has no logprobs")
    return _Span(segment.token_ids, segment.logprobs, True, segment.call_start, segment.tool_code, origin)


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


def _assemble(spans: Sequence[_Span], prompt_len: int, stats: RenderStats) -> Rendered:
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for span in spans:
        token_ids.extend(span.token_ids)
        loss_mask.extend([int(span.trained)] * len(span.token_ids))
        logprobs.extend(span.logprobs if span.trained else (0.0,) * len(span.token_ids))
    return Rendered(tuple(token_ids), tuple(loss_mask), tuple(logprobs), prompt_len, stats)


# ----------------------------------------------------------------------------------------------
# Rendering


def _split(
    segments: Sequence[Segment], view: View, decode: Decode | None
) -> tuple[list[Segment], list[Segment]]:
    """Check the input; the prompt segments and the rest, in seq order."""
    if not segments:
        raise ValueError("render needs at least one segment")
    ordered = sorted(segments, key=lambda segment: segment.seq)
    if len({segment.rollout_id for segment in ordered}) > 1:
        raise ValueError("render takes the segments of one rollout; got several rollout_ids")
    if view.purified and view.similarity_on == SimilarityOn.CALL and decode is None:
        raise ValueError("similarity_on='call' needs a decode function (token ids -> text)")
    prompt = [segment for segment in ordered if segment.kind == SegmentKind.PROMPT]
    body = [segment for segment in ordered if segment.kind != SegmentKind.PROMPT]
    if ordered[: len(prompt)] != prompt:
        raise ValueError(f"rollout {ordered[0].rollout_id}: prompt segments must come first")
    return prompt, body


def render(segments: Sequence[Segment], view: View, decode: Decode | None = None) -> Rendered:
    """Render the segments of ONE rollout under `view` (sorted by seq here)."""
    prompt, body = _split(segments, view, decode)
    prompt_len = sum(len(segment.token_ids) for segment in prompt)
    raw_len = prompt_len + sum(len(segment.token_ids) for segment in body)
    spans = [_span(segment) for segment in prompt]
    results = [result for _, result in _walk(body, view, decode)]
    for result in results:
        spans.extend(result.spans)
    length = sum(len(span.token_ids) for span in spans)
    stats = RenderStats(
        n_shallow=sum(result.n_shallow for result in results),
        n_deep=sum(result.n_deep for result in results),
        n_unrecovered=sum(result.outcome in (Outcome.UNRECOVERED, Outcome.ANSWERED) for result in results),
        tokens_removed=raw_len - length,
    )
    return _assemble(spans, prompt_len, stats)


def explain(segments: Sequence[Segment], view: View, decode: Decode | None = None) -> list[StepOutcome]:
    """Step by step, how `render(segments, view, decode)` treats each chain (prompt excluded)."""
    _, body = _split(segments, view, decode)
    outcomes = []
    for chain, result in _walk(body, view, decode):
        kept = tuple(piece for span in result.spans for piece in span.origin)
        emitted = {piece.seq for piece in kept}
        outcomes.append(StepOutcome(
            step=chain[0].step,
            seqs=tuple(segment.seq for segment in chain),
            attempts=sum(segment.kind == SegmentKind.ASSISTANT for segment in chain),
            outcome=result.outcome,
            merges=result.merges,
            kept=kept,
            removed_seqs=tuple(segment.seq for segment in chain if segment.seq not in emitted),
            tokens_removed=sum(len(segment.token_ids) for segment in chain)
            - sum(piece.end - piece.start for piece in kept),
        ))
    return outcomes


def _walk(
    body: Sequence[Segment], view: View, decode: Decode | None
) -> list[tuple[list[Segment], _ChainResult]]:
    """Each chain with its rendering; after an unrecovered chain (or in the raw view) chains are raw."""
    walked = []
    raw = not view.purified
    for chain in _chains(body):
        result = _raw_chain(chain) if raw else _render_chain(chain, view, decode)
        raw = raw or result.outcome in (Outcome.UNRECOVERED, Outcome.ANSWERED)  # the rest of the trajectory is raw
        walked.append((chain, result))
    return walked


def _chains(body: Sequence[Segment]) -> list[list[Segment]]:
    """Split the non-prompt segments into maximal runs of one step (a None step stands alone)."""
    chains: list[list[Segment]] = []
    for segment in body:
        if chains and segment.step is not None and chains[-1][-1].step == segment.step:
            chains[-1].append(segment)
        else:
            chains.append([segment])
    return chains


@dataclass(frozen=True)
class _ChainResult:
    spans: tuple[_Span, ...]
    n_shallow: int
    n_deep: int
    outcome: Outcome  # UNRECOVERED or ANSWERED: the rest renders raw
    merges: tuple[MergeDecision, ...] = ()


def _raw_chain(chain: Sequence[Segment]) -> _ChainResult:
    return _ChainResult(tuple(_span(segment) for segment in chain), 0, 0, Outcome.RAW)


def _recovered(merged: _Merged) -> str:
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


def _render_chain(chain: Sequence[Segment], view: View, decode: Decode | None) -> _ChainResult:
    pairs = _attempts(chain)
    if len(pairs) == 1 and (pairs[0][1] is None or not pairs[0][1].failed):
        return _ChainResult(tuple(_span(segment) for segment in chain), 0, 0, Outcome.CLEAN)  # unchanged
    for i, (assistant, tool) in enumerate(pairs):
        if i > 0 and not assistant.has_call:  # the retry answered instead of calling
            merged = _merge([a for a, _ in pairs[:i]], view, decode)
            rest = chain[chain.index(assistant):]  # a_i and anything after it, raw
            spans = (merged.turn, _span(pairs[i - 1][1]), *(_span(segment) for segment in rest))
            return _ChainResult(spans, merged.n_shallow, merged.n_deep, Outcome.ANSWERED, merged.decisions)
        if tool is not None and not tool.failed:  # first success at attempt i
            merged = _merge([a for a, _ in pairs[: i + 1]], view, decode)
            return _ChainResult((merged.turn, _span(tool)), merged.n_shallow, merged.n_deep,
                                _recovered(merged), merged.decisions)
    # No success: exhausted, or in progress during collection; both render the same tokens.
    merged = _merge([a for a, _ in pairs], view, decode)
    last_tool = pairs[-1][1]
    spans = (merged.turn,) if last_tool is None else (merged.turn, _span(last_tool))
    return _ChainResult(spans, merged.n_shallow, merged.n_deep, Outcome.UNRECOVERED, merged.decisions)


# ----------------------------------------------------------------------------------------------
# SAAR merge


@dataclass(frozen=True)
class _Merged:
    turn: _Span
    n_shallow: int
    n_deep: int
    decisions: tuple[MergeDecision, ...]


def _merge(attempts: Sequence[Segment], view: View, decode: Decode | None) -> _Merged:
    """cur = a_0; for each later a_i: shallow (prefix(cur) + call(a_i)) if similar enough, else deep."""
    current = _span(attempts[0])
    decisions: list[MergeDecision] = []
    for attempt in attempts[1:]:
        following = _span(attempt)
        both_call = current.call_start is not None and following.call_start is not None
        similarity = _similarity(current, following, view.similarity_on, decode) if both_call else None
        if similarity is not None and similarity >= view.gamma:
            cut, start = current.call_start, following.call_start
            current = _Span(
                current.token_ids[:cut] + following.token_ids[start:],
                current.logprobs[:cut] + following.logprobs[start:],
                True,
                call_start=cut,
                code=following.code,
                origin=_cut_origin(current.origin, 0, cut)
                + _cut_origin(following.origin, start, len(following.token_ids)),
            )
            decisions.append(MergeDecision(attempt.attempt, similarity, Outcome.SHALLOW))
        else:
            current = following
            decisions.append(MergeDecision(attempt.attempt, similarity, Outcome.DEEP))
    n_shallow = sum(decision.kind == Outcome.SHALLOW for decision in decisions)
    return _Merged(current, n_shallow, len(decisions) - n_shallow, tuple(decisions))


def _similarity(earlier: _Span, later: _Span, similarity_on: SimilarityOn, decode: Decode | None) -> float:
    """difflib ratio of the two calls' code (`code`) or decoded call tokens (`call`)."""
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
