"""The `cleaner` command line: parse options -> build a config -> call one engine function.

Kept thin on purpose: every command's work lives in `cleaner.engine` or `cleaner.warehouse`.
"""

from __future__ import annotations

import json
import logging
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from cleaner.engine.config import DEFAULT_POLICY
from cleaner.engine.show import Panels

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


def _config(factory, **kwargs):
    """Build a config; an invalid value becomes a clear CLI error."""
    try:
        return factory(**kwargs)
    except ValueError as exc:
        raise fail(f"invalid option: {exc}") from exc


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise fail(f"{name} takes comma-separated numbers, got {text!r}") from exc


def _words(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _run_job(job, *args, **kwargs):
    """Call a job; its expected failures become CLI errors with exit code 1."""
    from cleaner.errors import CleanerError

    try:
        return job(*args, **kwargs)
    except CleanerError as exc:
        raise fail(str(exc)) from exc


ModelOpt = Annotated[str, typer.Option("--model", help="HF model path or checkpoint dir (default: tiny policy).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="torch device: cpu, cuda, cuda:1, ...")]
MaxTurnsOpt = Annotated[int, typer.Option(help="Assistant generations per rollout.")]
MaxNewTokensOpt = Annotated[int, typer.Option(help="Tokens per generation.")]
SeedOpt = Annotated[int, typer.Option(help="Base seed.")]
# Where the policy runs. Every command that generates or scores takes these two (collect, purify,
# ablate, run; an eval command too) and hands them to cleaner.engine.backends.load_backend.
BackendOpt = Annotated[str, typer.Option(
    "--backend", help="torch (this process) | sglang (an SGLang engine here, or the server at --sglang-url).")]
SglangUrlOpt = Annotated[str | None, typer.Option(
    "--sglang-url", help="A running SGLang server or router, e.g. http://host:30000 (with --backend sglang).")]
ShardOpt = Annotated[str, typer.Option(
    "--shard", help="i/N: do only the i-th of N disjoint shares (whole prompts) of the iteration.")]


def _shard(text: str):
    from cleaner.engine.config import Shard

    return _config(Shard.parse, text=text)


@app.command()
def collect(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration number to write.")] = 0,
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts in the iteration.")] = 64,
    group_size: Annotated[int, typer.Option(help="Samples per prompt (GRPO group).")] = 8,
    model: ModelOpt = str(DEFAULT_POLICY),
    data: Annotated[Path | None, typer.Option(help="Dataset Parquet (verl RL or an eval layout); default: toy tasks.", exists=True, dir_okay=False)] = None,
    prompt_style: Annotated[str, typer.Option(help="Prompts of --data: reference (the paper's) | bare.")] = "reference",
    max_turns: MaxTurnsOpt = 8,
    max_retries: Annotated[int, typer.Option(help="K: retries per failed tool call.")] = 3,
    max_new_tokens: MaxNewTokensOpt = 160,
    max_response_tokens: Annotated[int, typer.Option(help="Token budget after the prompt.")] = 768,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    collect_view: Annotated[str, typer.Option(help="Context rendering for later turns: purified | raw.")] = "purified",
    gamma: Annotated[float, typer.Option(help="SAAR threshold of the purified context.")] = 0.5,
    rollback_prob: Annotated[float, typer.Option(help="p: share of rollouts with a purified context.")] = 1.0,
    similarity_on: Annotated[str, typer.Option(help="code | call.")] = "code",
    rollback_is_threshold: IsThresholdOpt = 0.0,
    rollback_is_mode: IsModeOpt = "sum",
    seed: SeedOpt = 0,
    batch_rollouts: Annotated[int, typer.Option(help="Rollouts per committed batch.")] = 64,
    sandbox_timeout_s: Annotated[float, typer.Option(help="Wall-clock limit per tool call.")] = 4.0,
    sandbox_workers: Annotated[int, typer.Option(help="Sandbox worker processes.")] = 2,
    backend: BackendOpt = "torch",
    sglang_url: SglangUrlOpt = None,
    device: DeviceOpt = "cpu",
    resume: Annotated[bool, typer.Option(help="Finish a partly collected iteration (or shard of one).")] = False,
    shard: ShardOpt = "0/1",
) -> None:
    """Run multi-turn tool-using rollouts and store every attempt in the warehouse.

    With --shard i/N, N processes (one machine or many sharing the warehouse) collect disjoint
    shares of the iteration; together they write exactly the rollouts of an unsharded run.
    """
    from cleaner.engine.collect.summary import summary_table
    from cleaner.engine.config import CollectConfig, SandboxConfig
    from cleaner.jobs import collect_job
    from cleaner.warehouse import Warehouse

    share = _shard(shard)
    sandbox = _config(SandboxConfig, timeout_s=sandbox_timeout_s, workers=sandbox_workers)
    config = _config(
        CollectConfig, model=model, data=str(data) if data else None, prompt_style=prompt_style, iteration=iteration,
        n_prompts=prompts, group_size=group_size, max_turns=max_turns, max_retries=max_retries,
        max_new_tokens=max_new_tokens, max_response_tokens=max_response_tokens,
        temperature=temperature, collect_view=collect_view, gamma=gamma, rollback_prob=rollback_prob,
        similarity_on=similarity_on, rollback_is_threshold=rollback_is_threshold,
        rollback_is_mode=rollback_is_mode, seed=seed,
        batch_rollouts=batch_rollouts, backend=backend, sglang_url=sglang_url, device=device,
        sandbox=sandbox,
    )
    outcome = _run_job(collect_job, Warehouse(warehouse), config, resume=resume, shard=share)
    console.print(summary_table(outcome.summary))
    where = f"iteration {iteration}" + (f" shard {share}" if share.sharded else "")
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
def evaluate(
    model: Annotated[list[str], typer.Option("--model", help="Model to evaluate (HF directory or hub id); repeatable.")],
    dataset: Annotated[list[str], typer.Option("--dataset", help="NAME=PATH.parquet (verl, AIME24/25, GPQA-Diamond or LiveCodeBench v6 layout); repeatable.")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    n: Annotated[int, typer.Option("--n", help="Samples per problem.")] = 16,
    saar: Annotated[bool, typer.Option("--saar", help="Run with SAAR at test time (the default if neither is given).")] = False,
    no_saar: Annotated[bool, typer.Option("--no-saar", help="Run with the raw context; with --saar, run both.")] = False,
    prompt_style: Annotated[str, typer.Option(help="reference (the paper's prompts) | bare (the problem alone).")] = "reference",
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling.")] = 0.6,
    max_turns: Annotated[int, typer.Option(help="Steps per rollout (retries do not count).")] = 16,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens per generation (default: --max-response-tokens).", show_default=False)] = None,
    max_response_tokens: Annotated[int, typer.Option(help="Token budget after the prompt.")] = 20480,
    limit: Annotated[int | None, typer.Option(help="Evaluate the first N problems of each dataset.", show_default=False)] = None,
    test_timeout_s: Annotated[float, typer.Option(help="Per-test limit when grading programs.")] = 4.0,
    batch_rollouts: Annotated[int, typer.Option(help="Rollouts per committed batch.")] = 64,
    sandbox_workers: Annotated[int, typer.Option(help="Sandbox worker processes.")] = 2,
    seed: SeedOpt = 0,
    backend: BackendOpt = "torch",
    sglang_url: SglangUrlOpt = None,
    device: DeviceOpt = "cpu",
    output_format: Annotated[EvalFormat, typer.Option("--format", "-f", help="table | json.")] = EvalFormat.table,
) -> None:
    """Evaluate models on benchmark files with the agent loop (no training); store every rollout.

    Prints avg@n, pass@k (k = 1, 2, 4, ..., n), maj@n and tool failures per trajectory for each
    model, dataset and SAAR setting, and SAAR's latency ratio when both settings ran. Running the
    same command again continues an interrupted evaluation and reprints completed ones.
    """
    from cleaner.engine.config import EvalConfig, SandboxConfig
    from cleaner.engine.eval.report import eval_records, eval_table
    from cleaner.jobs import eval_job
    from cleaner.warehouse import Warehouse

    settings = tuple(setting for setting, given in ((True, saar), (False, no_saar)) if given) or (True,)
    config = _config(
        EvalConfig, models=tuple(model), datasets=_named_datasets(dataset), saar=settings, n=n,
        prompt_style=prompt_style, limit=limit, temperature=temperature, top_p=top_p, max_turns=max_turns,
        max_new_tokens=max_new_tokens or max_response_tokens, max_response_tokens=max_response_tokens,
        seed=seed, batch_rollouts=batch_rollouts, backend=backend, sglang_url=sglang_url, device=device,
        test_timeout_s=test_timeout_s,
        sandbox=_config(SandboxConfig, workers=sandbox_workers),
    )
    outcome = _run_job(eval_job, Warehouse(warehouse), config, progress=output_format is EvalFormat.table)
    if output_format is EvalFormat.json:
        typer.echo(json.dumps(eval_records(outcome.rows), indent=2))
        return
    console.print(eval_table(outcome.rows))
    stored = len(outcome.rows) - len(outcome.computed)
    console.print(f"{len(outcome.computed)} evaluation(s) run, {stored} already stored, in "
                  f"{outcome.seconds:.1f} s -> {warehouse} (`cleaner sql \"FROM eval_runs\"`)")


def _purify_configs(gammas, probs, similarity, when, taus=(0.0,), **fixed) -> list:
    """Every combination of the grid axes, with the `fixed` PurifyConfig fields."""
    from itertools import product

    from cleaner.engine.config import PurifyConfig

    return [
        _config(PurifyConfig, gamma=g, rollback_prob=p, similarity_on=s, purify_when=w,
                rollback_is_threshold=tau, **fixed)
        for g, p, s, w, tau in product(gammas, probs, similarity, when, taus)
    ]


IsThresholdOpt = Annotated[float, typer.Option(
    "--rollback-is-threshold", help="IS gate tau: a merge whose IS < tau keeps its chain raw; 0 = off.")]
IsModeOpt = Annotated[str, typer.Option(
    "--rollback-is-mode", help="IS over R's tokens: sum (the design) | mean (per token, the reference's later code).")]
NegativeSamplesOpt = Annotated[bool, typer.Option(
    help="Pair each fixed failure with its fix and push them apart (the reference's DPO term).")]
DpoBetaOpt = Annotated[float, typer.Option(help="Beta of the negative-sample term.")]
DpoRatioOpt = Annotated[float, typer.Option(help="Cap of the negative-sample push per token.")]
DpoCapOpt = Annotated[str, typer.Option(help="relative (x |advantage|) | absolute (the reference's code).")]


@app.command()
def purify(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to purify.")] = 0,
    gamma: Annotated[float, typer.Option(help="SAAR: shallow merge iff similarity >= gamma.")] = 0.5,
    rollback_prob: Annotated[float, typer.Option(help="p: SAAR applies iff rollback_draw < p.")] = 1.0,
    similarity_on: Annotated[str, typer.Option(help="code (default) | call (the reference).")] = "code",
    purify_when: Annotated[str, typer.Option(help="always (the paper) | positive.")] = "always",
    rollback_is_threshold: IsThresholdOpt = 0.0,
    rollback_is_mode: IsModeOpt = "sum",
    negative_samples: NegativeSamplesOpt = False,
    dpo_beta: DpoBetaOpt = 0.1,
    dpo_max_adjustment_ratio: DpoRatioOpt = 0.1,
    dpo_cap: DpoCapOpt = "relative",
    backend: BackendOpt = "torch",
    sglang_url: SglangUrlOpt = None,
    device: DeviceOpt = "cpu",
    shard: ShardOpt = "0/1",
) -> None:
    """Replay stored attempts with SAAR, rescore them and compute GRPO advantages.

    With --shard i/N, N processes purify disjoint shares (whole GRPO groups) of the iteration;
    their rows together equal an unsharded purify's.
    """
    from cleaner.jobs import purify_job
    from cleaner.warehouse import Warehouse

    share = _shard(shard)
    configs = _purify_configs([gamma], [rollback_prob], [similarity_on], [purify_when], [rollback_is_threshold],
                              rollback_is_mode=rollback_is_mode, negative_samples=negative_samples,
                              dpo_beta=dpo_beta, dpo_max_adjustment_ratio=dpo_max_adjustment_ratio,
                              dpo_cap=dpo_cap)
    outcome = _run_job(purify_job, Warehouse(warehouse), iteration, configs, backend_kind=backend,
                       sglang_url=sglang_url, device=device, shard=share)
    _print_purify(outcome)


def _print_purify(outcome) -> None:
    from cleaner.engine.purify.report import premise_table, stats_table

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
    console.print(f"{len(outcome.results)} config(s) in {outcome.seconds:.1f} s")


@app.command()
def ablate(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to replay.")] = 0,
    gamma: Annotated[str, typer.Option(help="Comma-separated gammas.")] = "0.3,0.5,0.7",
    rollback_prob: Annotated[str, typer.Option(help="Comma-separated p values.")] = "0.7,1.0",
    similarity_on: Annotated[str, typer.Option(help="Comma-separated: code,call.")] = "code",
    purify_when: Annotated[str, typer.Option(help="Comma-separated: always,positive.")] = "always",
    rollback_is_threshold: Annotated[str, typer.Option(help="Comma-separated IS gate taus; 0 = off.")] = "0",
    rollback_is_mode: IsModeOpt = "sum",
    negative_samples: NegativeSamplesOpt = False,
    dpo_beta: DpoBetaOpt = 0.1,
    dpo_max_adjustment_ratio: DpoRatioOpt = 0.1,
    dpo_cap: DpoCapOpt = "relative",
    backend: BackendOpt = "torch",
    sglang_url: SglangUrlOpt = None,
    device: DeviceOpt = "cpu",
    shard: ShardOpt = "0/1",
) -> None:
    """Purify one iteration under a grid of (gamma, p, ...) in one scorer pass; compare the configs."""
    from cleaner.jobs import purify_job
    from cleaner.warehouse import Warehouse

    share = _shard(shard)
    configs = _purify_configs(_floats(gamma, "--gamma"), _floats(rollback_prob, "--rollback-prob"),
                              _words(similarity_on), _words(purify_when),
                              _floats(rollback_is_threshold, "--rollback-is-threshold"),
                              rollback_is_mode=rollback_is_mode, negative_samples=negative_samples, dpo_beta=dpo_beta,
                              dpo_max_adjustment_ratio=dpo_max_adjustment_ratio, dpo_cap=dpo_cap)
    outcome = _run_job(purify_job, Warehouse(warehouse), iteration, configs, backend_kind=backend,
                       sglang_url=sglang_url, device=device, shard=share)
    _print_purify(outcome)


@app.command()
def train(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to train on.")] = 0,
    config_id: Annotated[str, typer.Option(help="Purify config id (see `cleaner sql 'FROM purify_configs'`).")] = ...,
    policy: Annotated[Path, typer.Option(help="Policy to update (the one that collected).", exists=True)] = ...,
    out: Annotated[Path, typer.Option(help="Where to write the new checkpoint.")] = ...,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 1e-6,
    warmup_steps: Annotated[int, typer.Option(help="Linear warmup over this many run-wide optimiser steps.")] = 0,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay.")] = 0.0,
    mini_batch_size: Annotated[int, typer.Option(help="Sequences per optimiser step.")] = 64,
    micro_batch_size: Annotated[int, typer.Option(help="Sequences per forward/backward.")] = 8,
    epochs: Annotated[int, typer.Option(help="Passes over the rows.")] = 1,
    kl_coef: Annotated[float, typer.Option(help="KL to the reference; 0 = off.")] = 0.0,
    truncated_is: Annotated[bool, typer.Option(help="Truncated IS on rewritten contexts.")] = False,
    dynamic_sampling: Annotated[bool, typer.Option(help="Drop equal-reward groups.")] = False,
    engine: Annotated[str, typer.Option(help="torch | deepspeed (ZeRO over the ranks torchrun starts).")] = "torch",
    deepspeed_config: Annotated[Path | None, typer.Option(
        help="DeepSpeed JSON: ZeRO stage, offload, precision (cleaner sets batch sizes, optimiser, clipping).",
        exists=True)] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Take a GRPO/DAPO step on a purified iteration and write a new checkpoint.

    The optimiser saved with --policy (a checkpoint of `cleaner train` or `cleaner run`) is resumed,
    so its moments and lr schedule continue; a plain Hugging Face model starts a fresh one.
    """
    from cleaner.engine.config import TrainConfig
    from cleaner.jobs import train_job
    from cleaner.warehouse import Warehouse

    config = _config(TrainConfig, lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay,
                     mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
                     epochs=epochs, kl_coef=kl_coef, truncated_is=truncated_is,
                     dynamic_sampling=dynamic_sampling, engine=engine,
                     deepspeed_config=str(deepspeed_config) if deepspeed_config else None, device=device)
    result = _run_job(train_job, Warehouse(warehouse), iteration, config_id, policy, out, config).result
    if not result.main_process:  # another DeepSpeed rank: rank 0 reports
        return
    steps = result.steps
    if steps:
        last = steps[-1]
        console.print(f"{len(steps)} steps; last loss {last.loss:.4f} kl {last.approx_kl:.4f} "
                      f"clip {last.clip_fraction:.3f}")
    console.print(f"checkpoint -> {out}")


RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="Holds warehouse/ and checkpoints/.")]


class LogTarget(StrEnum):  # cleaner.engine.tracking.TARGETS
    tensorboard = "tensorboard"
    wandb = "wandb"


def _flag_layer(ctx: typer.Context, values: dict) -> dict:
    """The config layer of the `run` flags given on the command line (not their defaults)."""
    from cleaner.engine.run_config import RUN_FLAGS, flag_layer

    def given(name: str) -> bool:  # by name: typer may vendor its own copy of click's enum
        source = ctx.get_parameter_source(name)
        return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")

    return flag_layer({name: values[name] for name in RUN_FLAGS if given(name)})


def _resolve_run(layers: list[dict], where: str, resume: bool):
    """The RunConfig of the layers; on resume, the saved run's config is the layer beneath them,
    and nothing but `iterations` may differ from it."""
    from cleaner.engine.run_config import (
        RUN_BASE_LAYER,
        ConfigError,
        differences,
        resolve_run_config,
    )
    from cleaner.warehouse import Warehouse

    try:
        config = resolve_run_config(RUN_BASE_LAYER, *layers, where=where)
        saved = Warehouse(Path(config.run_dir) / "warehouse").load_config("run") if resume else None
        if saved is None:
            return config
        saved_layer = json.loads(saved)
        config = resolve_run_config(RUN_BASE_LAYER, saved_layer, *layers, where=where)
    except ConfigError as error:
        raise fail(str(error)) from error
    changed = differences(saved_layer, config.to_dict(), ignore=("iterations",))
    if changed:
        raise fail(f"{config.run_dir} was started with another config; --resume continues it as it was "
                   f"(only --iterations may change). Differs: {'; '.join(changed)}")
    return config


def _run_and_report(config, resume: bool, metrics=None) -> list:
    from cleaner.engine.report import iteration_table
    from cleaner.runner import run_loop

    def one_line(row):
        console.print(
            f"iteration {row.iteration}: accuracy {row.accuracy:.3f}  1st-call errors "
            f"{row.first_attempt_error_rate:.3f}  failures/traj {row.failures_per_trajectory:.3f}  "
            f"merges {row.n_shallow} shallow / {row.n_deep} deep  "
            f"({row.collect_s:.0f}+{row.purify_s:.0f}+{row.train_s:.0f} s)")

    rows = _run_job(run_loop, config, resume=resume, on_iteration=one_line, metrics=metrics)
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
    engine: Annotated[str, typer.Option(help="torch | deepspeed (one process; several ranks: `cleaner train` under torchrun).", rich_help_panel="Train")] = "torch",
    deepspeed_config: Annotated[Path | None, typer.Option(help="DeepSpeed JSON: ZeRO stage, offload, precision.", rich_help_panel="Train")] = None,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    log_to: Annotated[list[LogTarget] | None, typer.Option("--log-to", help="Also log every iteration and optimiser step to tensorboard (<run-dir>/tensorboard/) or wandb; repeatable.", show_default=False, rich_help_panel="Logging")] = None,
    wandb_project: Annotated[str, typer.Option(help="W&B project.", rich_help_panel="Logging")] = "cleaner",
    wandb_offline: Annotated[bool, typer.Option("--wandb-offline", help="W&B offline even with an API key (it is offline anyway without one).", rich_help_panel="Logging")] = False,
) -> None:
    """Loop collect -> purify -> train for several iterations, in one process.

    Every option can also come from `--config run.toml` (flags override the file); `--print-config`
    shows the resolved config in that format. The logging options are not part of the config: they
    say where to mirror the metrics, not what the run computes, so a resumed run may change them.
    """
    from cleaner.engine.run_config import ConfigError, read_toml

    flags = _flag_layer(ctx, locals())
    try:
        file_layer = read_toml(config_file) if config_file else {}
    except ConfigError as error:
        raise fail(str(error)) from error
    config = _resolve_run([file_layer, flags], str(config_file or "flags"), resume)
    if print_config:
        from cleaner.engine.run_config import to_toml

        typer.echo(to_toml(config), nl=False)
        return
    from cleaner.engine.tracking import open_loggers

    metrics = _run_job(open_loggers, [target.value for target in log_to or []], Path(config.run_dir),
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
    from cleaner.engine.report import plot_report

    if run_dir.exists() and not resume:
        import shutil

        shutil.rmtree(run_dir)  # the demo always starts clean unless asked to resume
    config = _resolve_run([{"run_dir": str(run_dir), "iterations": iterations,
                            "collect": {"n_prompts": prompts, "group_size": 8}}], "demo", resume)
    rows = _run_and_report(config, resume)
    png = plot_report(rows, run_dir / "report.png")
    warehouse = run_dir / "warehouse"
    console.print(f"\nreport: {png}\nwarehouse: {warehouse}\nTry:")
    for query in DEMO_SQL:
        console.print(f'  cleaner sql -w {warehouse} "{query}"', soft_wrap=True, highlight=False)
    console.print(f"  cleaner report -w {warehouse}   # every figure, and {run_dir / 'report' / 'report.md'}",
                  soft_wrap=True, highlight=False)


@app.command()
def report(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    out: Annotated[Path | None, typer.Option("--out", help="Directory for the PNGs and report.md (default: report/ beside the warehouse).", show_default=False)] = None,
) -> None:
    """Plot a warehouse: accuracy, tool failures, merges, the premise diagnostic, train metrics,
    error types, ablation grids and eval results as PNGs, and report.md embedding them.

    Figures whose data the warehouse lacks are skipped, and report.md says why.
    """
    from cleaner.jobs import report_job
    from cleaner.warehouse import Warehouse

    out = out or warehouse.parent / "report"
    written = _run_job(report_job, Warehouse(warehouse), out)
    for section in written.sections:
        status = section.file or f"skipped: {section.skipped}"
        console.print(f"{section.title}: {status}", soft_wrap=True, highlight=False)
    console.print(f"report: {written.page}")


@app.command()
def bootstrap(
    out: Annotated[Path, typer.Option("--out", help="Model directory to write.")] = Path("assets/tiny-policy"),
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimiser steps.")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Corpus, init and batch-order seed.")] = 0,
    corpus_size: Annotated[int, typer.Option("--corpus-size", min=1, help="Synthetic trajectories.")] = 40_000,
    fail_share: Annotated[float, typer.Option("--fail-share", help="Share of first calls that fail.")] = 0.3,
    failures: Annotated[str, typer.Option("--failures", help="mixed (typos, wrong approaches) | environment (missing functions only: the second policy).")] = "mixed",
    slip_share: Annotated[float, typer.Option("--slip-share", help="Share of trajectories that miscopy one digit of the question in every call.")] = 0.0,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Sequences per step.")] = 32,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Save <out>-checkpoints/step-N every N steps; 0 = off.")] = 0,
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate.")] = 3e-3,
    init_from: Annotated[Path | None, typer.Option("--init-from", exists=True, file_okay=False, help="Continue from this policy (and its tokenizer): the calibration stage.")] = None,
) -> None:
    """Train the tiny default policy into assets/tiny-policy.

    The committed policy took two stages: `cleaner bootstrap --out runs/base --checkpoint-every 250`,
    then `cleaner bootstrap --init-from runs/base-checkpoints/step-1250 --fail-share 0.4 --steps 300
    --lr 1e-3 --corpus-size 12000 --seed 1` (both configs are saved next to the model).
    """
    from cleaner.engine.bootstrap.corpus import CorpusConfig
    from cleaner.engine.bootstrap.sft import BootstrapConfig, bootstrap_policy

    try:
        corpus = CorpusConfig(size=corpus_size, seed=seed, fail_share=fail_share, failures=failures,
                              slip_share=slip_share)
        config = BootstrapConfig(corpus=corpus, steps=steps, batch_size=batch_size, seed=seed, lr=lr,
                                 checkpoint_every=checkpoint_every,
                                 init_from=None if init_from is None else str(init_from))
    except ValueError as error:
        raise fail(str(error)) from error
    result = bootstrap_policy(config, out)
    console.print(f"wrote {result.out_dir} (final loss {result.final_loss:.4f}, "
                  f"{result.tokens_seen} tokens, {result.wall_s:.0f} s)")


@sandbox_app.command("run")
def sandbox_run(
    file: Annotated[Path, typer.Argument(help="Python file to run.")],
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Wall-clock limit in seconds.")] = 4.0,
    stdin: Annotated[Path | None, typer.Option("--stdin", help="File fed to the code's stdin.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run one Python file through the sandbox and print the result.

    Exits 0 whenever the sandbox worked, whatever the code did; non-zero if FILE is missing or the
    sandbox itself failed.
    """
    import dataclasses
    import json

    from rich.table import Table

    from cleaner.engine.chat import format_tool_response
    from cleaner.sandbox import ExecStatus, SandboxConfig, SandboxError, make_sandbox

    for path in (file, stdin):
        if path is not None and not path.is_file():
            raise fail(f"no such file: {path}")
    try:
        config = SandboxConfig(workers=1, timeout_s=timeout_s)
        with make_sandbox(config) as sandbox:
            result = sandbox.run(file.read_text(), stdin.read_text() if stdin else None)
    except (SandboxError, ValueError) as error:
        raise fail(f"sandbox failed: {error}") from error
    if result.status == ExecStatus.INFRA_ERROR:
        raise fail(f"sandbox failed: {result.stderr}")
    if as_json:
        ok = result.status == ExecStatus.OK
        reason = None if ok else str(result.status)
        response = format_tool_response(ok, result.stdout, result.stderr, reason)
        # with the text a model would see, which the sandbox itself does not word
        typer.echo(json.dumps({**dataclasses.asdict(result), "response": response}))
        return
    table = Table(show_header=False, title=str(file))
    for name in ("status", "error_type", "stdout", "stderr", "exec_ms"):
        value = getattr(result, name)
        table.add_row(name, f"{value:.1f}" if name == "exec_ms" else str(value), end_section=True)
    console.print(table)


# ---------------------------------------------------------------------------------------------
# Warehouse commands


class OutputFormat(StrEnum):
    table = "table"
    csv = "csv"
    json = "json"


@app.command()
def sql(
    query: Annotated[str, typer.Argument(help="DuckDB SQL over the views: rollouts, segments, attempts, ...")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    output_format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.table,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file.")] = None,
) -> None:
    """Run DuckDB SQL over the warehouse views.

    Views: rollouts, segments, purified, purify_configs, iterations, train_steps, eval_rollouts,
    eval_segments, eval_runs, and the convenience views attempts (assistant segments with the outcome
    of their call) and failures.
    """
    import duckdb
    import polars as pl

    from cleaner.engine.show import result_table
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
        if output is None:
            console.print(result_table(table))
        else:
            with open(output, "w") as sink:
                Console(file=sink, width=200).print(result_table(table))
        return
    frame = pl.from_arrow(table)
    text = frame.write_csv() if output_format is OutputFormat.csv else frame.write_json()
    if output:
        output.write_text(text)
    else:
        typer.echo(text, nl=False)


@app.command()
def compact(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    dataset: Annotated[str | None, typer.Option(help="One dataset (default: all); segments go with rollouts.")] = None,
    iteration: Annotated[int | None, typer.Option(help="One iteration (default: all).")] = None,
    target_mb: Annotated[float, typer.Option(help="Parts below this size are merged into parts of at most this size.")] = 128.0,
) -> None:
    """Merge each partition's small parts into few, atomically.

    Safe to interrupt: readers see every row once at any moment, and the next compaction finishes
    what an interrupted one left. Writers may keep adding parts meanwhile; a reader that listed the
    parts just before they were merged may have to read again.
    """
    from rich.table import Table

    from cleaner.warehouse.compact import compact as compact_warehouse
    from cleaner.warehouse.parts import WarehouseError

    try:
        result = compact_warehouse(warehouse, dataset, iteration, int(target_mb * 2**20))
    except WarehouseError as exc:
        raise fail(str(exc)) from exc
    table = Table("dataset", "partition", "parts", "rows", "MB before", "MB after")
    for merge in result.merges:
        table.add_row(merge.dataset, merge.partition, str(merge.n_parts), str(merge.n_rows),
                      f"{merge.bytes_before / 2**20:.2f}", f"{merge.bytes_after / 2**20:.2f}")
    if result.merges:
        console.print(table)
    if result.n_leftovers:
        console.print(f"removed {result.n_leftovers} files left by an interrupted compaction")
    merged = sum(merge.n_parts for merge in result.merges)
    console.print(f"merged {merged} parts into {len(result.merges)} in {warehouse}")


@app.command()
def show(
    rollout_id: Annotated[str, typer.Argument(help="The rollout to print.")],
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    gamma: Annotated[float, typer.Option(help="SAAR threshold of the purified view.")] = 0.5,
    similarity_on: Annotated[str, typer.Option(help="code | call.")] = "code",
    view: Annotated[Panels, typer.Option("--view", help="raw | purified | both.")] = Panels.BOTH,
    tokenizer: Annotated[bool, typer.Option(help="Decode with the collecting policy's tokenizer.")] = True,
) -> None:
    """Print one rollout raw (failures red, retries yellow, what SAAR drops struck through) and purified.

    The purified view marks each step's outcome (clean, shallow, deep, mixed, unrecovered, answered),
    each merge's similarity, the row's stats, and this rollout's advantage under every stored config.
    """
    from cleaner.engine.render import View
    from cleaner.engine.show import Decoder, load_decoder, load_inspection, show_rollout
    from cleaner.warehouse import Warehouse, WarehouseError

    saar = _config(View, purified=True, gamma=gamma, similarity_on=similarity_on)
    try:
        inspection = load_inspection(Warehouse(warehouse), rollout_id)
    except WarehouseError as exc:
        raise fail(str(exc)) from exc
    if inspection is None:
        raise fail(f"no rollout {rollout_id!r} in {warehouse}")
    decoder = load_decoder(inspection.model) if tokenizer and view is not Panels.RAW else Decoder(
        None, "--no-tokenizer: text below is the stored segment text, not decoded tokens")
    console.print(show_rollout(inspection, saar, decoder, view))


if __name__ == "__main__":
    app()
