"""One rollout as the browser shows it: the raw attempts beside the row a purify config stored.

Design decisions:
- Nothing here re-implements SAAR: the merge decisions and the kept token ranges come from
  `render.explain` under the stored config's view, the text from `show.token_text`/`kept_pieces`,
  the loading from `show.load_inspection` (docs/architecture.md §4, §14).
- The purified pane shows the STORED row, what training saw: its tokens are matched against the
  renderings `explain` walks (the config's view, then the raw one), and each kept range is cut by the
  row's loss mask, so an assistant token the row does not train (mask 0, as `--edit mask` leaves
  the dropped attempts) shows as masked, apart from the trained ones. A row that matches neither
  rendering (an IS decision whose score was not stored) is shown from its own tokens, by mask
  runs, with a line saying so.
- The IS gate's old log-probs come from the stored row (`old_logprobs`): a merge whose tokens the
  row kept is scored from it; one it did not (a rejected or intermediate merge) shows its IS as
  not stored. Similarity, shallow/deep and the rejection itself are always shown.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.engine.saar.walk import (
    RAW,
    Decode,
    KeptTokens,
    MergeDecision,
    RenderSettings,
    StepOutcome,
    explain,
    render,
)
from cleaner.records import PurifiedRow, PurifyConfigRow, Segment, SegmentKind, ToolStatus
from cleaner.report.show import kept_pieces, kept_ranges, step_label, token_text

# ----------------------------------------------------------------------------------------------
# The raw pane


@dataclass(frozen=True)
class RawSegment:
    """One raw segment with what the selected rendering does to it."""

    segment: Segment
    state: str  # kept | removed | partly
    pieces: tuple[tuple[str, bool], ...]  # (text, kept?) in token order
    retries: int | None  # an attempt > 0: the seq of the failed tool response it retries
    fixed_by: int | None  # a failed tool response: the seq of the attempt whose call succeeded
    retried_by: int | None  # a failed tool response: the seq of the next attempt

    @property
    def failed(self) -> bool:
        return self.segment.kind == SegmentKind.TOOL and self.segment.tool_status != ToolStatus.OK


def raw_segments(segments: Sequence[Segment], steps: Sequence[StepOutcome], decode: Decode | None) -> list[RawSegment]:
    kept_by_seq = kept_ranges(steps)
    links = _retry_links(segments)
    out = []
    for segment in segments:
        kept = kept_by_seq.get(segment.seq)
        whole = [(0, len(segment.token_ids))]
        if kept is None or kept == whole:
            state, pieces = "kept", ((token_text(segment, 0, len(segment.token_ids), decode), True),)
        elif not kept:
            state, pieces = "removed", ((token_text(segment, 0, len(segment.token_ids), decode), False),)
        else:
            state, pieces = "partly", tuple(kept_pieces(segment, kept, decode))
        out.append(RawSegment(segment, state, pieces, *links.get(segment.seq, (None, None, None))))
    return out


def _retry_links(segments: Sequence[Segment]) -> dict[int, tuple[int | None, int | None, int | None]]:
    """seq -> (retries, fixed_by, retried_by): each retry to the failed response before it, each
    failed response to its next attempt and to the attempt that finally succeeded at its step."""
    tools: dict[tuple[int | None, int | None], Segment] = {}
    assistants: dict[tuple[int | None, int | None], Segment] = {}
    for segment in segments:
        if segment.kind == SegmentKind.TOOL:
            tools[(segment.step, segment.attempt)] = segment
        elif segment.kind == SegmentKind.ASSISTANT:
            assistants[(segment.step, segment.attempt)] = segment
    links: dict[int, tuple[int | None, int | None, int | None]] = {}
    for (step, attempt), assistant in assistants.items():
        failed = tools.get((step, (attempt or 0) - 1)) if attempt else None
        if failed is not None:
            links[assistant.seq] = (failed.seq, None, None)
    for (step, attempt), tool in tools.items():
        if tool.tool_status == ToolStatus.OK:
            continue
        later = [t for (s, a), t in tools.items() if s == step and (a or 0) > (attempt or 0)]
        fix = next((assistants[(step, t.attempt)].seq for t in sorted(later, key=lambda t: t.seq)
                    if t.tool_status == ToolStatus.OK and (step, t.attempt) in assistants), None)
        following = assistants.get((step, (attempt or 0) + 1))
        links[tool.seq] = (None, fix, None if following is None else following.seq)
    return links


# ----------------------------------------------------------------------------------------------
# The purified pane


@dataclass(frozen=True)
class StyledSpan:
    text: str
    css: str  # prompt | tool | trained | masked


@dataclass(frozen=True)
class PurifiedStep:
    label: str  # show.step_label: outcome, merges with their similarity, what was removed
    outcome: str
    merges: tuple[MergeDecision, ...]  # attempt, kind, similarity, log IS, rejected
    pieces: tuple[StyledSpan, ...]


@dataclass(frozen=True)
class PurifiedPane:
    row: PurifiedRow
    config: PurifyConfigRow | None
    view: RenderSettings
    steps: tuple[PurifiedStep, ...]  # steps[0] is the prompt (label "prompt")
    explained: tuple[StepOutcome, ...]  # render.explain's steps of `view` (for the raw pane's marks)
    trained_tokens: int  # loss_mask ones
    masked_tokens: int  # assistant tokens of the row with loss_mask 0
    note: str | None  # why the pane is shown from the row's own tokens, or what failed


class StoredLogprobs:
    """A LogprobOracle over one stored row: the old log-probs of tokens the row holds after the same
    context; None for anything else (docs/architecture.md §4)."""

    def __init__(self, row: PurifiedRow) -> None:
        self.token_ids, self.old_logprobs = row.token_ids, row.old_logprobs

    def logprob_sum(self, context: tuple[int, ...], tokens: tuple[int, ...]) -> float | None:
        end = len(context) + len(tokens)
        if self.token_ids[:end] != context + tokens:
            return None
        return math.fsum(self.old_logprobs[len(context):end])


def config_view(config: PurifyConfigRow | None, row: PurifiedRow) -> RenderSettings:
    """The view the row was rendered under: the config's SAAR if the row was rolled back, else raw."""
    if config is None or not row.rolled_back:
        return RAW
    params = _params(config)
    return RenderSettings(True, gamma=config.gamma, similarity_on=config.similarity_on,
                          rollback_is_threshold=float(params.get("rollback_is_threshold") or 0.0),
                          rollback_is_mode=params.get("rollback_is_mode") or "sum")


def _params(config: PurifyConfigRow) -> dict:
    try:
        params = json.loads(config.params_json)
    except json.JSONDecodeError:
        return {}
    return params if isinstance(params, dict) else {}


def purified_pane(segments: Sequence[Segment], row: PurifiedRow, config: PurifyConfigRow | None,
                  decode: Decode | None) -> PurifiedPane:
    """The stored row, step by step, with the decisions of the view it was rendered under."""
    oracle = StoredLogprobs(row)
    mask = row.loss_mask
    view = RAW
    try:
        view = config_view(config, row)
        steps = explain(segments, view, decode, oracle)
        rendered = render(segments, view, decode, oracle).token_ids
    except ValueError as error:  # similarity on call tokens without a tokenizer; a foreign config
        return _unmatched(segments, row, config, view, decode, f"cannot re-render this row: {error}", ())
    by_seq = {segment.seq: segment for segment in segments}
    prompt = [s for s in segments if s.kind == SegmentKind.PROMPT]
    if rendered == row.token_ids:
        ranges = [[KeptTokens(s.seq, 0, len(s.token_ids)) for s in prompt]] + [list(step.kept) for step in steps]
    elif tuple(t for s in segments for t in s.token_ids) == row.token_ids:  # the raw tokens, masked
        ranges = [[KeptTokens(s.seq, 0, len(s.token_ids)) for s in prompt]] + [
            [KeptTokens(seq, 0, len(by_seq[seq].token_ids)) for seq in step.seqs] for step in steps]
    else:
        return _unmatched(segments, row, config, view, decode,
                          "the stored row is not a re-rendering of these segments (an IS decision whose "
                          "score the row does not hold): shown from its own tokens by loss-mask runs", steps)
    cursor, out, masked = 0, [], 0
    for index, pieces in enumerate(ranges):
        texts = []
        for piece in pieces:
            segment = by_seq[piece.seq]
            for start, end, value in _runs(mask, cursor, cursor + piece.end - piece.start):
                low = piece.start + start - cursor
                css = _css(segment.kind, value)
                masked += (end - start) if css == "masked" else 0
                texts.append(StyledSpan(token_text(segment, low, low + end - start, decode), css))
            cursor += piece.end - piece.start
        if index == 0:
            out.append(PurifiedStep("prompt", "prompt", (), tuple(texts)))
        else:
            step = steps[index - 1]
            out.append(PurifiedStep(step_label(step), str(step.outcome), step.merges, tuple(texts)))
    return PurifiedPane(row, config, view, tuple(out), tuple(steps), sum(mask), masked, None)


def _runs(mask: Sequence[int], start: int, end: int) -> list[tuple[int, int, int]]:
    """[start, end) cut into runs of equal mask value: (run start, run end, value)."""
    runs: list[tuple[int, int, int]] = []
    for position in range(start, end):
        if runs and runs[-1][2] == mask[position] and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1, runs[-1][2])
        else:
            runs.append((position, position + 1, mask[position]))
    return runs


def _css(kind: SegmentKind, mask_value: int) -> str:
    if kind == SegmentKind.ASSISTANT:
        return "trained" if mask_value else "masked"
    return "prompt" if kind == SegmentKind.PROMPT else "tool"


def _unmatched(segments: Sequence[Segment], row: PurifiedRow, config: PurifyConfigRow | None, view: RenderSettings,
               decode: Decode | None, note: str, steps: Sequence[StepOutcome]) -> PurifiedPane:
    """The row from its own tokens: runs of equal loss mask, decoded (or named without a tokenizer)."""
    pieces = []
    for start, end, value in _runs(row.loss_mask, 0, len(row.token_ids)):
        ids = row.token_ids[start:end]
        text = decode(ids) if decode is not None else f"<tokens {start}:{end} of the row>"
        pieces.append(StyledSpan(text, "trained" if value else ("prompt" if end <= row.prompt_len else "tool")))
    return PurifiedPane(row, config, view, (PurifiedStep("stored row", "raw", (), tuple(pieces)),),
                        tuple(steps), sum(row.loss_mask), 0, note)
