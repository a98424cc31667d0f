"""The paper's comparison in miniature: cleaning strategies against GRPO on the three toy policies.

Each arm is one `cleaner run` command (printed at the start and written into each table), run for N
iterations from the same policy with the same seeds as the baseline. The six arms of the table:
  baseline        --rollback-prob 0 --collect-view raw        GRPO on raw trajectories
  cleaner         --similarity-on call                        CLEANER as the paper ran it (gamma 0.5, p 1)
  cleaner-p0.7    --similarity-on call --rollback-prob 0.7    the reference's 7B setting
  is-gated        --rollback-is-threshold 0.5 --rollback-is-mode mean   the authors' follow-up, per-token IS
  mask            --edit mask                                 SAAR's decisions, failed calls masked, not replaced
  mask-positive   --edit mask --purify-when positive          masked only in above-mean rollouts
(`--arms` also takes mask-deep and mask-deep-positive, the mask arms with every merge deep
(`--gamma 1.5`: the failed turn's reasoning is masked too, not only its call), and the earlier
table's cleaner-code, cleaner-deep, positive, is-gated-sum and negatives.) The toys: mixed (cleaner/assets/tiny-policy: a failed call predicts a wrong answer), env
(cleaner/assets/tiny-policy-env: it does not) and recover (cleaner/assets/tiny-policy-recover: failed calls get
positive credit, since the rollouts that answer without the tool are the ones that lose).

Per toy it writes bench/results/paper_table_<toy>.md and .png: per arm, paired by seed against the
baseline (the arm's mean minus the baseline's mean on the same seed, averaged over seeds, ± their
std), accuracy, failed calls per trajectory, first-call error rate, tokens per trajectory and the
policy's entropy on the trained tokens; the credit of failed calls (the mean advantage of their
tokens under the raw view, docs/architecture.md §4) over iterations; where each arm's accuracy
comes from (clean and recovered rollouts); a per-iteration table; and the iterations as JSON in the
run directory. Runs are resumable: re-run the same command after an interruption.

    python bench/paper_table.py --toys mixed,env,recover --seeds 3 --iterations 10 --prompts 16 \\
        --out runs/paper_table --results bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import time
from pathlib import Path

import polars as pl

from cleaner.config import DEFAULT_POLICY, ENV_POLICY, RECOVER_POLICY, RunConfig
from cleaner.config.flags import command_line, flag_layer
from cleaner.config.layers import RUN_BASE_LAYER, resolve_run_config
from cleaner.loop.iterations import run_loop
from cleaner.warehouse import Warehouse

TOYS = {"mixed": DEFAULT_POLICY, "env": ENV_POLICY, "recover": RECOVER_POLICY}

# The `cleaner run` flags of each arm, beyond the ones every arm shares (arm_flags).
ARMS = {
    "baseline": {"rollback_prob": 0.0, "collect_view": "raw"},
    "cleaner": {"similarity_on": "call"},
    "cleaner-p0.7": {"similarity_on": "call", "rollback_prob": 0.7},
    "is-gated": {"rollback_is_threshold": 0.5, "rollback_is_mode": "mean"},
    "mask": {"edit": "mask"},
    "mask-positive": {"edit": "mask", "purify_when": "positive"},
    "cleaner-code": {},
    "cleaner-deep": {"gamma": 1.5},
    "positive": {"purify_when": "positive"},
    "is-gated-sum": {"rollback_is_threshold": 0.5},
    "negatives": {"negative_samples": True},
    "mask-deep": {"edit": "mask", "gamma": 1.5},
    "mask-deep-positive": {"edit": "mask", "purify_when": "positive", "gamma": 1.5},
}
PAPER_ARMS = ("baseline", "cleaner", "cleaner-p0.7", "is-gated", "mask", "mask-positive")

# What the tables compare, per (toy, arm, seed, iteration): {column: heading}.
METRICS = {"accuracy": "accuracy", "failures_per_trajectory": "failed calls / traj",
           "first_attempt_error_rate": "first-call errors", "tokens_per_trajectory": "tokens / traj",
           "entropy": "entropy on trained tokens"}


def run_dir(args: argparse.Namespace, toy: str, arm: str, seed: int) -> Path:
    return Path(args.out) / toy / arm / f"seed-{seed}"


def arm_flags(args: argparse.Namespace, toy: str, arm: str, seed: int) -> dict:
    return {"run_dir": str(run_dir(args, toy, arm, seed)), "iterations": args.iterations,
            "model": str(args.models[toy]), "prompts": args.prompts, "group_size": args.group_size,
            "lr": args.lr, "seed": seed, **ARMS[arm]}


def arm_config(args: argparse.Namespace, toy: str, arm: str, seed: int) -> RunConfig:
    """Exactly the config `cleaner run` resolves from the arm's flags."""
    return resolve_run_config(RUN_BASE_LAYER, flag_layer(arm_flags(args, toy, arm, seed)))


# ---------------------------------------------------------------------------------------------
# Running the arms and reading their warehouses


def warehouse_metrics(path: Path) -> pl.DataFrame:
    """Per iteration: response tokens per trajectory (the raw trajectory after the prompt) and the
    policy's mean entropy on the trained tokens over the iteration's optimiser steps."""
    connection = Warehouse(path).connect()
    tokens = pl.from_arrow(connection.sql(
        "SELECT iteration, avg(n)::DOUBLE AS tokens_per_trajectory FROM (SELECT iteration, rollout_id, "
        "sum(len(token_ids)) AS n FROM segments WHERE kind <> 'prompt' GROUP BY ALL) GROUP BY ALL").to_arrow_table())
    entropy = pl.from_arrow(connection.sql(
        "SELECT iteration, avg(entropy)::DOUBLE AS entropy FROM train_steps GROUP BY ALL").to_arrow_table())
    push = pl.from_arrow(connection.sql(  # a run purifies one config per iteration: the trained one
        "SELECT iteration, sum(advantage * list_sum(loss_mask)) AS push, sum(list_sum(loss_mask))::DOUBLE AS "
        "trained_tokens FROM purified WHERE negative_seq IS NULL AND NOT infra_fault GROUP BY ALL").to_arrow_table())
    connection.close()
    return tokens.join(entropy, on="iteration", how="left").join(push, on="iteration", how="left")


def run_arms(args: argparse.Namespace) -> pl.DataFrame:
    """Run (or resume) every arm of every toy and seed; one row per (toy, arm, seed, iteration)."""
    records, frames = [], []
    for seed in range(args.seeds):
        for toy in args.toys:
            for arm in args.arms:
                config = arm_config(args, toy, arm, seed)
                started = time.monotonic()
                rows = run_loop(config, resume=True, progress=False)
                logging.info("%s %s seed %d: %d iterations in %.0f s -> %s", toy, arm, seed, len(rows),
                             time.monotonic() - started, config.run_dir)
                records += [{"toy": toy, "arm": arm, "seed": seed, **{k: v for k, v in dataclasses.asdict(r).items()
                                                                     if not k.endswith("_json")}} for r in rows]
                frames.append(warehouse_metrics(Path(config.run_dir) / "warehouse").with_columns(
                    pl.lit(toy).alias("toy"), pl.lit(arm).alias("arm"), pl.lit(seed).alias("seed")))
    frame = pl.DataFrame(records, infer_schema_length=None).unique(
        subset=["toy", "arm", "seed", "iteration"], keep="last")
    extra = pl.concat(frames).with_columns(pl.col("iteration").cast(frame.schema["iteration"]),
                                           pl.col("seed").cast(frame.schema["seed"]))
    return frame.join(extra, on=["toy", "arm", "seed", "iteration"], how="left")


# ---------------------------------------------------------------------------------------------
# Tables


def _arm_order(arms: list[str]) -> pl.Expr:
    """Sort key: the arms in the order given, unknown ones last."""
    return pl.col("arm").replace_strict({arm: i for i, arm in enumerate(arms)}, default=len(arms))


def _last(frame: pl.DataFrame, last: int) -> pl.DataFrame:
    return frame.filter(pl.col("iteration") > frame["iteration"].max() - last)


def paired(frame: pl.DataFrame, arms: list[str], last: int) -> pl.DataFrame:
    """Per arm, over the last `last` iterations: each metric's mean over seeds of each seed's mean,
    and its difference to the baseline of the same seed (mean and std over seeds); the seeds on which
    the arm's accuracy beat the baseline's."""
    per_seed = _last(frame, last).group_by("arm", "seed").agg(pl.col(name).mean() for name in METRICS)
    base = per_seed.filter(pl.col("arm") == "baseline").select("seed", *(pl.col(m).alias(f"base_{m}") for m in METRICS))
    differences = per_seed.join(base, on="seed").with_columns(
        (pl.col(m) - pl.col(f"base_{m}")).alias(f"d_{m}") for m in METRICS)
    return (differences.group_by("arm")
            .agg(*(pl.col(m).mean() for m in METRICS), *(pl.col(f"d_{m}").mean() for m in METRICS),
                 *(pl.col(f"d_{m}").std().alias(f"sd_{m}") for m in METRICS),
                 (pl.col("d_accuracy") > 0).sum().alias("seeds_above"), pl.len().alias("seeds"))
            .sort(_arm_order(arms)))


def paired_markdown(table: pl.DataFrame, last: int) -> str:
    headings = " | ".join(f"{h}, last {last} | vs baseline" for h in METRICS.values())
    lines = [f"| arm | {headings} | seeds above (accuracy) |", "| --- |" + " --- | --- |" * len(METRICS) + " --- |"]
    for r in table.iter_rows(named=True):
        cells = []
        for m in METRICS:
            digits = 1 if m == "tokens_per_trajectory" else 3
            value = "-" if r[m] is None else f"{r[m]:.{digits}f}"
            delta = "-" if r[f"d_{m}"] is None else f"{r[f'd_{m}']:+.{digits}f} ± {r[f'sd_{m}'] or 0:.{digits}f}"
            cells += [value, delta]
        lines.append(f"| {r['arm']} | " + " | ".join(cells) + f" | {r['seeds_above']}/{r['seeds']} |")
    return "\n".join(lines)


def credit_markdown(frame: pl.DataFrame, arms: list[str]) -> str:
    """The credit of failed calls per iteration (mean over seeds): the mean advantage of failed-call
    tokens under the raw view, and in brackets the share of them in positive-advantage rollouts."""
    mean = (frame.group_by("arm", "iteration")
            .agg(pl.col("failed_call_advantage").mean(), pl.col("failed_call_positive_share").mean()))
    iterations = sorted(frame["iteration"].unique().to_list())
    lines = ["| arm | " + " | ".join(f"it {i}" for i in iterations) + " |", "| --- |" + " --- |" * len(iterations)]
    for arm in arms:
        cells = []
        for i in iterations:
            row = mean.filter((pl.col("arm") == arm) & (pl.col("iteration") == i))
            value = None if row.is_empty() else row.row(0, named=True)
            cells.append("-" if value is None or value["failed_call_advantage"] is None else
                         f"{value['failed_call_advantage']:+.3f} ({value['failed_call_positive_share']:.2f})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def premise_markdown(frame: pl.DataFrame, arms: list[str], last: int) -> str:
    """Where each arm's accuracy comes from over the last `last` iterations (seeds pooled)."""
    total = pl.col("clean_rollouts") + pl.col("recovered_rollouts") + pl.col("unrecovered_rollouts")

    def weighted(name: str) -> pl.Expr:  # accuracy over rollouts, not a mean of iteration means
        return ((pl.col(f"{name}_accuracy").fill_null(0) * pl.col(f"{name}_rollouts")).sum()
                / pl.col(f"{name}_rollouts").sum()).alias(f"{name}_acc")

    table = (_last(frame, last).group_by("arm")
             .agg((pl.col("clean_rollouts").sum() / total.sum()).alias("clean_share"), weighted("clean"),
                  (pl.col("recovered_rollouts").sum() / total.sum()).alias("recovered_share"), weighted("recovered"),
                  ((pl.col("recovered_advantage").fill_null(0) * pl.col("recovered_rollouts")).sum()
                   / pl.col("recovered_rollouts").sum()).alias("recovered_adv"),
                  (pl.col("push").sum() / pl.col("trained_tokens").sum()).alias("push"))
             .sort(_arm_order(arms)))
    lines = [f"| arm (last {last} iterations) | clean: share, accuracy | recovered: share, accuracy | "
             "recovered rollouts' mean advantage | mean advantage per trained token |", "| --- | --- | --- | --- | --- |"]
    for r in table.iter_rows(named=True):
        lines.append(f"| {r['arm']} | {r['clean_share']:.3f}, {r['clean_acc'] or 0:.3f} | "
                     f"{r['recovered_share']:.3f}, {r['recovered_acc'] or 0:.3f} | {r['recovered_adv'] or 0:+.3f} | "
                     f"{r['push'] or 0:+.4f} |")
    return "\n".join(lines)


def per_iteration_markdown(frame: pl.DataFrame, arms: list[str]) -> str:
    mean = frame.group_by("arm", "iteration").agg(pl.col("accuracy").mean(), pl.col("accuracy").std().alias("sd"),
                                                  pl.col("failures_per_trajectory").mean())
    lines = ["| iteration | " + " | ".join(f"{arm} acc | {arm} fail/traj" for arm in arms) + " |",
             "| --- |" + " --- | --- |" * len(arms)]
    for i in sorted(frame["iteration"].unique().to_list()):
        cells = []
        for arm in arms:
            row = mean.filter((pl.col("arm") == arm) & (pl.col("iteration") == i))
            if row.is_empty():
                cells += ["-", "-"]
                continue
            r = row.row(0, named=True)
            cells += [f"{r['accuracy']:.3f} ± {r['sd'] or 0:.3f}", f"{r['failures_per_trajectory']:.3f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def toy_markdown(frame: pl.DataFrame, args: argparse.Namespace, toy: str) -> str:
    commands = "\n".join(f"{arm}: {command_line(arm_flags(args, toy, arm, 0))}" for arm in args.arms)
    seeds = frame["seed"].n_unique()
    return "\n\n".join([
        f"# {toy}: {args.models[toy]}, {seeds} seed(s) x {frame['iteration'].max() + 1} iterations, "
        f"{args.prompts} x {args.group_size} rollouts per iteration",
        f"One `cleaner run` per arm (seed 0; the other seeds differ only by `--seed`):\n\n```\n{commands}\n```",
        "## Paired by seed against the baseline\n\n" + paired_markdown(paired(frame, args.arms, args.last), args.last),
        "## The credit of failed calls per iteration: mean advantage of their tokens (raw view), and the "
        "share of them in positive-advantage rollouts\n\n" + credit_markdown(frame, args.arms),
        "## Where the accuracy comes from\n\n" + premise_markdown(frame, args.arms, args.last),
        "## Accuracy and failed calls per trajectory per iteration (mean ± std over seeds)\n\n"
        + per_iteration_markdown(frame, args.arms),
    ]) + "\n"


# ---------------------------------------------------------------------------------------------
# Plot


PANELS = {**METRICS, "failed_call_advantage": "failed-call credit (mean advantage)"}


def plot(frame: pl.DataFrame, arms: list[str], path: Path, title: str) -> None:
    import matplotlib  # matplotlib costs start-up time: loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (start-up time, as above)
    from matplotlib.ticker import MaxNLocator  # (start-up time, as above)

    figure, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    summary = frame.group_by("arm", "iteration").agg(
        *(pl.col(c).mean().alias(f"{c}_mean") for c in PANELS), *(pl.col(c).std().alias(f"{c}_std") for c in PANELS))
    for axis, (column, heading) in zip(axes.flat, PANELS.items(), strict=True):
        for arm in arms:
            data = summary.filter(pl.col("arm") == arm).sort("iteration")
            x = data["iteration"].to_list()
            mean = data[f"{column}_mean"].cast(pl.Float64).fill_null(float("nan")).to_numpy()
            std = data[f"{column}_std"].cast(pl.Float64).fill_null(0).to_numpy()
            style = {"color": "black", "linestyle": "--", "zorder": 5} if arm == "baseline" else {}
            axis.plot(x, mean, marker="o", markersize=3, label=arm, **style)
            axis.fill_between(x, mean - std, mean + std, alpha=0.12)
        axis.set_title(heading)
        axis.set_xlabel("iteration")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
    axes.flat[-1].axhline(0, color="grey", linewidth=1)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title + " (mean ± std over seeds)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toys", default=",".join(TOYS), help="comma-separated subset of " + ",".join(TOYS))
    parser.add_argument("--model", default=None, help="one policy instead of the toys (named by its directory)")
    parser.add_argument("--arms", default=",".join(PAPER_ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default="runs/paper_table", help="run directories: <out>/<toy>/<arm>/seed-<s>")
    parser.add_argument("--results", default="bench/results", help="where paper_table_<toy>.md and .png go")
    parser.add_argument("--last", type=int, default=5, help="iterations averaged in the paired table")
    args = parser.parse_args()
    args.arms = [arm for arm in args.arms.split(",") if arm]
    if set(args.arms) - set(ARMS) or "baseline" not in args.arms:
        parser.error(f"arms must include baseline and come from {list(ARMS)}; got {args.arms}")
    if args.model is not None:
        args.models = {Path(args.model).name: Path(args.model)}
    else:
        args.models = {toy: TOYS[toy] for toy in args.toys.split(",") if toy}
        if set(args.models) - set(TOYS) or not args.models:
            parser.error(f"toys come from {list(TOYS)}; got {args.toys}")
    args.toys = list(args.models)
    # a path under the working directory is written relative to it, so the printed commands are portable
    args.models = {toy: Path(os.path.relpath(path)) if Path.cwd() in path.resolve().parents else path
                   for toy, path in args.models.items()}
    args.last = min(args.last, args.iterations)
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for toy in args.toys:
        for arm in args.arms:
            logging.info("%s %s, seed 0: %s", toy, arm, command_line(arm_flags(args, toy, arm, 0)))
    frame = run_arms(args)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    for toy in args.toys:
        mine = frame.filter(pl.col("toy") == toy)
        Path(args.out, toy).mkdir(parents=True, exist_ok=True)
        mine.write_json(Path(args.out) / toy / "iterations.json")
        text = toy_markdown(mine, args, toy)
        (results / f"paper_table_{toy}.md").write_text(text)
        plot(mine, args.arms, results / f"paper_table_{toy}.png", f"{toy}: {args.models[toy]}")
        print(text)


if __name__ == "__main__":
    main()
