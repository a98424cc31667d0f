"""Human-readable views of warehouse contents: query results and one rollout's segments.

Presentation only: callers pass records or Arrow tables, this module returns rich renderables.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from cleaner.engine.records import ASSISTANT, OK, PROMPT, TOOL, Rollout, Segment

MAX_CELL_CHARS = 80

STATUS_STYLE = {OK: "green", "error": "bold red", "timeout": "bold magenta", "format_error": "bold yellow",
                "infra_error": "bold blue"}
KIND_STYLE = {PROMPT: "dim", ASSISTANT: "cyan", TOOL: "white"}


def _cell(value: object) -> str:
    if isinstance(value, list | tuple):
        inner = ", ".join(str(v) for v in value[:8])
        text = f"[{inner}{', ...' if len(value) > 8 else ''}] ({len(value)})"
    else:
        text = "" if value is None else str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 1] + "…"


def result_table(table: pa.Table, title: str | None = None) -> Table:
    """A rich table of a query result; long cells and token lists are abbreviated."""
    out = Table(title=title, show_lines=False, header_style="bold")
    for name in table.column_names:
        out.add_column(name, overflow="fold")
    for row in table.to_pylist():
        out.add_row(*(_cell(row[name]) for name in table.column_names))
    out.caption = f"{table.num_rows} row{'s' if table.num_rows != 1 else ''}"
    return out


def _segment_label(segment: Segment) -> Text:
    if segment.kind == PROMPT:
        return Text("prompt", style=KIND_STYLE[PROMPT])
    label = Text(f"{segment.kind:<9} step {segment.step} attempt {segment.attempt}",
                 style=KIND_STYLE[segment.kind])
    if segment.kind == TOOL:
        status = segment.tool_status or "?"
        label.append(f"  {status}", style=STATUS_STYLE.get(status, "bold"))
        if segment.error_type:
            label.append(f" {segment.error_type}", style=STATUS_STYLE.get(status, "bold"))
    elif segment.attempt:
        label.append("  retry", style="bold yellow")
    return label


def rollout_view(rollout: Rollout | None, segments: Sequence[Segment], max_chars: int = 400) -> Group:
    """Segments in order, each a panel coloured by kind and tool outcome."""
    panels = []
    if rollout is not None:
        verdict = Text("correct" if rollout.correct else "wrong", style="green" if rollout.correct else "red")
        header = Text.assemble(
            (f"{rollout.rollout_id}", "bold"), f"  group {rollout.group_id}  reward {rollout.reward:g}  ",
            verdict, f"  finish {rollout.finish_reason}  answer {rollout.answer!r}  "
            f"calls {rollout.n_tool_calls} failed {rollout.n_failed_calls}  view {rollout.collect_view}",
        )
        panels.append(header)
    for segment in sorted(segments, key=lambda s: s.seq):
        text = segment.text if len(segment.text) <= max_chars else segment.text[:max_chars] + " …"
        border = KIND_STYLE[segment.kind]
        if segment.kind == TOOL:
            border = STATUS_STYLE.get(segment.tool_status or "", "white")
        title = _segment_label(segment)
        title.append(f"  #{segment.seq} ({len(segment.token_ids)} tok)", style="dim")
        panels.append(Panel(Text(text), title=title, title_align="left", border_style=border))
    return Group(*panels)
