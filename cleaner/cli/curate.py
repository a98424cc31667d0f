"""`cleaner curate`: pass statistics from a warehouse, and a dataset filtered by pass rate as the paper
filters its own (docs/curate.md).
"""

from __future__ import annotations

from typing import Annotated

import typer

from cleaner.cli.common import (
    DEFAULT_WAREHOUSE,
    WarehouseOpt,
    app,
    call_job,
    console,
    integers,
    words,
)
from cleaner.cli.options import Flags, config_flags


@app.command()
@config_flags("curate")
def curate(
    *,
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[str | None, typer.Option("--iteration", help="Collected iterations whose rollouts give the statistics, pooled per prompt: N or N,M,...")] = None,
    evaluation: Annotated[str | None, typer.Option("--eval", help="Evaluations (eval_runs.eval_id) whose rollouts give statistics too, pooled: ID or ID,ID,...")] = None,
    flags: Flags,
) -> None:
    """Which prompts to train on: pass statistics per prompt, and a dataset filtered by pass rate.

    From a warehouse: `-w W --iteration N[,M] --stats-out FILE` writes each prompt's successes and
    attempts in the paper's JSON Lines format. With `--data DATASET --success-rate-ratios SPEC --out
    FILE` (and statistics from `--stats FILE` or the warehouse), it keeps floor(count x ratio) prompts
    per success rate, code and the rest apart, drawn as the paper's filter draws them, and prints the
    counts before and after. The warehouse is read, never written.
    """
    from cleaner.config import CurateConfig
    from cleaner.engine.curate.job import curate_job
    from cleaner.warehouse import Warehouse

    config = flags.build(CurateConfig, {"iterations": "--iteration", "evals": "--eval"},
                         iterations=() if iteration is None else tuple(integers(iteration, "--iteration")),
                         evals=() if evaluation is None else tuple(words(evaluation, "--eval")))
    outcome = call_job(curate_job, Warehouse(warehouse), config)
    if outcome.stats_page is not None:
        console.print(outcome.stats_page, soft_wrap=True, highlight=False, markup=False)
    if outcome.page is not None:
        console.print(outcome.page, soft_wrap=True, highlight=False, markup=False)
    console.print(f"done in {outcome.seconds:.1f} s", highlight=False)
