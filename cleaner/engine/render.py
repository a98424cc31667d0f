"""The trajectory renderer: raw and purified (SAAR) views of one rollout (DESIGN.md section 4).

`render(segments, view)` turns the stored segments of ONE rollout into a token sequence with a loss
mask and behaviour log-probabilities. Assistant tokens are trained (loss_mask 1, their behaviour
logprobs); prompt and tool tokens are context (loss_mask 0, logprob 0.0). The same function builds
the agent loop's context during collection (4.4) and the training rows during purify (4.3).

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
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cleaner.engine.records import ASSISTANT, PROMPT, TOOL, Segment

Decode = Callable[[Sequence[int]], str]

# ----------------------------------------------------------------------------------------------
# Public records


@dataclass(frozen=True)
class View:
    """How to render: raw, or purified with SAAR at threshold gamma."""

    purified: bool
    gamma: float = 0.5  # shallow merge iff similarity >= gamma (gamma > 1: always deep)
    similarity_on: str = "code"  # code | call (DESIGN.md 4.2)

    def __post_init__(self) -> None:
        if self.similarity_on not in ("code", "call"):
            raise ValueError(f"similarity_on must be 'code' or 'call', got {self.similarity_on!r}")
        if self.gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma}")


RAW = View(purified=False)


@dataclass(frozen=True)
class RenderStats:
    n_shallow: int  # merges that kept the earlier reasoning and took the new call
    n_deep: int  # merges that replaced the whole assistant turn
    n_unrecovered: int  # chains rendered without a successful call
    tokens_removed: int  # len(raw view) - len(this view)


@dataclass(frozen=True)
class Rendered:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 = assistant token that is trained
    behavior_logprobs: tuple[float, ...]  # aligned with token_ids; 0.0 where loss_mask = 0
    prompt_len: int  # tokens of the leading prompt segment(s)
    stats: RenderStats


def view_for(
    rollback_draw: float, purified: bool, gamma: float, rollback_prob: float, similarity_on: str
) -> View:
    """The view of one rollout: purified iff `purified` and its draw u < p, else RAW (DESIGN.md 4.3)."""
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


def _span(segment: Segment) -> _Span:
    if segment.kind != ASSISTANT:
        return _Span(segment.token_ids, (0.0,) * len(segment.token_ids), trained=False)
    if segment.logprobs is None:
        raise ValueError(f"assistant segment {segment.rollout_id}#{segment.seq} has no logprobs")
    return _Span(segment.token_ids, segment.logprobs, True, segment.call_start, segment.tool_code)


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


def render(segments: Sequence[Segment], view: View, decode: Decode | None = None) -> Rendered:
    """Render the segments of ONE rollout under `view` (sorted by seq here)."""
    if not segments:
        raise ValueError("render needs at least one segment")
    ordered = sorted(segments, key=lambda segment: segment.seq)
    if len({segment.rollout_id for segment in ordered}) > 1:
        raise ValueError("render takes the segments of one rollout; got several rollout_ids")
    if view.purified and view.similarity_on == "call" and decode is None:
        raise ValueError("similarity_on='call' needs a decode function (token ids -> text)")
    prompt = [segment for segment in ordered if segment.kind == PROMPT]
    body = [segment for segment in ordered if segment.kind != PROMPT]
    if ordered[: len(prompt)] != prompt:
        raise ValueError(f"rollout {ordered[0].rollout_id}: prompt segments must come first")
    prompt_len = sum(len(segment.token_ids) for segment in prompt)
    raw_len = sum(len(segment.token_ids) for segment in ordered)
    spans = [_span(segment) for segment in prompt]
    n_shallow = n_deep = n_unrecovered = 0
    chains = _chains(body)
    for index, chain in enumerate(chains):
        if not view.purified:
            spans.extend(_span(segment) for segment in chain)
            continue
        result = _render_chain(chain, view, decode)
        spans.extend(result.spans)
        n_shallow, n_deep = n_shallow + result.n_shallow, n_deep + result.n_deep
        if result.unrecovered:  # the rest of the trajectory is raw
            n_unrecovered += 1
            spans.extend(_span(segment) for later in chains[index + 1:] for segment in later)
            break
    length = sum(len(span.token_ids) for span in spans)
    stats = RenderStats(n_shallow, n_deep, n_unrecovered, raw_len - length)
    return _assemble(spans, prompt_len, stats)


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
    unrecovered: bool  # no successful call: the rest of the trajectory renders raw


def _attempts(chain: Sequence[Segment]) -> list[tuple[Segment, Segment | None]]:
    """Pair each assistant attempt with the tool segment answering it; check the chain's shape."""
    pairs: list[tuple[Segment, Segment | None]] = []
    for segment in chain:
        where = f"rollout {segment.rollout_id} seq {segment.seq}"
        if segment.kind == ASSISTANT:
            if pairs and pairs[-1][1] is None:
                raise ValueError(f"{where}: attempt follows an attempt with no tool response")
            if pairs and not pairs[-1][1].failed:
                raise ValueError(f"{where}: attempt follows a successful call at the same step")
            if segment.step is not None and segment.attempt != len(pairs):
                raise ValueError(f"{where}: expected attempt {len(pairs)}, got {segment.attempt}")
            pairs.append((segment, None))
        elif segment.kind == TOOL:
            if not pairs or pairs[-1][1] is not None:
                raise ValueError(f"{where}: tool segment without the call it answers")
            pairs[-1] = (pairs[-1][0], segment)
    return pairs


def _render_chain(chain: Sequence[Segment], view: View, decode: Decode | None) -> _ChainResult:
    pairs = _attempts(chain)
    if len(pairs) == 1 and (pairs[0][1] is None or not pairs[0][1].failed):
        return _ChainResult(tuple(_span(segment) for segment in chain), 0, 0, False)  # unchanged
    for i, (assistant, tool) in enumerate(pairs):
        if i > 0 and not assistant.has_call:  # the retry answered instead of calling
            merged = _merge([a for a, _ in pairs[:i]], view, decode)
            rest = chain[chain.index(assistant):]  # a_i and anything after it, raw
            spans = (merged.turn, _span(pairs[i - 1][1]), *(_span(segment) for segment in rest))
            return _ChainResult(spans, merged.n_shallow, merged.n_deep, True)
        if tool is not None and not tool.failed:  # first success at attempt i
            merged = _merge([a for a, _ in pairs[: i + 1]], view, decode)
            return _ChainResult((merged.turn, _span(tool)), merged.n_shallow, merged.n_deep, False)
    # No success: exhausted, or in progress during collection; both render the same tokens.
    merged = _merge([a for a, _ in pairs], view, decode)
    last_tool = pairs[-1][1]
    spans = (merged.turn,) if last_tool is None else (merged.turn, _span(last_tool))
    return _ChainResult(spans, merged.n_shallow, merged.n_deep, True)


# ----------------------------------------------------------------------------------------------
# SAAR merge


@dataclass(frozen=True)
class _Merged:
    turn: _Span
    n_shallow: int
    n_deep: int


def _merge(attempts: Sequence[Segment], view: View, decode: Decode | None) -> _Merged:
    """cur = a_0; for each later a_i: shallow (prefix(cur) + call(a_i)) if similar enough, else deep."""
    current = _span(attempts[0])
    n_shallow = n_deep = 0
    for attempt in attempts[1:]:
        following = _span(attempt)
        both_call = current.call_start is not None and following.call_start is not None
        if both_call and _similarity(current, following, view.similarity_on, decode) >= view.gamma:
            cut, start = current.call_start, following.call_start
            current = _Span(
                current.token_ids[:cut] + following.token_ids[start:],
                current.logprobs[:cut] + following.logprobs[start:],
                True,
                call_start=cut,
                code=following.code,
            )
            n_shallow += 1
        else:
            current = following
            n_deep += 1
    return _Merged(current, n_shallow, n_deep)


def _similarity(earlier: _Span, later: _Span, similarity_on: str, decode: Decode | None) -> float:
    """difflib ratio of the two calls' code (`code`) or decoded call tokens (`call`)."""
    if similarity_on == "code" and earlier.code is not None and later.code is not None:
        return difflib.SequenceMatcher(None, earlier.code, later.code).ratio()
    if decode is None:
        raise ValueError("comparing calls by their tokens (similarity_on='call', or a call whose "
                         "code did not parse) needs a decode function")
    earlier_text = decode(earlier.token_ids[earlier.call_start:])
    later_text = decode(later.token_ids[later.call_start:])
    return difflib.SequenceMatcher(None, earlier_text, later_text).ratio()
