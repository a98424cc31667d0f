"""The loop commands: run, demo, bootstrap.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import (
    LogTarget,
    WandbOfflineOpt,
    WandbProjectOpt,
    app,
    call_job,
    console,
    fail,
)
from cleaner.cli.options import Flags, config_flags

RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="Holds warehouse/ and checkpoints/.")]


def _fail_job(message: str) -> typer.Exit:
    """An error every rank of the job meets alike (the command line, the saved run, or one the
    ranks agreed on): rank 0 prints it and exits 1. The other ranks exit 0 without a word, since
    one exiting non-zero first would make torchrun stop rank 0 before it prints; the job still
    fails with rank 0's code. A process without a launcher is rank 0."""
    from cleaner.loop.ranks import Ranks

    return fail(message) if Ranks.from_env().main else typer.Exit(0)


def _resolve_run(layers: list[dict], where: str, resume: bool, names: dict | None = None):
    """loop/resume.py's config of the layers (on resume, over the saved run's); an error every rank meets alike."""
    from cleaner.config.layers import ConfigError
    from cleaner.loop.resume import resolved_run

    try:
        return resolved_run(layers, where, resume, names)
    except ConfigError as error:
        raise _fail_job(str(error)) from error


def _run_and_report(config, resume: bool, metrics=None, fresh: bool = False) -> list:
    """Run the loop and print each iteration and the table; on several ranks, rank 0 prints.
    `fresh`: delete what a previous run left in the run directory, under its lock (the demo)."""
    from cleaner.errors import CleanerError
    from cleaner.loop.ranks import Ranks, RanksError
    from cleaner.warehouse.lock import refusal_if_held, run_lock

    ranks = Ranks.from_env()
    # one process: refused at once, before the model stack loads (run_loop takes the lock itself;
    # on many ranks it does so through rank 0, which a later rank's probe would see as busy)
    busy = refusal_if_held(*run_lock(Path(config.run_dir))) if ranks.world_size == 1 else None
    if busy:
        raise fail(busy)
    from cleaner.loop.iterations import run_loop
    from cleaner.report.tables import iteration_table

    def one_line(row):
        credit = "-" if row.failed_call_advantage is None else f"{row.failed_call_advantage:+.3f}"
        console.print(
            f"iteration {row.iteration}: accuracy {row.accuracy:.3f}  1st-call errors "
            f"{row.first_attempt_error_rate:.3f}  failures/traj {row.failures_per_trajectory:.3f}  "
            f"merges {row.n_shallow} shallow / {row.n_deep} deep  failed-call credit {credit}  "
            f"({row.collect_s:.0f}+{row.purify_s:.0f}+{row.train_s:.0f} s)")

    if not ranks.main:  # rank 0 logs what the job does; the others only what goes wrong
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    try:
        rows = run_loop(config, resume=resume, fresh=fresh, on_iteration=one_line, metrics=metrics, ranks=ranks)
    except RanksError as error:
        raise _fail_job(str(error)) from error
    except CleanerError as error:  # this rank's own
        raise fail(str(error)) from error
    if ranks.main:
        console.print(iteration_table(rows))
    return rows


@app.command()
@config_flags("run")
def run(
    *,
    flags: Flags,
    config_file: Annotated[Path | None, typer.Option("--config", help="TOML file laid out like --print-config's output; flags override it.", exists=True, dir_okay=False)] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the resolved config as TOML and exit.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run with its saved config (--iterations may grow).")] = False,
    log_to: Annotated[list[LogTarget] | None, typer.Option("--log-to", help="Also log every iteration and optimiser step to tensorboard (<run-dir>/tensorboard/) or wandb; repeatable.", show_default=False, rich_help_panel="Logging")] = None,
    wandb_project: WandbProjectOpt = "cleaner",
    wandb_offline: WandbOfflineOpt = False,
) -> None:
    """Loop collect -> purify -> train for several iterations, in one process or on many ranks.

    Under torchrun with --engine deepspeed, every rank collects and purifies its share of each
    iteration and all ranks train together; rank 0 writes the checkpoint, the rows and the output.
    A server at --sglang-url loads each checkpoint by its path, so it must see the run directory.

    A flag that sets two tables sets them alike (the run purifies at its collect config); --edit
    mask collects with the raw view unless --collect-view says otherwise.

    Every option can also come from `--config run.toml` (flags override the file); `--print-config`
    shows the resolved config in that format. The logging options are not part of the config: they
    say where to mirror the metrics, not what the run computes, so a resumed run may change them.
    """
    from cleaner.config.flags import flag_layer, flag_names
    from cleaner.config.layers import ConfigError, read_toml

    given = flags.given_values()
    try:
        file_layer = read_toml(config_file) if config_file else {}
    except ConfigError as error:
        raise _fail_job(str(error)) from error
    config = _resolve_run([file_layer, flag_layer(given)], str(config_file or "flags"), resume, flag_names(given))
    if print_config:
        from cleaner.config.layers import to_toml

        typer.echo(to_toml(config), nl=False)
        return
    from cleaner.loop.ranks import Ranks
    from cleaner.report.tracking import open_loggers

    targets = [target.value for target in log_to or []] if Ranks.from_env().main else []  # rank 0 logs
    metrics = call_job(open_loggers, targets, Path(config.run_dir),
                       name=Path(config.run_dir).name, config=config.to_dict(), wandb_project=wandb_project,
                       wandb_offline=wandb_offline)
    with metrics:
        _run_and_report(config, resume, metrics)


DEMO_SQL = (
    "SELECT iteration, avg(correct::int) AS accuracy, avg(n_failed_calls) AS failures FROM rollouts GROUP BY 1 ORDER BY 1",
    "SELECT error_type, count(*) AS n FROM failures GROUP BY 1 ORDER BY 2 DESC",
    "SELECT attempt, count(*) AS calls, avg((tool_status = 'ok')::int) AS ok_rate FROM attempts WHERE has_call GROUP BY 1 ORDER BY 1",
)


@app.command()
def demo(
    run_dir: RunDirOpt = Path("runs/demo"),
    iterations: Annotated[int, typer.Option(help="Iterations to run.")] = 6,
    prompts: Annotated[int, typer.Option(help="Prompts per iteration.")] = 32,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted demo.")] = False,
    lora_rank: Annotated[int, typer.Option(help="Train rank-R LoRA adapters instead of the weights (0 = off).")] = 0,
    lr: Annotated[float | None, typer.Option(help="Learning rate (unset: run's, 1e-4).")] = None,
    model: Annotated[str | None, typer.Option(help="The policy (unset: the tiny default policy; the other toys' "
                                              "are cleaner/assets/tiny-policy-env and tiny-policy-recover).")] = None,
) -> None:
    """Run the whole loop on the tiny default policy and the toy task (a few minutes on two cores)."""
    from cleaner.report.job import report_job
    from cleaner.warehouse import Warehouse

    train = {"lora_rank": lora_rank} if lora_rank else {}
    if lr is not None:
        train["lr"] = lr
    config = _resolve_run([{"run_dir": str(run_dir), "iterations": iterations,
                            "collect": {"n_prompts": prompts, "group_size": 8, **({"model": model} if model else {})},
                            **({"train": train} if train else {})}], "demo", resume)
    _run_and_report(config, resume, fresh=not resume)  # the demo starts clean unless asked to resume
    warehouse = run_dir / "warehouse"
    written = call_job(report_job, Warehouse(warehouse), run_dir / "report")
    console.print(f"\nreport: {written.page} (every figure as a PNG beside it)\nwarehouse: {warehouse}\nTry:")
    for query in DEMO_SQL:
        console.print(f'  cleaner sql -w {warehouse} "{query}"', soft_wrap=True, highlight=False)


@app.command()
@config_flags("bootstrap")
def bootstrap(
    *,
    out: Annotated[Path, typer.Option("--out", help="Model directory to write.")] = Path("cleaner/assets/tiny-policy"),
    flags: Flags,
) -> None:
    """Train the tiny default policy into cleaner/assets/tiny-policy.

    The committed policy took two stages: `cleaner bootstrap --out runs/base --checkpoint-every 250`,
    then `cleaner bootstrap --init-from runs/base-checkpoints/step-1250 --fail-share 0.4 --steps 300
    --lr 1e-3 --corpus-size 12000 --seed 1` (both configs are saved next to the model).
    """
    from cleaner.config.bootstrap import BootstrapOptions
    from cleaner.toys import sft
    from cleaner.toys.corpus import CorpusConfig

    options = flags.build(BootstrapOptions)
    corpus = CorpusConfig(size=options.corpus_size, seed=options.seed, fail_share=options.fail_share,
                          failures=options.failures, slip_share=options.slip_share,
                          no_tool_share=options.no_tool_share)
    config = sft.BootstrapConfig(corpus=corpus, steps=options.steps, batch_size=options.batch_size,
                                 seed=options.seed, lr=options.lr, checkpoint_every=options.checkpoint_every,
                                 threads=options.threads, init_from=options.init_from)
    result = call_job(sft.bootstrap_policy, config, out)
    console.print(f"wrote {result.out_dir} (final loss {result.final_loss:.4f}, "
                  f"{result.tokens_seen} tokens, {result.wall_s:.0f} s)")
