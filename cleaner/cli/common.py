"""What every `cleaner` command shares: the typer app, consoles, option types, errors.

Kept thin on purpose: every command's work lives in a stage's job (`cleaner.engine.<stage>.job`),
`cleaner.loop`, `cleaner.report` or `cleaner.warehouse`; a command parses options, builds a config
and calls one job.
"""

from __future__ import annotations

import logging
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperCommand

from cleaner.config.flags import option_of
from cleaner.config.layers import name_fields


class HelpCommand(TyperCommand):
    """A command whose --help is click's plain layout, one section per `rich_help_panel`.

    typer's rich help is a table whose columns rich shrinks to the terminal: at 80 columns it cuts
    long option names (--rollback-is-threshold, --no-negative-samples) to "--rollback-is-thre…".
    click's layout never cuts a name (a long one gets its own line) and wraps help text to the
    terminal; the panels of `cleaner run` (Collect, Purify, Train, Logging) stay as sections."""

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            title = "Arguments" if param.param_type_name == "argument" else (
                getattr(param, "rich_help_panel", None) or "Options")
            sections.setdefault(title, []).append(record)
        for title, records in sorted(sections.items(), key=lambda item: item[0] != "Arguments"):
            with formatter.section(title):
                formatter.write_dl(records)


class CleanerTyper(typer.Typer):
    """typer.Typer whose commands are HelpCommands."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or HelpCommand, **kwargs)


# Help is plain text (rich_markup_mode=None: HelpCommand), as wide as the terminal up to 120 columns.
HELP_SETTINGS = {"max_content_width": 120}

app = CleanerTyper(
    name="cleaner",
    help="CLEANER: collect tool-using rollouts, purify them with SAAR, train with GRPO/DAPO.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP_SETTINGS,
)
sandbox_app = CleanerTyper(help="Run code through the Python tool's sandbox.", no_args_is_help=True,
                           rich_markup_mode=None)
app.add_typer(sandbox_app, name="sandbox")

console = Console()
if not console.is_terminal:  # pipes, logs and CI: wide tables instead of rich's 80-column default
    console = Console(width=160)
err_console = Console(stderr=True)

WarehouseOpt = Annotated[
    Path, typer.Option("--warehouse", "-w", help="Warehouse directory.", envvar="CLEANER_WAREHOUSE")
]
DEFAULT_WAREHOUSE = Path("warehouse")


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print an error to stderr and return the Exit to raise."""
    # escaped: a message may hold brackets rich would read as markup (pip install 'cleaner[sglang]')
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    return typer.Exit(code)



OPEN_FILES_TARGET = 65_536  # descriptors a collection may hold: a socket per rollout in flight, pipes, parts


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise this process's soft limit on open descriptors towards `target`, within its hard limit;
    the soft limit it has after. Many clusters start jobs at a soft 1,024, which a collection with a
    thousand rollouts in flight (a connection each to the SGLang servers, the sandbox's and reward
    workers' pipes) runs out of, as "Too many open files" in whatever opens next; the hard limit is
    usually far higher, and raising the soft one up to it is every process's right (SGLang's servers
    do the same). Where the platform has no such limit, nothing changes."""
    try:
        import resource
    except ImportError:  # not a POSIX platform
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # a platform that refuses it: the limit stays as it was
            logging.getLogger(__name__).debug("could not raise the open-files limit from %d", soft)
    return soft


def _print_version(asked: bool) -> None:
    if asked:
        from cleaner import __version__

        typer.echo(f"cleaner {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the installed version and exit.")] = False,
):
    """CLEANER: self-purified trajectories for agentic RL (arXiv 2601.15141)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:  # httpx says INFO for every request it sends (a thousand a second to SGLang servers)
        logging.getLogger("httpx").setLevel(logging.WARNING)
    raise_open_files_limit()
    # before anything starts CUDA: the allocator grows its segments instead of fragmenting (the train
    # step's long rows), unless the user chose a setting (engine/train/memory.py)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


# ---------------------------------------------------------------------------------------------
# Building configs and calling jobs


def build_config(factory, flags: dict[str, str] | None = None, **kwargs):
    """Build a config; an invalid value becomes a clear CLI error naming the flag it came from.

    A field passed in `kwargs` is named `--field-name` in the error, or `flags[field]` where the
    command's flag is spelled otherwise (n_prompts is `--prompts`)."""
    try:
        return factory(**kwargs)
    except ValueError as exc:
        names = {name: (flags or {}).get(name, option_of(name)) for name in kwargs}
        raise fail(f"invalid option: {name_fields(str(exc), names)[0]}") from exc


def floats(text: str, name: str) -> list[float]:
    """The comma-separated numbers of option `name`: at least one (a grid axis with none would run nothing)."""
    return _parsed(text, name, float, "comma-separated numbers", "one or more comma-separated numbers")


def integers(text: str, name: str) -> list[int]:
    """The comma-separated iteration numbers of option `name`: at least one."""
    return _parsed(text, name, int, "comma-separated iteration numbers", "one or more iteration numbers")


def _parsed(text: str, name: str, parse, what: str, at_least: str) -> list:
    """`parse` of each comma-separated value of option `name`; one line saying `what` it takes
    (`at_least` when it gives none) otherwise."""
    try:
        values = [parse(value) for value in text.split(",") if value.strip()]
    except ValueError as exc:
        raise fail(f"{name} takes {what}, got {text!r}") from exc
    if not values:
        raise fail(f"{name} takes {at_least}, got {text!r}")
    return values


def booleans(text: str, name: str) -> list[bool]:
    """The comma-separated true/false values of option `name`: at least one."""
    values = [value.lower() for value in words(text, name)]
    wrong = [value for value in values if value not in ("true", "false")]
    if wrong:
        raise fail(f"{name} takes comma-separated true and false, got {text!r}")
    return [value == "true" for value in values]


def words(text: str, name: str) -> list[str]:
    """The comma-separated words of option `name`: at least one."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise fail(f"{name} takes one or more comma-separated values, got {text!r}")
    return values


def call_job(job, *args, **kwargs):
    """Call a job; its expected failures become CLI errors with exit code 1, and so does a full
    disk wherever a write meets it (the warehouse and checkpoints say so themselves)."""
    from cleaner.errors import DISK_FULL, CleanerError, write_error

    try:
        return job(*args, **kwargs)
    except CleanerError as exc:
        raise fail(str(exc), exc.exit_code) from exc
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        if exc.filename is None:
            raise fail(f"a write failed: {exc.strerror}; free space where this command writes, and run "
                       "it again") from exc
        raise fail(str(write_error(exc.filename, exc))) from exc


ShardOpt = Annotated[str, typer.Option(
    "--shard", help="i/N: do only the i-th of N disjoint shares (whole prompts) of the iteration.")]


def parse_shard(text: str):
    from cleaner.config import Shard

    return build_config(Shard.parse, {"text": "--shard"}, text=text)


class LogTarget(StrEnum):  # cleaner.report.tracking.TARGETS
    tensorboard = "tensorboard"
    wandb = "wandb"


# Where `run` and `eval` mirror their metrics besides the warehouse (cleaner.report.tracking).
WandbProjectOpt = Annotated[str, typer.Option(help="W&B project.", rich_help_panel="Logging")]
WandbOfflineOpt = Annotated[bool, typer.Option(
    "--wandb-offline", help="W&B offline even with an API key (it is offline anyway without one).",
    rich_help_panel="Logging")]
