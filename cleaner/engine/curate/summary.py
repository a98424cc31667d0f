"""What `cleaner curate` prints and writes beside its output: the counts before and after per success
rate (code / non-code), per data source and per category, as the paper's filter prints them, with
the ratios and seeds applied (docs/architecture.md §16).

The same facts go out twice: a Markdown page (printed, and `<out>.curate.md`) and JSON
(`<out>.curate.json`), which also records the output's sha256 so a later `--overwrite` replaces only
a dataset curate wrote.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from cleaner.engine.curate.filtering import Count, Level, Selection, by_category, by_source
from cleaner.engine.curate.stats import PromptStats

TITLE = "# cleaner curate"  # the first line of every summary page
WRITTEN_BY = "cleaner curate"


@dataclass(frozen=True)
class CurationFacts:
    """Everything a summary states besides the selection."""

    data: str  # the dataset filtered
    rows: int  # its rows
    source: str  # where the statistics came from: a file, or a warehouse's iterations and evaluations
    statistics: int  # prompts with statistics
    unused: int  # statistics no dataset row holds
    ratios: str | None  # the spec as given (None: every rate whole)
    retain_code: bool
    seed: int
    out: str  # the dataset written


def rate_label(rate: Fraction) -> str:
    """0.125 (1/8); 0 and 1 bare."""
    return f"{float(rate):.3f}" + (f" ({rate.numerator}/{rate.denominator})" if 0 < rate < 1 else "")


def _percent(part: int, whole: int) -> str:
    return f"{part / whole * 100:.1f}%" if whole else "N/A"


def _seed(seed: int | None) -> str:
    return "-" if seed is None else str(seed)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def level_rows(levels: Sequence[Level]) -> list[list[object]]:
    rows = []
    for level in levels:
        code, other = level.code, level.other
        rows.append([rate_label(level.rate), level.prompts, code.pool, other.pool, level.kept,
                     f"{code.kept} ({code.ratio * 100:.1f}%)", f"{other.kept} ({other.ratio * 100:.1f}%)",
                     _seed(code.seed), _seed(other.seed)])
    return rows


def page(facts: CurationFacts, selection: Selection) -> str:
    """The Markdown summary."""
    matched = sum(item is not None for item in selection.matched)
    kept = len(selection.kept_rows)
    lines = [TITLE, "",
             f"- dataset: `{facts.data}`, {facts.rows:,} rows",
             f"- statistics: {facts.source}, {facts.statistics:,} prompts",
             f"- rows with statistics: {matched:,}; without (dropped, as the paper's filter drops them): "
             f"{facts.rows - matched:,}; statistics of no row of the dataset: {facts.unused:,}",
             f"- success-rate ratios: {facts.ratios or 'none (every rate whole)'}; retain code: "
             f"{'yes' if facts.retain_code else 'no'}; seed {facts.seed} (code: seed + int(1000 rate), "
             "the rest: seed + 1 + int(1000 rate))",
             f"- kept: {kept:,} of {matched:,} rows ({_percent(kept, matched)}), in the dataset's order -> "
             f"`{facts.out}`", "", "## Per success rate", ""]
    lines += _table(("success rate", "prompts", "code", "other", "kept", "kept code (ratio)", "kept other (ratio)",
                     "code seed", "other seed"), level_rows(selection.levels))
    sources = by_source(selection)
    lines += ["", "## Per data source", ""]
    lines += _table(("data source", "before", "after", "kept"), [*[[c.name, c.before, c.after, _percent(c.after, c.before)]
                                                                  for c in sources], _total(sources)])
    categories = by_category(selection)
    before, after = sum(c.before for c in categories), sum(c.after for c in categories)
    lines += ["", "## Per category", ""]
    lines += _table(("category", "before", "share", "after", "share", "kept"),
                    [[c.name, c.before, _percent(c.before, before), c.after, _percent(c.after, after),
                      _percent(c.after, c.before)] for c in categories]
                    + [["total", before, _percent(before, before), after, _percent(after, after),
                        _percent(after, before)]])
    return "\n".join(lines) + "\n"


def _total(counts: Sequence[Count]) -> list[object]:
    before, after = sum(c.before for c in counts), sum(c.after for c in counts)
    return ["total", before, after, _percent(after, before)]


def record(facts: CurationFacts, selection: Selection, sha256: str) -> str:
    """The JSON summary."""
    levels = [{"success_rate": float(level.rate), "fraction": f"{level.rate.numerator}/{level.rate.denominator}",
               "prompts": level.prompts, "kept": level.kept,
               "code": vars(level.code), "other": vars(level.other)} for level in selection.levels]
    matched = sum(item is not None for item in selection.matched)
    data = {"written_by": WRITTEN_BY, "out": facts.out, "out_sha256": sha256, "data": facts.data,
            "rows": facts.rows, "statistics_source": facts.source, "statistics": facts.statistics,
            "rows_with_statistics": matched, "rows_without_statistics": facts.rows - matched,
            "statistics_without_row": facts.unused, "kept": len(selection.kept_rows),
            "success_rate_ratios": facts.ratios, "retain_code": facts.retain_code, "seed": facts.seed,
            "levels": levels, "data_sources": [vars(count) for count in by_source(selection)],
            "categories": [vars(count) for count in by_category(selection)]}
    return json.dumps(data, indent=1) + "\n"


# ---------------------------------------------------------------------------------------------
# Statistics written from a warehouse


def stats_page(stats: Sequence[PromptStats], source: str, rollouts: int, faults: int, faulted_prompts: int,
               out: str) -> str:
    """What `--stats-out` prints: prompts, rollouts, infrastructure faults left out, prompts per rate."""
    rates = Counter(item.rate for item in stats)
    attempts = Counter(item.attempts for item in stats)
    shown = ", ".join(f"{count:,} x {n}" for n, count in sorted(attempts.items()))
    lines = [f"statistics of {len(stats):,} prompts from {source}: {rollouts:,} rollouts, {faults:,} ended by an "
             f"infrastructure fault left out (prompts with no other rollout, without statistics: {faulted_prompts:,}); "
             f"attempts per prompt: {shown or 'none'} -> {out}", ""]
    lines += _table(("success rate", "prompts"), [[rate_label(rate), count] for rate, count in sorted(rates.items())])
    return "\n".join(lines) + "\n"
