"""`cleaner warehouse`: what the readers' gate finds in a warehouse, and settling the parts it did
not write (docs/warehouse.md#what-every-reader-checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import DEFAULT_WAREHOUSE, WarehouseOpt, app, call_job, console, fail

PartsOpt = Annotated[list[Path] | None, typer.Option(
    help="A part file (<warehouse>/<dataset>/<partition>/part-*.parquet); repeatable.", show_default=False)]


@app.command("warehouse")
def warehouse_command(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    adopt: PartsOpt = None,
    remove: PartsOpt = None,
) -> None:
    """Say what every reader would refuse, one line each: parts the warehouse did not write,
    iterations being collected or incomplete, rollouts stored twice or without their segments,
    configs holding two rows for one rollout. Exits 1 if there is any.

    --adopt makes the rows of a part the warehouse did not write its own (rewritten as its part,
    with a collection part's segments twin); the readers then check them as any rows, so a rollout
    it holds already is then stored twice. --remove deletes such a part (and its twin, if the
    warehouse did not write that either); a part the warehouse wrote is refused, never deleted.
    """
    from cleaner.warehouse import Warehouse
    from cleaner.warehouse.foreign import adopt as adopt_part
    from cleaner.warehouse.foreign import remove as remove_part
    from cleaner.warehouse.gate import every_finding

    for part in adopt or []:
        settled = call_job(adopt_part, warehouse, part)
        console.print(f"adopted {part}: its rows are in {', '.join(map(str, settled.written)) or 'no part (it held none)'}",
                      soft_wrap=True, highlight=False, markup=False)
    for part in remove or []:
        settled = call_job(remove_part, warehouse, part)
        console.print(f"removed {', '.join(map(str, settled.files))}", soft_wrap=True, highlight=False, markup=False)
    store = Warehouse(warehouse, read_only=True)
    findings = call_job(every_finding, store)
    for line in findings:
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    if findings:
        raise fail(f"{warehouse}: {len(findings)} finding(s) above; every reader refuses what they name")
    console.print(f"{warehouse}: {len(store.iterations_collected())} collected iteration(s), each whole and not being "
                  "written, every rollout once with its segments, every part the warehouse's own",
                  soft_wrap=True, highlight=False, markup=False)
