"""The trajectory renderer: raw and purified (SAAR) views of one rollout (docs/architecture.md §4).

`render(segments, view)` turns the stored segments of ONE rollout into a token sequence with a loss
mask and behaviour log-probabilities. Assistant tokens are trained (loss_mask 1, their behaviour
logprobs); prompt and tool tokens are context (loss_mask 0, logprob 0.0). The same function builds
the agent loop's context during collection and the training rows during purify.

Design decisions:
- The rollout is walked chain by chain (a chain: the segments of one step; `merge.py` renders one).
  An unrecovered chain (no successful call, or a retry that answered instead of calling) switches
  the rest of the trajectory to the raw view, as the reference disables rollback after it.
- Exhausted vs in progress: render never looks at K. A chain whose last call failed renders as
  merged(a_0..a_last) + t_last whether retries ran out (the next segment has another step, rendered
  raw) or the retry has simply not been generated yet (nothing follows). Both give the same tokens,
  which is exactly the context the next retry must see during collection.
- The IS gate (`RenderSettings.rollback_is_threshold` > 0) needs an oracle of old-policy log-probs; a rendering that
  assumed an unknown one is marked `provisional` (see merge.py), so the caller scores and renders
  again until nothing is assumed.
- Negative samples (`negatives=True`): each failed attempt a_k of a recovered chain, as the turn
  stood after merging it (its own call, the reasoning SAAR would keep), after the rendered context
  before the chain; paired with the fix's call tokens in the rendered row (docs/architecture.md §7).
- Edit mask (`RenderSettings.edit`, docs/architecture.md §4): the same walk decides every merge, then the raw
  sequence is emitted token for token, and an assistant token is trained iff the replace rendering
  emits it or its attempt's call succeeded. A shallow merge thus masks the failed call, a deep one
  the failed turn; the fix is trained whole where it was sampled; what replace renders raw masks
  nothing. The provenance of the spans (below) says which raw tokens replace emits.
- n_unrecovered counts chains rendered without a successful call, including a chain that is merely
  in progress during collection (stats of partial renders are not used).
- Malformed chains (attempt numbers out of order, an attempt after a successful call, a tool segment
  without its call) raise ValueError naming the rollout and seq: they are collector bugs.
- `explain(segments, view)` reports, per step, the outcome and every merge decision (similarity,
  shallow/deep, IS) and which raw tokens survive. It reads them off the very walk `render` does
  (each span carries its provenance: the (seq, start, end) token ranges of the raw segments it came
  from), so the explanation cannot drift from the rendering; there is no second SAAR.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from cleaner.config import Edit, IsMode, SaarRollback, SaarView, SimilarityOn
from cleaner.config.groups import group_values
from cleaner.engine.saar.gate import Gate, LogprobOracle
from cleaner.engine.saar.merge import (
    ChainResult,
    Decode,
    KeptTokens,
    MergeDecision,
    Outcome,
    Span,
    clear_similarity_cache,
    raw_chain,
    render_chain,
    span_of,
)
from cleaner.records import Segment, SegmentKind

__all__ = ["RAW", "Decode", "Edit", "KeptTokens", "LogprobOracle", "MergeDecision", "NegativeSample", "Outcome",
           "RenderSettings", "RenderStats", "Rendered", "StepOutcome", "clear_similarity_cache", "explain",
           "render", "render_settings", "view_for"]

# ----------------------------------------------------------------------------------------------
# Public records


@dataclass(frozen=True)
class RenderSettings(SaarView):
    """How to render: raw, or purified with SAAR's merge, IS gate and edit (SaarView, config/groups.py).
    A rollout's "view" is the one it was rendered in; the settings are named for what they are, apart
    from the warehouse's SQL views and the `collect_view` flag."""

    purified: bool


RAW = RenderSettings(purified=False)


@dataclass(frozen=True)
class RenderStats:
    n_shallow: int  # merges that kept the earlier reasoning and took the new call
    n_deep: int  # merges that replaced the whole assistant turn
    n_unrecovered: int  # chains rendered without a successful call
    tokens_removed: int  # len(raw view) - len(this view)
    n_gated: int = 0  # merges the IS gate rejected (their chain renders raw from there)
    tokens_masked: int = 0  # edit mask: trained tokens of the raw view that this row does not train


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
    masked: tuple[KeptTokens, ...] = ()  # edit mask: assistant token ranges emitted but not trained


@dataclass(frozen=True)
class NegativeSample:
    """A failed attempt that a later retry fixed, as a row to push down (docs/architecture.md §7)."""

    seq: int  # raw seq of the failed attempt's assistant segment
    token_ids: tuple[int, ...]  # the rendered context before its chain, then the failed turn
    behavior_logprobs: tuple[float, ...]  # aligned with token_ids; 0.0 outside the failed turn
    call_start: int  # the failed call's first token; the row trains [call_start, end) only
    fix_start: int  # the fix's call tokens in the rendered row: [fix_start, fix_end)
    fix_end: int


@dataclass(frozen=True)
class Rendered:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 = assistant token that is trained
    behavior_logprobs: tuple[float, ...]  # aligned with token_ids; 0.0 where loss_mask = 0
    prompt_len: int  # tokens of the leading prompt segment(s)
    stats: RenderStats
    negatives: tuple[NegativeSample, ...] = ()  # with negatives=True
    provisional: bool = False  # an IS decision was assumed (its oracle did not know it yet)


def render_settings(holder: object, purified: bool = True) -> RenderSettings:
    """The settings of a view from any holder of SAAR settings (a config, a group): the SaarView
    fields it has, the others at their defaults."""
    return RenderSettings(purified, **group_values(holder, SaarView))


def view_for(rollback_draw: float, eligible: bool, settings: SaarRollback) -> RenderSettings:
    """The view of one rollout: purified under `settings` iff `eligible` and its draw u < p, else RAW
    (docs/architecture.md §4)."""
    if eligible and rollback_draw < settings.rollback_prob:
        return render_settings(settings)
    return RAW


# ----------------------------------------------------------------------------------------------
# Rendering


def _split(
    segments: Sequence[Segment], view: RenderSettings, decode: Decode | None
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


def render(segments: Sequence[Segment], view: RenderSettings, decode: Decode | None = None,
           oracle: LogprobOracle | None = None, negatives: bool = False) -> Rendered:
    """Render the segments of ONE rollout under `view` (sorted by seq here)."""
    prompt, body = _split(segments, view, decode)
    if negatives and _masking(view):
        raise ValueError("negative samples pair a failed call with a fix spliced into a purified row; "
                         "edit 'mask' builds none")
    gate = _gate(view, oracle)
    walked = _walk(prompt, body, view, decode, gate)
    spans = [span_of(segment) for segment in prompt] + [span for _, r in walked for span in r.spans]
    results = [result for _, result in walked]
    prompt_len = sum(len(segment.token_ids) for segment in prompt)
    raw_len = prompt_len + sum(len(segment.token_ids) for segment in body)
    stats = RenderStats(
        n_shallow=sum(result.n_shallow for result in results),
        n_deep=sum(result.n_deep for result in results),
        n_unrecovered=sum(result.outcome in (Outcome.UNRECOVERED, Outcome.ANSWERED) for result in results),
        tokens_removed=raw_len - sum(len(span.token_ids) for span in spans),
        n_gated=sum(result.n_gated for result in results),
    )
    provisional = gate is not None and gate.provisional
    if _masking(view):
        return _masked(prompt, body, spans, prompt_len, stats, provisional)
    found = _negatives(spans[: len(prompt)], results) if negatives else ()
    return _assemble(spans, prompt_len, stats, found, provisional)


def _masking(view: RenderSettings) -> bool:
    return view.purified and view.edit == Edit.MASK


def _gate(view: RenderSettings, oracle: LogprobOracle | None) -> Gate | None:
    if not view.purified or view.rollback_is_threshold <= 0:
        return None
    if oracle is None:
        raise ValueError("an IS-gated view (rollback_is_threshold > 0) needs an oracle of old-policy log-probs")
    return Gate(view.rollback_is_threshold, oracle, per_token=view.rollback_is_mode == IsMode.MEAN)


def _assemble(spans: Sequence[Span], prompt_len: int, stats: RenderStats,
              negatives: tuple[NegativeSample, ...], provisional: bool) -> Rendered:
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for span in spans:
        token_ids.extend(span.token_ids)
        loss_mask.extend([int(span.trained)] * len(span.token_ids))
        logprobs.extend(span.logprobs if span.trained else (0.0,) * len(span.token_ids))
    return Rendered(tuple(token_ids), tuple(loss_mask), tuple(logprobs), prompt_len, stats, negatives,
                    provisional)


def _masked(prompt: Sequence[Segment], body: Sequence[Segment], spans: Sequence[Span], prompt_len: int,
            stats: RenderStats, provisional: bool) -> Rendered:
    """Edit mask: the raw sequence, with the ranges `_masked_ranges` finds left untrained."""
    masked = _masked_ranges(body, spans)
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for segment in (*prompt, *body):
        span = span_of(segment)
        mask = [int(span.trained)] * len(span.token_ids)
        for piece in masked.get(segment.seq, ()):
            mask[piece.start:piece.end] = [0] * (piece.end - piece.start)
        token_ids.extend(span.token_ids)
        loss_mask.extend(mask)
        logprobs.extend(value if trained else 0.0 for value, trained in zip(span.logprobs, mask, strict=True))
    n_masked = sum(piece.end - piece.start for pieces in masked.values() for piece in pieces)
    stats = dataclasses.replace(stats, tokens_removed=0, tokens_masked=n_masked)
    return Rendered(tuple(token_ids), tuple(loss_mask), tuple(logprobs), prompt_len, stats, (), provisional)


def _masked_ranges(body: Sequence[Segment], spans: Sequence[Span]) -> dict[int, tuple[KeptTokens, ...]]:
    """Per assistant segment, the token ranges edit mask leaves untrained: those the replace
    rendering (`spans`) does not emit, except in an attempt whose call succeeded (a shallow merge
    drops the fix's reasoning; mask trains it in the context it was sampled in)."""
    kept: dict[int, list[tuple[int, int]]] = {}
    for span in spans:
        if span.trained:
            for piece in span.origin:
                kept.setdefault(piece.seq, []).append((piece.start, piece.end))
    succeeded = {call.seq for call, answer in pairwise(body)
                 if call.kind == SegmentKind.ASSISTANT and answer.kind == SegmentKind.TOOL and not answer.failed}
    masked = {}
    for segment in body:
        if segment.kind != SegmentKind.ASSISTANT or segment.seq in succeeded:
            continue
        gaps, position = [], 0
        for start, end in sorted(kept.get(segment.seq, ())):
            if start > position:
                gaps.append(KeptTokens(segment.seq, position, start))
            position = max(position, end)
        if position < len(segment.token_ids):
            gaps.append(KeptTokens(segment.seq, position, len(segment.token_ids)))
        if gaps:
            masked[segment.seq] = tuple(gaps)
    return masked


def _negatives(prompt_spans: Sequence[Span], results: Sequence[ChainResult]) -> tuple[NegativeSample, ...]:
    """The negative samples of the recovered chains, positioned in the rendered row."""
    found = []
    prefix: list[int] = [t for span in prompt_spans for t in span.token_ids]
    for result in results:
        if result.failed_turns:
            turn = result.spans[0]  # the merged turn that made the successful call
            fix_start, fix_end = len(prefix) + turn.call_start, len(prefix) + len(turn.token_ids)
            for seq, failed in result.failed_turns:
                if failed.call_start is None:
                    continue
                found.append(NegativeSample(
                    seq=seq, token_ids=tuple(prefix) + failed.token_ids,
                    behavior_logprobs=(0.0,) * len(prefix) + failed.logprobs,
                    call_start=len(prefix) + failed.call_start, fix_start=fix_start, fix_end=fix_end))
        for span in result.spans:
            prefix.extend(span.token_ids)
    return tuple(found)


def explain(segments: Sequence[Segment], view: RenderSettings, decode: Decode | None = None,
            oracle: LogprobOracle | None = None) -> list[StepOutcome]:
    """Step by step, how `render(segments, view, decode, oracle)` treats each chain (prompt excluded).

    Under edit mask every raw token is emitted; `masked` lists the ranges left untrained."""
    prompt, body = _split(segments, view, decode)
    walked = _walk(prompt, body, view, decode, _gate(view, oracle))
    masking = _masking(view)
    masked = _masked_ranges(body, [span for _, r in walked for span in r.spans]) if masking else {}
    outcomes = []
    for chain, result in walked:
        if masking:
            kept = tuple(KeptTokens(segment.seq, 0, len(segment.token_ids)) for segment in chain)
        else:
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
            masked=tuple(piece for segment in chain for piece in masked.get(segment.seq, ())),
        ))
    return outcomes


def _walk(
    prompt: Sequence[Segment], body: Sequence[Segment], view: RenderSettings, decode: Decode | None, gate: Gate | None
) -> list[tuple[list[Segment], ChainResult]]:
    """Each chain with its rendering; after an unrecovered chain (or in the raw view) chains are raw."""
    walked = []
    raw = not view.purified
    prefix = tuple(t for segment in prompt for t in segment.token_ids) if gate is not None else ()
    for chain in _chains(body):
        if raw:
            result = raw_chain(chain)
        else:
            result = render_chain(chain, view, decode, prefix, gate)
        raw = raw or result.outcome in (Outcome.UNRECOVERED, Outcome.ANSWERED)  # the rest of the trajectory is raw
        walked.append((chain, result))
        if gate is not None:  # the gate's contexts are the tokens rendered so far
            prefix += tuple(t for span in result.spans for t in span.token_ids)
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
