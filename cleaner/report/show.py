"""What `cleaner show` prints: one rollout raw and purified (query results: tables.py).

`cleaner show` is built here; the CLI only parses options. A *view* is a rendering of a trajectory
(raw or purified, docs/architecture.md §4); the raw panel and the purified panel show one each.
Design decisions:
- The purified panel is whatever `walk.explain` says the renderer does: the kept token ranges,
  each step's outcome and each merge's similarity come from the renderer's own walk, never from a
  re-implementation. The raw panel marks what that rendering drops (struck through and dim), so
  the two panels are two readings of one decision.
- Text of the purified sequence is decoded from the spliced token ids with the tokenizer of the
  policy that collected the iteration or ran the evaluation (its config's "model"), loaded with
  `local_files_only=True`: showing a rollout never downloads anything. Without a tokenizer the
  segment texts stand in, split at `<tool_call>` where a shallow merge cut a turn; the view says so.
- What is shown is read by inspection.py (`load_inspection`, `load_decoder`), read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cleaner.engine.model.chat import TOOL_CALL_OPEN
from cleaner.engine.saar.walk import (
    Decode,
    Edit,
    Outcome,
    RenderSettings,
    StepOutcome,
    explain,
    render,
)
from cleaner.records import (
    Rollout,
    Segment,
    SegmentKind,
    ToolStatus,
    enum_value,
)
from cleaner.report.inspection import ConfigOutcome, Decoder, Inspection, Panels
from cleaner.report.tables import cell, number, setting, signed, visible

STATUS_STYLE = {ToolStatus.OK: "green", ToolStatus.ERROR: "bold red", ToolStatus.TIMEOUT: "bold magenta",
                ToolStatus.FORMAT_ERROR: "bold yellow", ToolStatus.INFRA_ERROR: "bold blue"}
KIND_STYLE = {SegmentKind.PROMPT: "dim", SegmentKind.ASSISTANT: "cyan", SegmentKind.TOOL: "white"}


def _segment_label(segment: Segment) -> Text:
    if segment.kind == SegmentKind.PROMPT:
        return Text("prompt", style=KIND_STYLE[SegmentKind.PROMPT])
    label = Text(f"{segment.kind:<9} step {segment.step} attempt {segment.attempt}",
                 style=KIND_STYLE[segment.kind])
    if segment.tool_name is not None:
        label.append(f"  {segment.tool_name}", style="bold")
    if segment.kind == SegmentKind.TOOL:
        status = segment.tool_status or "?"
        label.append(f"  {status}", style=STATUS_STYLE.get(status, "bold"))
        if segment.error_type:
            label.append(f" {segment.error_type}", style=STATUS_STYLE.get(status, "bold"))
    elif segment.attempt:
        label.append("  retry", style="bold yellow")
    return label


def _header(rollout: Rollout) -> Text:
    verdict = Text("correct" if rollout.correct else "wrong", style="green" if rollout.correct else "red")
    return Text.assemble(
        (f"{rollout.rollout_id}", "bold"), f"  group {rollout.group_id}  reward {rollout.reward:g}  ",
        verdict, f"  finish {rollout.finish_reason}  answer {rollout.answer!r}  "
        f"calls {rollout.n_tool_calls} failed {rollout.n_failed_calls}  view {rollout.collect_view}  "
        f"rollback_draw {rollout.rollback_draw:.3f}",
    )


def _clip(text: str, max_chars: int) -> str:
    """Model text as printed: at most `max_chars` of it, its control characters escaped."""
    return visible(text if len(text) <= max_chars else text[:max_chars] + " …")


def raw_panel(
    rollout: Rollout | None,
    segments: Sequence[Segment],
    max_chars: int = 400,
    steps: Sequence[StepOutcome] = (),
    decode: Decode | None = None,
) -> Group:
    """Segments in order, each a panel coloured by kind and tool outcome.

    With `steps` (from `render.explain`), what that rendering drops is struck through and dimmed:
    whole segments are titled `removed`; in segments it cuts (shallow merges), titled `partly
    removed`, the dropped text is also bracketed [-like this-]. Under edit mask nothing is dropped;
    what is kept but not trained is titled `masked` and bracketed [~like this~].
    """
    panels: list = [] if rollout is None else [_header(rollout)]
    kept_by_seq = kept_ranges(steps)
    masked_by_seq: dict[int, list[tuple[int, int]]] = {}
    for step in steps:
        for piece in step.masked:
            masked_by_seq.setdefault(piece.seq, []).append((piece.start, piece.end))
    for segment in sorted(segments, key=lambda s: s.seq):
        border = KIND_STYLE[segment.kind]
        if segment.kind == SegmentKind.TOOL:
            border = STATUS_STYLE.get(segment.tool_status or "", "white")
        title = _segment_label(segment)
        title.append(f"  #{segment.seq} ({len(segment.token_ids)} tok)", style="dim")
        kept = kept_by_seq.get(segment.seq)
        body = Text(_clip(segment.text, max_chars))
        if kept == []:
            title.append("  removed", style="bold red")
            body.stylize("strike dim")
            border = "dim"
        elif kept is not None and kept != [(0, len(segment.token_ids))]:
            ranges = ", ".join(f"{start}:{end}" for start, end in kept)
            title.append(f"  partly removed (keeps tokens {ranges})", style="bold yellow")
            body = Text.assemble(*(  # [- -] marks the drop where the terminal shows no style
                (_clip(text, max_chars), "") if inside else (f"[-{_clip(text, max_chars)}-]", "strike dim")
                for text, inside in kept_pieces(segment, kept, decode)
            ))
        if segment.seq in masked_by_seq:
            title, body = _masked_segment(segment, masked_by_seq[segment.seq], title, decode, max_chars)
        panels.append(Panel(body, title=title, title_align="left", border_style=border))
    return Group(*panels)


def _masked_segment(segment: Segment, masked: Sequence[tuple[int, int]], title: Text, decode: Decode | None,
                    max_chars: int) -> tuple[Text, Text]:
    """Title and body of a segment edit mask keeps but does not (wholly) train."""
    if masked == [(0, len(segment.token_ids))]:
        title.append("  masked (not trained)", style="bold magenta")
    else:
        ranges = ", ".join(f"{start}:{end}" for start, end in masked)
        title.append(f"  partly masked (tokens {ranges} not trained)", style="bold magenta")
    return title, _marked(segment, masked, decode, max_chars)


def _marked(segment: Segment, masked: Sequence[tuple[int, int]], decode: Decode | None, max_chars: int) -> Text:
    """The segment's text with the masked ranges bracketed [~like this~] and dimmed."""
    return Text.assemble(*(
        (f"[~{_clip(text, max_chars)}~]", "dim italic") if inside else (_clip(text, max_chars), "")
        for text, inside in kept_pieces(segment, masked, decode)))


# ----------------------------------------------------------------------------------------------
# Token ranges as text


def token_text(segment: Segment, start: int, end: int, decode: Decode | None) -> str:
    """Text of tokens [start, end): decoded, or else cut from the segment text at `<tool_call>`
    (a range that is neither the whole segment nor one side of the call is named, not shown)."""
    if decode is not None:
        return decode(segment.token_ids[start:end])
    if (start, end) == (0, len(segment.token_ids)):
        return segment.text
    marker = segment.text.find(TOOL_CALL_OPEN)
    if segment.call_start is not None and marker >= 0:
        if (start, end) == (0, segment.call_start):
            return segment.text[:marker]
        if (start, end) == (segment.call_start, len(segment.token_ids)):
            return segment.text[marker:]
    return f"<tokens {start}:{end} of #{segment.seq}>"


def kept_ranges(steps: Sequence[StepOutcome]) -> dict[int, list[tuple[int, int]]]:
    """Per seq of a merged step, the token ranges its rendering keeps (empty: the segment is dropped
    whole); a seq no step touches is absent (kept whole)."""
    kept_by_seq: dict[int, list[tuple[int, int]]] = {}
    for step in steps:
        for seq in step.seqs:
            kept_by_seq.setdefault(seq, [])
        for piece in step.kept:
            kept_by_seq[piece.seq].append((piece.start, piece.end))
    return kept_by_seq


def kept_pieces(segment: Segment, kept: Sequence[tuple[int, int]], decode: Decode | None) -> list[tuple[str, bool]]:
    """The segment cut at the kept ranges' edges: (text, kept?) in token order."""
    bounds = sorted({0, len(segment.token_ids), *(edge for span in kept for edge in span)})
    return [
        (token_text(segment, low, high, decode), any(a <= low and high <= b for a, b in kept))
        for low, high in pairwise(bounds)
    ]


@dataclass(frozen=True)
class StepText:
    """The text one step contributes to the purified sequence (step None: the prompt)."""

    step: StepOutcome | None
    text: str


def purified_texts(segments: Sequence[Segment], steps: Sequence[StepOutcome], decode: Decode | None) -> list[StepText]:
    """The purified sequence as text, step by step: each step's spliced token ids decoded at once."""
    by_seq = {segment.seq: segment for segment in segments}
    prompt = [segment for segment in sorted(segments, key=lambda s: s.seq) if segment.kind == SegmentKind.PROMPT]
    texts = [StepText(None, "".join(token_text(s, 0, len(s.token_ids), decode) for s in prompt))]
    for step in steps:
        if decode is not None:
            ids = [i for piece in step.kept for i in by_seq[piece.seq].token_ids[piece.start:piece.end]]
            texts.append(StepText(step, decode(ids)))
        else:
            texts.append(StepText(step, "".join(
                token_text(by_seq[piece.seq], piece.start, piece.end, None) for piece in step.kept)))
    return texts


# ----------------------------------------------------------------------------------------------
# The purified view


OUTCOME_STYLE = {Outcome.CLEAN: "green", Outcome.SHALLOW: "bold cyan", Outcome.DEEP: "bold magenta",
                 Outcome.MIXED: "bold blue", Outcome.UNRECOVERED: "bold red",
                 Outcome.ANSWERED: "bold yellow", Outcome.RAW: "dim"}


def step_label(step: StepOutcome) -> str:
    """One line: step, outcome, each merge with its similarity, what was removed."""
    parts = [f"step {step.step}", step.outcome + (" (after an unrecovered step)" if step.outcome == Outcome.RAW else ""),
             f"{step.attempts} attempt{'s' if step.attempts != 1 else ''}"]
    for merge in step.merges:
        similarity = "no call" if merge.similarity is None else f"sim {merge.similarity:.2f}"
        parts.append(f"a{merge.attempt} {merge.kind} ({similarity})")
    if step.tokens_removed:
        removed = " ".join(f"#{seq}" for seq in step.removed_seqs) or "none whole"
        parts.append(f"removed {removed}, {step.tokens_removed} tok")
    if step.masked:
        parts.append(f"masked {sum(piece.end - piece.start for piece in step.masked)} tok")
    return " · ".join(parts)


def purified_panel(
    segments: Sequence[Segment], view: RenderSettings, decode: Decode | None, note: str, max_chars: int = 2000
) -> Panel:
    """The purified token sequence as text, each step headed by its outcome, then the row's stats."""
    try:
        steps = explain(segments, view, decode)
        stats = render(segments, view, decode).stats
    except ValueError as exc:  # e.g. similarity on call tokens without a tokenizer
        return Panel(Text(f"cannot render the purified view: {exc}\n{note}", style="red"),
                     title="purified view", title_align="left", border_style="red")
    body = Text()
    by_seq = {segment.seq: segment for segment in segments}
    for piece in purified_texts(segments, steps, decode):
        if piece.step is None:
            body.append(_clip(piece.text, max_chars), style="dim")
            continue
        body.append(f"\n── {step_label(piece.step)} ──\n", style=OUTCOME_STYLE[piece.step.outcome])
        if piece.step.masked:  # edit mask: the raw tokens, the untrained ones bracketed
            for seq in piece.step.seqs:
                ranges = [(m.start, m.end) for m in piece.step.masked if m.seq == seq]
                body.append(_marked(by_seq[seq], ranges, decode, max_chars) if ranges
                            else Text(_clip(token_text(by_seq[seq], 0, len(by_seq[seq].token_ids), decode), max_chars)))
        else:
            body.append(_clip(piece.text, max_chars))
    removed = f"tokens masked {stats.tokens_masked}" if view.edit == Edit.MASK else f"tokens removed {stats.tokens_removed}"
    body.append(f"\n\n{removed} · shallow {stats.n_shallow} · deep {stats.n_deep}"
                f" · unrecovered {stats.n_unrecovered}\n", style="bold")
    body.append(note, style="dim italic")
    name = "masked view" if view.edit == Edit.MASK else "purified view"
    title = f"{name} (gamma {view.gamma:g}, similarity on {view.similarity_on})"
    return Panel(body, title=title, title_align="left", border_style="cyan")


# ----------------------------------------------------------------------------------------------
# Purified rows of this rollout in the warehouse


def config_table(configs: Sequence[ConfigOutcome], iteration: int) -> Table | Text:
    """The stored purify configs of the iteration and this rollout's advantage under each."""
    if not configs:
        return Text(f"no purified rows for this rollout in iteration {iteration} (run `cleaner purify`)",
                    style="dim")
    negatives = any(c.n_negatives for c in configs)  # a column only where --negative-samples made some
    table = Table(title=f"purified rows of this rollout (iteration {iteration})", header_style="bold")
    for name in ("config_id", "gamma", "p", "similarity_on", "purify_when", "edit", "rolled_back", "shallow",
                 "deep", "unrecovered", "tokens_removed", "reward", "advantage") + (("negative_samples",) if negatives else ()):
        table.add_column(name, justify="left" if name in ("config_id", "similarity_on", "purify_when", "edit") else "right")
    for c in configs:
        table.add_row(c.config_id, setting(c.gamma), setting(c.rollback_prob), cell(c.similarity_on),
                      cell(c.purify_when), cell(c.edit), setting(c.rolled_back), setting(c.n_shallow),
                      setting(c.n_deep), setting(c.n_unrecovered), setting(c.tokens_removed), number(c.reward),
                      signed(c.advantage), *((setting(c.n_negatives),) if negatives else ()))
    return table


# ----------------------------------------------------------------------------------------------
# The whole `cleaner show` output


def show_rollout(inspection: Inspection, view: RenderSettings, decoder: Decoder, which: Panels = Panels.BOTH) -> Group:
    """The whole `cleaner show` output: raw segments (drops marked), purified view, stored configs."""
    which = enum_value(Panels, which, "view")
    segments = inspection.segments
    parts: list = []
    if which in (Panels.RAW, Panels.BOTH):
        try:
            steps = explain(segments, view, decoder.decode) if which == Panels.BOTH else ()
        except ValueError:
            steps = ()  # the purified panel below says why
        parts.append(raw_panel(inspection.rollout, segments, steps=steps, decode=decoder.decode))
    elif inspection.rollout is not None:
        parts.append(_header(inspection.rollout))
    if which in (Panels.PURIFIED, Panels.BOTH):
        parts.append(purified_panel(segments, view, decoder.decode, decoder.note))
        if inspection.eval_id is None:
            parts.append(config_table(inspection.configs, inspection.iteration))
        else:
            parts.append(Text(f"a rollout of evaluation {inspection.eval_id} (`cleaner sql \"FROM eval_runs "
                              f"WHERE eval_id = '{inspection.eval_id}'\"`)", style="dim"))
    return Group(*parts)
