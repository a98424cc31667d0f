"""Comparison tables of purify configs (one row per config), built with polars."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
from rich.table import Table


def stats_frame(stats: Sequence, configs: Sequence | None = None) -> pl.DataFrame:
    """One row per PurifyStats, with its config's parameters when given."""
    rows = []
    for i, s in enumerate(stats):
        row = {"config_id": s.config_id}
        if configs is not None:
            c = configs[i]
            row.update(gamma=c.gamma, p=c.rollback_prob, similarity=c.similarity_on, when=c.purify_when)
        top = sorted(s.errors_by_type, key=lambda kv: -kv[1])[:3]
        row.update(
            rollouts=s.n_rollouts, rolled_back=s.n_rolled_back, shallow=s.n_shallow, deep=s.n_deep,
            unrecovered=s.n_unrecovered, tokens_removed=s.tokens_removed,
            errors=", ".join(f"{name} {count}" for name, count in top),
        )
        rows.append(row)
    return pl.DataFrame(rows)


def stats_table(stats: Sequence, configs: Sequence | None = None) -> Table:
    frame = stats_frame(stats, configs)
    table = Table(title="purify", header_style="bold")
    for name in frame.columns:
        table.add_column(name, justify="left" if name in ("config_id", "similarity", "when", "errors") else "right")
    for record in frame.iter_rows():
        table.add_row(*(f"{v:g}" if isinstance(v, float) else str(v) for v in record))
    return table
