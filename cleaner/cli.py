"""The `cleaner` command line: parse options -> build a config -> call one engine function.

Kept thin on purpose: every command's work lives in `cleaner.engine` or `cleaner.warehouse`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

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
    err_console.print(f"[bold red]error:[/] {message}")
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


@app.command()
def sql() -> None:
    """Run DuckDB SQL over the warehouse views."""
    raise not_built("sql")


@app.command()
def show() -> None:
    """Print one rollout's segments in order, coloured by outcome."""
    raise not_built("show")


if __name__ == "__main__":
    app()
