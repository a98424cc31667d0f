"""`cleaner export`: collected iterations as a Hugging Face dataset folder (docs/export.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import (
    DEFAULT_WAREHOUSE,
    WarehouseOpt,
    app,
    build_config,
    call_job,
    console,
    integers,
)


@app.command()
def export(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[str, typer.Option("--iteration", help="Collected iterations to export: N or N,M,...")] = ...,
    form: Annotated[str, typer.Option("--format", help="sft (TRL conversations) | preference (prompt, chosen, rejected) | messages (OpenAI-style chat JSONL).")] = ...,
    out: Annotated[Path, typer.Option("--out", help="The dataset folder to write (data/ shards and a README.md card).")] = ...,
    where: Annotated[str | None, typer.Option("--where", help="SQL condition over the rollouts view, e.g. \"correct and n_failed_calls = 0\".")] = None,
    view: Annotated[str, typer.Option("--view", help="raw (the stored rollout) | purified (SAAR's rendering, as purify stored it).")] = "raw",
    pairs: Annotated[str, typer.Option("--pairs", help="preference: chain (a failed call against SAAR's fix) | outcome (a correct against an incorrect rollout of a group).")] = "chain",
    config_id: Annotated[str | None, typer.Option("--config-id", help="Purify config: its rows (--view purified) and SAAR settings (chain pairs); default: the iterations' only one.")] = None,
    policy: Annotated[Path | None, typer.Option("--policy", help="Tokenizer and chat template to render with (default: the policy that collected each iteration).")] = None,
    rows_per_shard: Annotated[int, typer.Option("--rows-per-shard", help="Rows of each shard under data/.")] = 10_000,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a dataset cleaner exported at --out.")] = False,
) -> None:
    """Export trajectories for other trainers: SFT conversations, preference pairs from SAAR's
    failure-correction chains, or chat JSONL, as a folder `datasets.load_dataset` reads.

    Reads the warehouse, never writes it; nothing is uploaded.
    """
    from cleaner.engine.export.job import ExportRequest, export_job
    from cleaner.warehouse import Warehouse

    iterations = tuple(dict.fromkeys(integers(iteration, "--iteration")))  # a repeated number reads once
    request = build_config(ExportRequest, {"form": "--format", "iterations": "--iteration"}, iterations=iterations,
                           form=form, out=out, view=view, where=where, pairs=pairs, config_id=config_id,
                           policy=policy, rows_per_shard=rows_per_shard, overwrite=overwrite)
    outcome = call_job(export_job, Warehouse(warehouse), request)
    exact = "" if outcome.exact is None else f"; {outcome.exact:,} rendered exactly by the chat template"
    counted = "" if outcome.counted is None else f"; the warehouse's SQL counts {outcome.counted:,} pairs"
    console.print(f"{outcome.rows:,} rows from {outcome.rollouts:,} rollouts in {outcome.shards} shard(s)"
                  f"{exact}{counted} ({outcome.seconds:.1f} s)\ndataset -> {outcome.out}", soft_wrap=True,
                  highlight=False)
