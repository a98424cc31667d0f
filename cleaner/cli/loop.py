"""The loop commands: run, demo, bootstrap.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import (
    DeviceOpt,
    LogTarget,
    SeedOpt,
    WandbOfflineOpt,
    WandbProjectOpt,
    app,
    build_config,
    call_job,
    console,
    fail,
)
from cleaner.config import DEFAULT_POLICY

RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="Holds warehouse/ and checkpoints/.")]


def _flag_layer(ctx: typer.Context, values: dict) -> tuple[dict, dict]:
    """The config layer of the `run` flags given on the command line (not their defaults), and
    the flag of each field they set (errors name the flag the user typed)."""
    from cleaner.config.layers import RUN_FLAGS, flag_layer, flag_names

    def given(name: str) -> bool:  # by name: typer may vendor its own copy of click's enum
        source = ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    flags = {name: values[name] for name in RUN_FLAGS if given(name)}
    return flag_layer(flags), flag_names(flags)


def _fail_job(message: str) -> typer.Exit:
    """An error every rank of the job meets alike (the command line, the saved run, or one the
    ranks agreed on): rank 0 prints it and exits 1. The other ranks exit 0 without a word, since
    one exiting non-zero first would make torchrun stop rank 0 before it prints; the job still
    fails with rank 0's code. A process without a launcher is rank 0."""
    from cleaner.loop.ranks import Ranks

    return fail(message) if Ranks.from_env().main else typer.Exit(0)


def _resolve_run(layers: list[dict], where: str, resume: bool, names: dict | None = None):
    """The RunConfig of the layers; on resume, the saved run's config is the layer beneath them,
    and nothing but `iterations` may differ from it. `names`: the flag of each field a flag set."""
    from cleaner.config.layers import (
        RUN_BASE_LAYER,
        ConfigError,
        differences,
        resolve_run_config,
    )
    from cleaner.warehouse import Warehouse

    try:
        config = resolve_run_config(RUN_BASE_LAYER, *layers, where=where, names=names)
        saved = Warehouse(Path(config.run_dir) / "warehouse").load_config("run") if resume else None
        if saved is None:
            return config
        saved_layer = json.loads(saved)
        config = resolve_run_config(RUN_BASE_LAYER, saved_layer, *layers, where=where, names=names)
        # the saved run resolved alone: a field added since it was saved takes its default there
        saved_config = resolve_run_config(RUN_BASE_LAYER, saved_layer, where=where, names=names)
    except ConfigError as error:
        raise _fail_job(str(error)) from error
    changed = differences(json.loads(saved_config.to_json()), json.loads(config.to_json()), ignore=("iterations",))
    if changed:
        raise _fail_job(f"{config.run_dir} was started with another config; --resume continues it as it "
                        f"was (only --iterations may change). Differs: {'; '.join(changed)}")
    return config


def _run_and_report(config, resume: bool, metrics=None) -> list:
    """Run the loop and print each iteration and the table; on several ranks, rank 0 prints."""
    from cleaner.errors import CleanerError
    from cleaner.loop.iterations import run_loop
    from cleaner.loop.ranks import Ranks, RanksError
    from cleaner.report.tables import iteration_table

    def one_line(row):
        credit = "-" if row.failed_call_advantage is None else f"{row.failed_call_advantage:+.3f}"
        console.print(
            f"iteration {row.iteration}: accuracy {row.accuracy:.3f}  1st-call errors "
            f"{row.first_attempt_error_rate:.3f}  failures/traj {row.failures_per_trajectory:.3f}  "
            f"merges {row.n_shallow} shallow / {row.n_deep} deep  failed-call credit {credit}  "
            f"({row.collect_s:.0f}+{row.purify_s:.0f}+{row.train_s:.0f} s)")

    ranks = Ranks.from_env()
    if not ranks.main:  # rank 0 logs what the job does; the others only what goes wrong
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))
    try:
        rows = run_loop(config, resume=resume, on_iteration=one_line, metrics=metrics, ranks=ranks)
    except RanksError as error:
        raise _fail_job(str(error)) from error
    except CleanerError as error:  # this rank's own
        raise fail(str(error)) from error
    if ranks.main:
        console.print(iteration_table(rows))
    return rows


@app.command()
def run(
    ctx: typer.Context,
    run_dir: RunDirOpt = Path("runs/default"),
    iterations: Annotated[int, typer.Option(help="Iterations to run.")] = 3,
    config_file: Annotated[Path | None, typer.Option("--config", help="TOML file laid out like --print-config's output; flags override it.", exists=True, dir_okay=False)] = None,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the resolved config as TOML and exit.")] = False,
    resume: Annotated[bool, typer.Option(help="Continue an interrupted run with its saved config (--iterations may grow).")] = False,
    prompts: Annotated[int, typer.Option(help="Prompts per iteration.", rich_help_panel="Collect")] = 64,
    group_size: Annotated[int, typer.Option(help="Samples per prompt (GRPO group).", rich_help_panel="Collect")] = 8,
    model: Annotated[str, typer.Option(help="HF model path or checkpoint dir (default: tiny policy).", rich_help_panel="Collect")] = str(DEFAULT_POLICY),
    data: Annotated[Path | None, typer.Option(help="Dataset Parquet (verl RL or an eval layout); default: toy tasks.", rich_help_panel="Collect")] = None,
    prompt_style: Annotated[str, typer.Option(help="Prompts of --data: reference (the paper's) | bare.", rich_help_panel="Collect")] = "reference",
    backend: Annotated[str, typer.Option(help="torch | sglang: where the policy generates and scores.", rich_help_panel="Collect")] = "torch",
    sglang_url: Annotated[str | None, typer.Option(help="A running SGLang server or router (with --backend sglang); it must see the checkpoints' paths.", rich_help_panel="Collect")] = None,
    max_turns: Annotated[int, typer.Option(help="Steps per rollout (tool calls and the answer; retries do not count).", rich_help_panel="Collect")] = 8,
    max_retries: Annotated[int, typer.Option(help="K: retries per failed tool-call step.", rich_help_panel="Collect")] = 3,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per generation.", rich_help_panel="Collect")] = 160,
    max_response_tokens: Annotated[int | None, typer.Option(help="Token budget after the prompt (default: max(768, --max-new-tokens)).", show_default=False, rich_help_panel="Collect")] = None,
    truncate_prompts: Annotated[bool, typer.Option(help="A prompt too long for the model's context with the response budget keeps its last tokens (verl's truncation=left); default: an error naming the row.", rich_help_panel="Collect")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.", rich_help_panel="Collect")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling.", rich_help_panel="Collect")] = 1.0,
    collect_view: Annotated[str, typer.Option(help="Context of later turns: purified (the paper) | raw (the baseline).", rich_help_panel="Collect")] = "purified",
    batch_rollouts: Annotated[int, typer.Option(help="Rollouts per committed batch.", rich_help_panel="Collect")] = 64,
    sandbox_timeout_s: Annotated[float, typer.Option(help="Wall-clock limit per tool call.", rich_help_panel="Collect")] = 4.0,
    sandbox_workers: Annotated[int, typer.Option(help="Sandbox worker processes.", rich_help_panel="Collect")] = 2,
    gamma: Annotated[float, typer.Option(help="SAAR: shallow merge iff similarity >= gamma (collect and purify).", rich_help_panel="Purify")] = 0.5,
    rollback_prob: Annotated[float, typer.Option(help="p: share of rollouts purified (collect and purify).", rich_help_panel="Purify")] = 1.0,
    similarity_on: Annotated[str, typer.Option(help="code | call (the reference).", rich_help_panel="Purify")] = "code",
    purify_when: Annotated[str, typer.Option(help="always (the paper) | positive.", rich_help_panel="Purify")] = "always",
    edit: Annotated[str, typer.Option(help="replace (CLEANER: SAAR's sequence) | mask (the raw sequence, what replace drops untrained; collects raw).", rich_help_panel="Purify")] = "replace",
    rollback_is_threshold: Annotated[float, typer.Option("--rollback-is-threshold", help="IS gate tau (collect and purify); 0 = off.", rich_help_panel="Purify")] = 0.0,
    rollback_is_mode: Annotated[str, typer.Option("--rollback-is-mode", help="sum (the design) | mean (per token, the reference's later code).", rich_help_panel="Purify")] = "sum",
    negative_samples: Annotated[bool, typer.Option(help="Negative samples: push fixed failures down, their fixes up.", rich_help_panel="Purify")] = False,
    dpo_beta: Annotated[float, typer.Option(help="Beta of the negative-sample term.", rich_help_panel="Purify")] = 0.1,
    dpo_max_adjustment_ratio: Annotated[float, typer.Option(help="Cap of the negative-sample push per token.", rich_help_panel="Purify")] = 0.1,
    dpo_cap: Annotated[str, typer.Option(help="relative | absolute (the reference's code).", rich_help_panel="Purify")] = "relative",
    lr: Annotated[float, typer.Option(help="Learning rate (tiny policy: 1e-4; the reference, 4B: 2e-6).", rich_help_panel="Train")] = 1e-4,
    warmup_steps: Annotated[int, typer.Option(help="Linear warmup over this many optimiser steps.", rich_help_panel="Train")] = 0,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.", rich_help_panel="Train")] = 0.0,
    clip_eps_low: Annotated[float, typer.Option(help="PPO clip, lower.", rich_help_panel="Train")] = 0.2,
    clip_eps_high: Annotated[float, typer.Option(help="PPO clip, upper (clip-higher).", rich_help_panel="Train")] = 0.28,
    clip_ratio_c: Annotated[float, typer.Option(help="Dual clip for negative advantages; 0 = off.", rich_help_panel="Train")] = 10.0,
    kl_coef: Annotated[float, typer.Option(help="KL to the reference; 0 = off.", rich_help_panel="Train")] = 0.0,
    truncated_is: Annotated[bool, typer.Option(help="Truncated IS on rewritten contexts.", rich_help_panel="Train")] = False,
    is_cap: Annotated[float, typer.Option(help="Cap of the truncated IS ratio.", rich_help_panel="Train")] = 2.0,
    dynamic_sampling: Annotated[bool, typer.Option(help="Drop equal-reward groups.", rich_help_panel="Train")] = False,
    overlong_buffer: Annotated[int, typer.Option(help="DAPO overlong buffer in tokens; 0 = off.", rich_help_panel="Train")] = 0,
    mini_batch_size: Annotated[int | None, typer.Option(help="Sequences per optimiser step (default: a quarter of the iteration's rollouts).", show_default=False, rich_help_panel="Train")] = None,
    micro_batch_size: Annotated[int | None, typer.Option(help="Sequences per forward/backward (default: min(16, mini batch)).", show_default=False, rich_help_panel="Train")] = None,
    epochs: Annotated[int, typer.Option(help="Passes over each iteration's rows.", rich_help_panel="Train")] = 1,
    max_grad_norm: Annotated[float, typer.Option(help="Gradient clipping.", rich_help_panel="Train")] = 1.0,
    engine: Annotated[str, typer.Option(help="torch | deepspeed (ZeRO over the ranks torchrun starts; each rank collects and purifies its share).", rich_help_panel="Train")] = "torch",
    deepspeed_config: Annotated[Path | None, typer.Option(help="DeepSpeed JSON: ZeRO stage, offload, precision.", rich_help_panel="Train")] = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    log_to: Annotated[list[LogTarget] | None, typer.Option("--log-to", help="Also log every iteration and optimiser step to tensorboard (<run-dir>/tensorboard/) or wandb; repeatable.", show_default=False, rich_help_panel="Logging")] = None,
    wandb_project: WandbProjectOpt = "cleaner",
    wandb_offline: WandbOfflineOpt = False,
) -> None:
    """Loop collect -> purify -> train for several iterations, in one process or on many ranks.

    Under torchrun with --engine deepspeed, every rank collects and purifies its share of each
    iteration and all ranks train together; rank 0 writes the checkpoint, the rows and the output.

    Every option can also come from `--config run.toml` (flags override the file); `--print-config`
    shows the resolved config in that format. The logging options are not part of the config: they
    say where to mirror the metrics, not what the run computes, so a resumed run may change them.
    """
    from cleaner.config.layers import ConfigError, read_toml

    flags, names = _flag_layer(ctx, locals())
    try:
        file_layer = read_toml(config_file) if config_file else {}
    except ConfigError as error:
        raise _fail_job(str(error)) from error
    config = _resolve_run([file_layer, flags], str(config_file or "flags"), resume, names)
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
) -> None:
    """Run the whole loop on the tiny default policy and the toy task (a few minutes on two cores)."""
    from cleaner.report.job import report_job
    from cleaner.warehouse import Warehouse

    if not resume:  # the demo always starts clean unless asked to resume
        from cleaner.loop.iterations import remove_run

        call_job(remove_run, run_dir)
    config = _resolve_run([{"run_dir": str(run_dir), "iterations": iterations,
                            "collect": {"n_prompts": prompts, "group_size": 8}}], "demo", resume)
    _run_and_report(config, resume)
    warehouse = run_dir / "warehouse"
    written = call_job(report_job, Warehouse(warehouse), run_dir / "report")
    console.print(f"\nreport: {written.page} (every figure as a PNG beside it)\nwarehouse: {warehouse}\nTry:")
    for query in DEMO_SQL:
        console.print(f'  cleaner sql -w {warehouse} "{query}"', soft_wrap=True, highlight=False)


@app.command()
def bootstrap(
    out: Annotated[Path, typer.Option("--out", help="Model directory to write.")] = Path("cleaner/assets/tiny-policy"),
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimiser steps.")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Corpus, init and batch-order seed.")] = 0,
    corpus_size: Annotated[int, typer.Option("--corpus-size", min=1, help="Synthetic trajectories.")] = 40_000,
    fail_share: Annotated[float, typer.Option("--fail-share", help="Share of first calls that fail.")] = 0.3,
    failures: Annotated[str, typer.Option("--failures", help="mixed (typos, wrong approaches) | environment (missing functions only: the second policy).")] = "mixed",
    slip_share: Annotated[float, typer.Option("--slip-share", help="Share of trajectories that miscopy one digit of the question in every call.")] = 0.0,
    no_tool_share: Annotated[float, typer.Option("--no-tool-share", help="Share of trajectories that answer with a guess, without calling the tool (the third policy).")] = 0.0,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per step.")] = 32,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Save <out>-checkpoints/step-N every N steps; 0 = off.")] = 0,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate.")] = 3e-3,
    init_from: Annotated[Path | None, typer.Option("--init-from", exists=True, file_okay=False, help="Continue from this policy (and its tokenizer): the calibration stage.")] = None,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch CPU threads.")] = 2,
) -> None:
    """Train the tiny default policy into cleaner/assets/tiny-policy.

    The committed policy took two stages: `cleaner bootstrap --out runs/base --checkpoint-every 250`,
    then `cleaner bootstrap --init-from runs/base-checkpoints/step-1250 --fail-share 0.4 --steps 300
    --lr 1e-3 --corpus-size 12000 --seed 1` (both configs are saved next to the model).
    """
    from cleaner.toys.corpus import CorpusConfig
    from cleaner.toys.sft import BootstrapConfig, bootstrap_policy

    corpus = build_config(CorpusConfig, {"size": "--corpus-size"}, size=corpus_size, seed=seed,
                          fail_share=fail_share, failures=failures, slip_share=slip_share,
                          no_tool_share=no_tool_share)
    config = build_config(BootstrapConfig, corpus=corpus, steps=steps, batch_size=batch_size, seed=seed, lr=lr,
                          checkpoint_every=checkpoint_every, threads=threads,
                          init_from=None if init_from is None else str(init_from))
    result = call_job(bootstrap_policy, config, out)
    console.print(f"wrote {result.out_dir} (final loss {result.final_loss:.4f}, "
                  f"{result.tokens_seen} tokens, {result.wall_s:.0f} s)")


