"""The phase commands: collect, eval, purify, ablate, train.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import (
    DEFAULT_WAREHOUSE,
    BackendOpt,
    DeviceOpt,
    DpoBetaOpt,
    DpoCapOpt,
    DpoRatioOpt,
    IsModeOpt,
    IsThresholdOpt,
    LogTarget,
    MaxNewTokensOpt,
    MaxTurnsOpt,
    ModelOpt,
    NegativeSamplesOpt,
    SeedOpt,
    SglangUrlOpt,
    ShardOpt,
    WandbOfflineOpt,
    WandbProjectOpt,
    WarehouseOpt,
    app,
    build_config,
    call_job,
    console,
    fail,
    floats,
    parse_shard,
    words,
)
from cleaner.config import DEFAULT_POLICY

SANDBOX_FLAGS = {"timeout_s": "--sandbox-timeout-s", "workers": "--sandbox-workers"}  # SandboxConfig's


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
    truncate_prompts: Annotated[bool, typer.Option(help="A prompt too long for the model's context with the response budget keeps its last tokens (verl's truncation=left); default: an error naming the row.")] = False,
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
    from cleaner.config import CollectConfig, SandboxConfig
    from cleaner.engine.collect.job import CollectRequest, collect_job
    from cleaner.report.tables import summary_table
    from cleaner.warehouse import Warehouse

    share = parse_shard(shard)
    sandbox = build_config(SandboxConfig, SANDBOX_FLAGS, timeout_s=sandbox_timeout_s, workers=sandbox_workers)
    config = build_config(
        CollectConfig, {"n_prompts": "--prompts"}, model=model, data=str(data) if data else None, prompt_style=prompt_style, iteration=iteration,
        n_prompts=prompts, group_size=group_size, max_turns=max_turns, max_retries=max_retries,
        max_new_tokens=max_new_tokens, max_response_tokens=max_response_tokens, truncate_prompts=truncate_prompts,
        temperature=temperature, collect_view=collect_view, gamma=gamma, rollback_prob=rollback_prob,
        similarity_on=similarity_on, rollback_is_threshold=rollback_is_threshold,
        rollback_is_mode=rollback_is_mode, seed=seed,
        batch_rollouts=batch_rollouts, backend=backend, sglang_url=sglang_url, device=device,
        sandbox=sandbox,
    )
    outcome = call_job(collect_job, Warehouse(warehouse), CollectRequest(config, share, resume))
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
    from cleaner.config import EvalConfig, SandboxConfig
    from cleaner.engine.eval.job import eval_job
    from cleaner.report.tables import eval_records, eval_scalars, eval_table
    from cleaner.report.tracking import open_loggers
    from cleaner.warehouse import Warehouse

    settings = tuple(setting for setting, given in ((True, saar), (False, no_saar)) if given) or (True,)
    config = build_config(
        EvalConfig, {"models": "--model", "datasets": "--dataset", "saar": "--saar/--no-saar"}, models=tuple(model), datasets=_named_datasets(dataset), saar=settings, n=n,
        prompt_style=prompt_style, limit=limit, temperature=temperature, top_p=top_p, max_turns=max_turns,
        max_new_tokens=max_new_tokens or max_response_tokens, max_response_tokens=max_response_tokens,
        seed=seed, batch_rollouts=batch_rollouts, backend=backend, sglang_url=sglang_url, device=device,
        test_timeout_s=test_timeout_s,
        sandbox=build_config(SandboxConfig, SANDBOX_FLAGS, workers=sandbox_workers),
    )
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


def _purify_configs(gammas, probs, similarity, when, taus=(0.0,), edits=("replace",), **fixed) -> list:
    """Every combination of the grid axes, with the `fixed` PurifyConfig fields."""
    from itertools import product

    from cleaner.config import PurifyConfig

    return [
        build_config(PurifyConfig, gamma=g, rollback_prob=p, similarity_on=s, purify_when=w,
                     rollback_is_threshold=tau, edit=edit, **fixed)
        for g, p, s, w, tau, edit in product(gammas, probs, similarity, when, taus, edits)
    ]



@app.command()
def purify(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to purify.")] = 0,
    gamma: Annotated[float, typer.Option(help="SAAR: shallow merge iff similarity >= gamma.")] = 0.5,
    rollback_prob: Annotated[float, typer.Option(help="p: SAAR applies iff rollback_draw < p.")] = 1.0,
    similarity_on: Annotated[str, typer.Option(help="code (default) | call (the reference).")] = "code",
    purify_when: Annotated[str, typer.Option(help="always (the paper) | positive.")] = "always",
    edit: Annotated[str, typer.Option(help="replace (CLEANER: SAAR's sequence) | mask (the raw sequence, what replace drops untrained).")] = "replace",
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
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.warehouse import Warehouse

    share = parse_shard(shard)
    configs = _purify_configs([gamma], [rollback_prob], [similarity_on], [purify_when], [rollback_is_threshold],
                              [edit], rollback_is_mode=rollback_is_mode, negative_samples=negative_samples,
                              dpo_beta=dpo_beta, dpo_max_adjustment_ratio=dpo_max_adjustment_ratio,
                              dpo_cap=dpo_cap)
    request = PurifyRequest(iteration, configs, share, backend_kind=backend, sglang_url=sglang_url, device=device)
    outcome = call_job(purify_job, Warehouse(warehouse), request)
    _print_purify(outcome)


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


@app.command()
def ablate(
    warehouse: WarehouseOpt = DEFAULT_WAREHOUSE,
    iteration: Annotated[int, typer.Option(help="Iteration to replay.")] = 0,
    gamma: Annotated[str, typer.Option(help="Comma-separated gammas.")] = "0.3,0.5,0.7",
    rollback_prob: Annotated[str, typer.Option(help="Comma-separated p values.")] = "0.7,1.0",
    similarity_on: Annotated[str, typer.Option(help="Comma-separated: code,call.")] = "code",
    purify_when: Annotated[str, typer.Option(help="Comma-separated: always,positive.")] = "always",
    edit: Annotated[str, typer.Option(help="Comma-separated: replace,mask.")] = "replace",
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
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.warehouse import Warehouse

    share = parse_shard(shard)
    configs = _purify_configs(floats(gamma, "--gamma"), floats(rollback_prob, "--rollback-prob"),
                              words(similarity_on, "--similarity-on"), words(purify_when, "--purify-when"),
                              floats(rollback_is_threshold, "--rollback-is-threshold"), words(edit, "--edit"),
                              rollback_is_mode=rollback_is_mode, negative_samples=negative_samples, dpo_beta=dpo_beta,
                              dpo_max_adjustment_ratio=dpo_max_adjustment_ratio, dpo_cap=dpo_cap)
    request = PurifyRequest(iteration, configs, share, backend_kind=backend, sglang_url=sglang_url, device=device)
    outcome = call_job(purify_job, Warehouse(warehouse), request)
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
    from cleaner.config import TrainConfig
    from cleaner.engine.train.job import TrainRequest, train_job
    from cleaner.warehouse import Warehouse

    config = build_config(TrainConfig, lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay,
                     mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
                     epochs=epochs, kl_coef=kl_coef, truncated_is=truncated_is,
                     dynamic_sampling=dynamic_sampling, engine=engine,
                     deepspeed_config=str(deepspeed_config) if deepspeed_config else None, device=device)
    result = call_job(train_job, Warehouse(warehouse), TrainRequest(iteration, config_id, policy, out, config)).result
    if not result.main_process:  # another DeepSpeed rank: rank 0 reports
        return
    steps = result.steps
    if steps:
        last = steps[-1]
        console.print(f"{len(steps)} steps; last loss {last.loss:.4f} kl {last.approx_kl:.4f} "
                      f"clip {last.clip_fraction:.3f}")
    console.print(f"checkpoint -> {out}")


