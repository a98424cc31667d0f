"""The phase commands: collect, eval, purify, ablate, train.

Each takes a flag per field of its config (config/flags.py, rendered by options.py), builds its
job's request from them and calls the job.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import (
    DEFAULT_WAREHOUSE,
    LogTarget,
    ShardOpt,
    WandbOfflineOpt,
    WandbProjectOpt,
    WarehouseOpt,
    app,
    booleans,
    call_job,
    console,
    fail,
    floats,
    parse_shard,
    words,
)
from cleaner.cli.options import Flags, config_flags
from cleaner.config.flags import COMMANDS


@app.command()
@config_flags("collect")
def collect(
    *,
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    flags: Flags,
    resume: Annotated[bool, typer.Option(help="Finish a partly collected iteration (or shard of one).")] = False,
    shard: ShardOpt = "0/1",
) -> None:
    """Run multi-turn tool-using rollouts and store every attempt in the warehouse.

    With --shard i/N, N processes (one machine or many sharing the warehouse) collect disjoint
    shares of the iteration; together they write exactly the rollouts of an unsharded run.
    """
    from cleaner.config import CollectConfig
    from cleaner.engine.collect.job import CollectRequest, collect_job
    from cleaner.report.tables import summary_table
    from cleaner.warehouse import Warehouse

    request = CollectRequest(flags.build(CollectConfig), parse_shard(shard), resume)
    outcome = call_job(collect_job, Warehouse(warehouse), request)
    console.print(summary_table(outcome.summary))
    share = request.shard
    where = f"iteration {outcome.iteration}" + (f" shard {share}" if share.sharded else "")
    console.print(f"{where}: {outcome.n_written} rollouts written "
                  f"({outcome.n_planned} planned) in {outcome.seconds:.1f} s -> {warehouse}")


class EvalFormat(StrEnum):
    table = "table"
    json = "json"


def _named_datasets(values: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise fail(f"--dataset takes NAME=PATH.parquet, got {value!r}")
        pairs.append((name, path))
    return tuple(pairs)


@app.command("eval")
@config_flags("eval")
def evaluate(
    *,
    model: Annotated[list[str], typer.Option("--model", help="Model to evaluate (HF directory or hub id); repeatable.")],
    dataset: Annotated[list[str], typer.Option("--dataset", help="NAME=PATH.parquet (verl, AIME24/25, GPQA-Diamond or LiveCodeBench v6 layout); repeatable.")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    saar: Annotated[bool, typer.Option("--saar", help="Run with SAAR at test time (the default if neither is given).")] = False,
    no_saar: Annotated[bool, typer.Option("--no-saar", help="Run with the raw context; with --saar, run both.")] = False,
    flags: Flags,
    output_format: Annotated[EvalFormat, typer.Option("--format", "-f", help="table | json.")] = EvalFormat.table,
    log_to: Annotated[list[LogTarget] | None, typer.Option("--log-to", help="Also log each evaluation's metrics to tensorboard or wandb; repeatable.", show_default=False, rich_help_panel="Logging")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Where the logs go (default: beside the warehouse, so a run's evals log with the run).", show_default=False, rich_help_panel="Logging")] = None,
    log_step: Annotated[int, typer.Option(help="The x value of this evaluation, e.g. the iteration of the checkpoint.", rich_help_panel="Logging")] = 0,
    wandb_project: WandbProjectOpt = "cleaner",
    wandb_offline: WandbOfflineOpt = False,
) -> None:
    """Evaluate models on benchmark files with the agent loop (no training); store every rollout.

    Prints avg@n, pass@k (k = 1, 2, 4, ..., n), maj@n and tool failures per trajectory for each
    model, dataset and SAAR setting, and SAAR's latency ratio when both settings ran. Running the
    same command again continues an interrupted evaluation and reprints completed ones.
    """
    from cleaner.config import EvalConfig
    from cleaner.engine.eval.job import eval_job
    from cleaner.report.tables import eval_records, eval_scalars, eval_table
    from cleaner.report.tracking import open_loggers
    from cleaner.warehouse import Warehouse

    settings = tuple(setting for setting, given in ((True, saar), (False, no_saar)) if given) or (True,)
    config = flags.build(EvalConfig, {"models": "--model", "datasets": "--dataset", "saar": "--saar/--no-saar"},
                         models=tuple(model), datasets=_named_datasets(dataset), saar=settings,
                         max_new_tokens=flags["max_new_tokens"] or flags["max_response_tokens"])
    log_dir = log_dir or warehouse.resolve().parent
    metrics = call_job(open_loggers, [target.value for target in log_to or []], log_dir, name=log_dir.name,
                      wandb_project=wandb_project, wandb_offline=wandb_offline)
    with metrics:
        outcome = call_job(eval_job, Warehouse(warehouse), config, progress=output_format is EvalFormat.table)
        for row in outcome.rows:  # every evaluation the command prints, stored ones too
            metrics.log_metrics(*eval_scalars(row), step=log_step)
    if output_format is EvalFormat.json:
        typer.echo(json.dumps(eval_records(outcome.rows), indent=2))
        return
    console.print(eval_table(outcome.rows))
    stored = len(outcome.rows) - len(outcome.computed)
    console.print(f"{len(outcome.computed)} evaluation(s) run, {stored} already stored, in "
                  f"{outcome.seconds:.1f} s -> {warehouse} (`cleaner sql \"FROM eval_runs\"`)")


def _purify(
    *,
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to purify.")] = 0,
    flags: Flags,
    shard: ShardOpt = "0/1",
) -> None:
    """The body of purify (one config from the flags) and ablate (a config per point of the grid)."""
    from cleaner.config import PurifyConfig
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.warehouse import Warehouse

    configs = _grid(flags) if flags.command == "ablate" else [flags.build(PurifyConfig)]
    scoring = configs[0]  # where it scores: the flags every point of a grid shares
    request = PurifyRequest(iteration, tuple(configs), parse_shard(shard), backend_kind=scoring.backend,
                            sglang_url=scoring.sglang_url, device=scoring.device,
                            scorer_memory_gb=scoring.scorer_memory_gb)
    _print_purify(call_job(purify_job, Warehouse(warehouse), request))


def _grid(flags: Flags) -> list:
    """A PurifyConfig per combination of ablate's comma-separated axes, in field order; an estimator
    other than grpo divides by no std, so it takes norm_adv_by_std's one setting, once."""
    from itertools import product

    from cleaner.config import AdvEstimator, PurifyConfig

    parsers = {float: floats, bool: booleans}
    axes = {flag.name: parsers.get(flag.hint, words)(flags[flag.name], flag.option)
            for flag in flags.flags if flag.name in COMMANDS["ablate"].grid}
    points = []
    for values in product(*axes.values()):
        point = dict(zip(axes, values, strict=True))
        if point["adv_estimator"] != AdvEstimator.GRPO:
            point["norm_adv_by_std"] = True
        # --down-sample-to sizes the axis's roc and uniform points; its none point keeps every rollout
        if point["down_sample"] == "none":
            point["down_sample_to"] = None
        if point not in points:
            points.append(point)
    return [flags.build(PurifyConfig, **point) for point in points]


def _print_purify(outcome) -> None:
    from cleaner.report.tables import premise_table, stats_table

    if outcome.results and outcome.results[0].stats.premise is not None:
        console.print(premise_table(outcome.results[0].stats.premise))
    console.print(stats_table(outcome.results))
    stored = [r.config.config_id for r in outcome.results if r.config.config_id not in outcome.computed]
    if stored:
        console.print(f"already stored, not recomputed: {', '.join(stored)}")
    if outcome.scorer_stats is not None:
        s = outcome.scorer_stats
        console.print(f"scorer: forwarded {s.tokens_forwarded} of {s.tokens_naive} tokens "
                      f"({s.tokens_forwarded / max(s.tokens_naive, 1):.2f} of a naive pass) in {s.seconds:.1f} s")
        if s.tokens_computed is not None:  # an engine with its own prefix cache says what it computed
            console.print(f"the engine computed {s.tokens_computed} of {s.tokens_naive} tokens "
                          f"({s.tokens_computed / max(s.tokens_naive, 1):.2f} of a naive pass)")
    console.print(f"{len(outcome.results)} config(s) in {outcome.seconds:.1f} s")


# purify and ablate: one signature and body, each command with its own config flags and help
app.command("purify", help="""Replay stored attempts with SAAR, rescore them and compute advantages (--adv-estimator).

    With --shard i/N, N processes purify disjoint shares (whole GRPO groups) of the iteration;
    their rows together equal an unsharded purify's.
    """)(config_flags("purify")(_purify))
app.command("ablate", help="Purify one iteration under a grid of (gamma, p, ...) in one scorer pass; compare the "
                           "configs.")(config_flags("ablate")(_purify))


@app.command()
@config_flags("train")
def train(
    *,
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to train on.")] = 0,
    config_id: Annotated[str, typer.Option(help="Purify config id (see `cleaner sql 'FROM purify_configs'`).")] = ...,
    policy: Annotated[Path, typer.Option(help="Policy to update (the one that collected).", exists=True)] = ...,
    out: Annotated[Path, typer.Option(help="Where to write the new checkpoint.")] = ...,
    flags: Flags,
) -> None:
    """Take a GRPO/DAPO step on a purified iteration and write a new checkpoint.

    The optimiser saved with --policy (a checkpoint of `cleaner train` or `cleaner run`) is resumed,
    so its moments and lr schedule continue; a plain Hugging Face model starts a fresh one.
    """
    from cleaner.config import TrainConfig
    from cleaner.engine.train.job import TrainRequest, train_job
    from cleaner.warehouse import Warehouse

    request = TrainRequest(iteration, config_id, policy, out, flags.build(TrainConfig))
    result = call_job(train_job, Warehouse(warehouse), request).result
    if not result.main_process:  # another DeepSpeed rank: rank 0 reports
        return
    steps = result.steps
    if steps:
        last = steps[-1]
        console.print(f"{len(steps)} steps; last loss {last.loss:.4f} kl {last.approx_kl:.4f} "
                      f"clip {last.clip_fraction:.3f}")
    console.print(f"checkpoint -> {out}")


