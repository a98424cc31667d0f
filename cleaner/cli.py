"""The `cleaner` command line: parse options -> build a config -> call one engine function.

Kept thin on purpose: every command's work lives in `cleaner.engine` or `cleaner.warehouse`.
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

app = typer.Typer(
    name="cleaner",
    help="CLEANER: collect tool-using rollouts, purify them with SAAR, train with GRPO/DAPO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
sandbox_app = typer.Typer(help="Run code through the Python tool's sandbox.", no_args_is_help=True)
app.add_typer(sandbox_app, name="sandbox")

console = Console()
err_console = Console(stderr=True)

WarehouseOpt = Annotated[
    Path, typer.Option("--warehouse", "-w", help="Warehouse directory.", envvar="CLEANER_WAREHOUSE")
]
DEFAULT_WAREHOUSE = Path("warehouse")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print an error to stderr and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
    return typer.Exit(code)


def not_built(command: str) -> typer.Exit:
    return fail(f"`cleaner {command}` is not built yet in this version.", code=2)


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False):
    """CLEANER: self-purified trajectories for agentic RL (arXiv 2601.15141)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# ---------------------------------------------------------------------------------------------
# Phase commands (filled in by their engine modules)


@app.command()
def collect() -> None:
    """Run multi-turn tool-using rollouts and store every attempt in the warehouse."""
    raise not_built("collect")


@app.command()
def purify() -> None:
    """Replay stored attempts with SAAR, rescore them and compute GRPO advantages."""
    raise not_built("purify")


@app.command()
def train() -> None:
    """Take a GRPO/DAPO step on a purified iteration and write a new checkpoint."""
    raise not_built("train")


@app.command()
def run() -> None:
    """Loop collect -> purify -> train for several iterations."""
    raise not_built("run")


@app.command()
def ablate() -> None:
    """Purify one iteration under a grid of (gamma, p) without generating anything."""
    raise not_built("ablate")


@app.command()
def bootstrap() -> None:
    """Train the tiny default policy into assets/tiny-policy."""
    raise not_built("bootstrap")


@app.command()
def demo() -> None:
    """Run the whole loop on the tiny default policy and the toy task."""
    raise not_built("demo")


@sandbox_app.command("run")
def sandbox_run() -> None:
    """Run one Python file through the sandbox and print the result."""
    raise not_built("sandbox run")


# ---------------------------------------------------------------------------------------------
# Warehouse commands


class OutputFormat(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="DuckDB SQL over the views: rollouts, segments, attempts, ...")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    output_format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file.")] = None,
) -> None:
    """Run DuckDB SQL over the warehouse views.

    Views: rollouts, segments, purified, purify_configs, iterations, train_steps, and the convenience
    views attempts (assistant segments with the outcome of their call) and failures.
    """
    import duckdb
    import polars as pl

    from cleaner.engine.inspect import result_table
    from cleaner.warehouse import Warehouse, WarehouseError

    try:
        connection = Warehouse(warehouse).connect()
        relation = connection.sql(query)  # None for statements that return nothing
        table = relation.to_arrow_table() if relation is not None else None
    except WarehouseError as exc:
        raise fail(str(exc)) from exc
    except duckdb.Error as exc:
        raise fail(f"query failed: {exc}") from exc
    if table is None:
        return
    if output_format is OutputFormat.table:
        target = Console(file=open(output, "w"), width=200) if output else console
        target.print(result_table(table))
        return
    frame = pl.from_arrow(table)
    text = frame.write_csv() if output_format is OutputFormat.csv else frame.write_json()
    if output:
        output.write_text(text)
    else:
        typer.echo(text, nl=False)


@app.command()
def show(
    rollout_id: Annotated[str, typer.Argument(help="The rollout to print.")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
) -> None:
    """Print one rollout's segments in order, coloured by outcome (failures red, retries yellow)."""
    from cleaner.engine.inspect import rollout_view
    from cleaner.warehouse import Warehouse, WarehouseError
    from cleaner.warehouse.schema import ROLLOUTS, SEGMENTS, from_table

    try:
        connection = Warehouse(warehouse).connect()
        rollouts = from_table(ROLLOUTS, connection.sql(
            "SELECT * FROM rollouts WHERE rollout_id = ?", params=[rollout_id]).to_arrow_table())
        segments = from_table(SEGMENTS, connection.sql(
            "SELECT * FROM segments WHERE rollout_id = ? ORDER BY seq", params=[rollout_id]).to_arrow_table())
    except WarehouseError as exc:
        raise fail(str(exc)) from exc
    if not segments:
        raise fail(f"no rollout {rollout_id!r} in {warehouse}")
    console.print(rollout_view(rollouts[0] if rollouts else None, segments))


if __name__ == "__main__":
    app()
