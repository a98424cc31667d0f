"""The paper's comparison in miniature: cleaning strategies against GRPO on the three toy policies.

Each arm is one `cleaner run` command (printed at the start and written into each table), run for N
iterations from the same policy with the same seeds as the baseline. The six arms of the table:
  baseline        --rollback-prob 0 --collect-view raw        GRPO on raw trajectories
  cleaner         --similarity-on call                        CLEANER as the paper ran it (gamma 0.5, p 1)
  cleaner-p0.7    --similarity-on call --rollback-prob 0.7    the reference's 7B setting
  is-gated        --rollback-is-threshold 0.5 --rollback-is-mode mean   the authors' follow-up, per-token IS
  mask            --edit mask                                 SAAR's decisions, failed calls masked, not replaced
  mask-positive   --edit mask --purify-when positive          masked only in above-mean rollouts
(and the field's error-aware selections, each on raw trajectories: roc, GRPO-RoC collecting
groups of 2 x --group-size and training --group-size of each, `--down-sample roc`; uniform, the same
sizes chosen uniformly, its control; void-turn, SimpleTIR's `--void-turn-filter`)
(`--arms` also takes mask-deep and mask-deep-positive, the mask arms with every merge deep
(`--gamma 1.5`: the failed turn's reasoning is masked too, not only its call), and the earlier
table's cleaner-code, cleaner-deep, positive, is-gated-sum and negatives.) The toys: mixed
(cleaner/assets/tiny-policy: a failed call predicts a wrong answer), env (cleaner/assets/tiny-policy-env:
it does not) and recover (cleaner/assets/tiny-policy-recover: failed calls get positive credit, since
the rollouts that answer without the tool are the ones that lose).

`--max-response-tokens`, `--max-new-tokens`, `--max-turns` and `--max-retries` give every arm the
same budget (bench/budget_binding.py measures where one binds). The response budget is measured on
the context the agent loop renders, so in the arms that collect with SAAR's view (cleaner,
is-gated) a fixed failure is rolled back out of the budget, as in the reference; the baseline and
the mask arms collect raw, where it stays in.

Per toy it writes bench/results/<name>_<toy>.md and .png: per arm, paired by seed against the
baseline (the arm's mean minus the baseline's mean on the same seed, averaged over seeds, ± their
std), accuracy, failed calls per trajectory, the share of rollouts out of budget (finish_reason
max_tokens or max_turns), first-call error rate, tokens per trajectory and the policy's entropy on
the trained tokens; the iterations each arm needs to reach the baseline's final accuracy, and the
ratio to the baseline's own (`steps_to_target`); with `--heldout-problems`, the accuracy of each
arm's last checkpoint on toy problems no run trained on, through `cleaner eval` (bench/heldout.py);
the credit of failed calls (the mean advantage of their tokens under the raw view,
docs/architecture.md §4) over iterations; where each arm's accuracy comes from (clean and recovered
rollouts); a per-iteration table; and the iterations as JSON in the run directory. Runs and
evaluations are resumable: re-run the same command after an interruption.

    python bench/paper_table.py --toys mixed,env,recover --seeds 3 --iterations 10 --prompts 16 \\
        --out runs/paper_table --results bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import shlex
import sys
import time
from pathlib import Path

import polars as pl
from heldout import (  # bench/, beside this script
    OUT_OF_BUDGET,
    check_disjoint,
    eval_command,
    eval_config,
    heldout_frame,
    heldout_markdown,
    heldout_paired,
    run_evals,
    write_heldout,
)
from paper_plot import plot  # bench/, beside this script

from cleaner.config import DEFAULT_POLICY, ENV_POLICY, RECOVER_POLICY, RunConfig
from cleaner.config.flags import command_line, flag_layer, option_of
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
    # the field's error-aware selections on raw trajectories; the two down-sampling arms collect
    # groups twice the table's --group-size and train that many rows of each (arm_flags)
    "roc": {"rollback_prob": 0.0, "collect_view": "raw", "down_sample": "roc"},
    "uniform": {"rollback_prob": 0.0, "collect_view": "raw", "down_sample": "uniform"},
    "void-turn": {"rollback_prob": 0.0, "collect_view": "raw", "void_turn_filter": True},
}
PAPER_ARMS = ("baseline", "cleaner", "cleaner-p0.7", "is-gated", "mask", "mask-positive")

# What the tables compare, per (toy, arm, seed, iteration): {column: heading}.
METRICS = {"accuracy": "accuracy", "failures_per_trajectory": "failed calls / traj",
           "truncation_rate": "out of budget", "first_attempt_error_rate": "first-call errors",
           "tokens_per_trajectory": "tokens / traj", "entropy": "entropy on trained tokens"}
# The budget flags a table may set; unset, every arm runs with `cleaner run`'s defaults.
BUDGET_FLAGS = ("max_response_tokens", "max_new_tokens", "max_turns", "max_retries")


def run_dir(args: argparse.Namespace, toy: str, arm: str, seed: int) -> Path:
    return Path(args.out) / toy / arm / f"seed-{seed}"


def arm_flags(args: argparse.Namespace, toy: str, arm: str, seed: int) -> dict:
    """The arm's `cleaner run` flags; a down-sampling arm collects 2N and trains N (GRPO-RoC's 32 -> 16)."""
    sampled = {"group_size": 2 * args.group_size, "down_sample_to": args.group_size} if "down_sample" in ARMS[arm] else {}
    return {"run_dir": str(run_dir(args, toy, arm, seed)), "iterations": args.iterations,
            "model": str(args.models[toy]), "prompts": args.prompts, "group_size": args.group_size,
            "lr": args.lr, "seed": seed, **args.budget, **ARMS[arm], **sampled}


def arm_config(args: argparse.Namespace, toy: str, arm: str, seed: int) -> RunConfig:
    """Exactly the config `cleaner run` resolves from the arm's flags."""
    return resolve_run_config(RUN_BASE_LAYER, flag_layer(arm_flags(args, toy, arm, seed)))


# ---------------------------------------------------------------------------------------------
# Running the arms and reading their warehouses


def warehouse_metrics(path: Path) -> pl.DataFrame:
    """Per iteration: response tokens per trajectory (the raw trajectory after the prompt), the
    share of rollouts that ran out of budget before answering (finish_reason max_tokens or
    max_turns), and the policy's mean entropy on the trained tokens over the iteration's optimiser
    steps."""
    connection = Warehouse(path).connect()
    budget = pl.from_arrow(connection.sql(
        f"SELECT iteration, avg((finish_reason IN {OUT_OF_BUDGET})::DOUBLE) AS truncation_rate "
        "FROM rollouts GROUP BY ALL").to_arrow_table())
    tokens = pl.from_arrow(connection.sql(
        "SELECT iteration, avg(n)::DOUBLE AS tokens_per_trajectory FROM (SELECT iteration, rollout_id, "
        "sum(len(token_ids)) AS n FROM segments WHERE kind <> 'prompt' GROUP BY ALL) GROUP BY ALL").to_arrow_table())
    entropy = pl.from_arrow(connection.sql(
        "SELECT iteration, avg(entropy)::DOUBLE AS entropy FROM train_steps GROUP BY ALL").to_arrow_table())
    push = pl.from_arrow(connection.sql(  # a run purifies one config per iteration: the trained one
        "SELECT iteration, sum(advantage * list_sum(loss_mask)) AS push, sum(list_sum(loss_mask))::DOUBLE AS "
        "trained_tokens FROM purified WHERE negative_seq IS NULL AND NOT infra_fault GROUP BY ALL").to_arrow_table())
    connection.close()
    return (tokens.join(budget, on="iteration", how="left").join(entropy, on="iteration", how="left")
            .join(push, on="iteration", how="left"))


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
        subset=["toy", "arm", "seed", "iteration"], keep="last").filter(
        pl.col("iteration") < args.iterations)  # a run directory of a longer run holds more
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


def steps_to_target(frame: pl.DataFrame, window: int = 3, final: int = 3) -> pl.DataFrame:
    """Per (arm, seed): how many iterations the arm needs to reach the baseline's final accuracy.

    target: the mean of the baseline's accuracy over its last `final` iterations, seed by seed.
    steps: the first iteration i (>= window - 1) at which the mean of the arm's accuracy over
    iterations i - window + 1 .. i reaches the target; null if no window does. The policy that
    collected iteration i had been trained for i iterations, so i counts training iterations.
    ratio: steps over the baseline's own steps on the same seed (the paper's "about 1/3").
    Every (arm, seed) must hold the same consecutive iterations."""
    last = frame["iteration"].max()
    target = (frame.filter((pl.col("arm") == "baseline") & (pl.col("iteration") > last - final))
              .group_by("seed").agg(pl.col("accuracy").mean().alias("target")))
    windows = frame.sort("iteration").with_columns(
        pl.col("accuracy").rolling_mean(window).over("arm", "seed").alias("window_accuracy"))
    # a tolerance, so that the baseline's last window reaches its own target whatever the summation order
    reached = windows.join(target, on="seed").filter(pl.col("window_accuracy") >= pl.col("target") - 1e-9)
    first = reached.group_by("arm", "seed").agg(pl.col("iteration").min().alias("steps"))
    base = first.filter(pl.col("arm") == "baseline").select("seed", pl.col("steps").alias("baseline_steps"))
    return (frame.select("arm", "seed").unique().join(target, on="seed")
            .join(first, on=["arm", "seed"], how="left").join(base, on="seed", how="left")
            .with_columns(pl.when(pl.col("baseline_steps") > 0)  # --window 1 can reach it at iteration 0
                          .then(pl.col("steps") / pl.col("baseline_steps")).alias("ratio"))
            .sort("arm", "seed"))


def _joined(rows: pl.DataFrame, column: str, spell) -> str:
    """A column's values, each spelled by `spell`, joined with ' / ' (one per seed)."""
    return " / ".join(spell(v) for v in rows[column].to_list())


def steps_markdown(steps: pl.DataFrame, arms: list[str], last: int) -> str:
    """Per arm: the iterations to target on each seed (`>last` where never), the baseline's, the
    ratios and their mean ± std over the seeds on which the arm reached the target."""
    lines = ["| arm | target per seed | iterations to target per seed | baseline's | ratio per seed | "
             "ratio, mean ± std | seeds reached |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm in arms:
        rows = steps.filter(pl.col("arm") == arm).sort("seed")
        if rows.is_empty():
            continue
        each = functools.partial(_joined, rows)
        reached = rows.filter(pl.col("ratio").is_not_null())["ratio"]
        spread = "-" if reached.std() is None else f"{reached.std():.2f}"  # one seed: no spread
        summary = "-" if reached.is_empty() else f"{reached.mean():.2f} ± {spread}"
        lines.append(
            f"| {arm} | {each('target', lambda v: f'{v:.3f}')} | "
            f"{each('steps', lambda v: f'>{last}' if v is None else str(v))} | "
            f"{each('baseline_steps', lambda v: '-' if v is None else str(v))} | "
            f"{each('ratio', lambda v: '-' if v is None else f'{v:.2f}')} | {summary} | {len(reached)}/{len(rows)} |")
    return "\n".join(lines)


def paired_markdown(table: pl.DataFrame, last: int) -> str:
    headings = " | ".join(f"{h}, last {last} | vs baseline" for h in METRICS.values())
    lines = [f"| arm | {headings} | seeds above (accuracy) |", "| --- |" + " --- | --- |" * len(METRICS) + " --- |"]
    for r in table.iter_rows(named=True):
        cells = []
        for m in METRICS:
            digits = 1 if m == "tokens_per_trajectory" else 3
            value = "-" if r[m] is None else f"{r[m]:.{digits}f}"
            spread = "-" if r[f"sd_{m}"] is None else f"{r[f'sd_{m}']:.{digits}f}"  # one seed: no spread
            delta = "-" if r[f"d_{m}"] is None else f"{r[f'd_{m}']:+.{digits}f} ± {spread}"
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
                                                  pl.col("failures_per_trajectory").mean(),
                                                  pl.col("truncation_rate").mean())
    lines = ["| iteration | " + " | ".join(f"{arm} acc | {arm} fail/traj | {arm} out of budget" for arm in arms) + " |",
             "| --- |" + " --- | --- | --- |" * len(arms)]
    for i in sorted(frame["iteration"].unique().to_list()):
        cells = []
        for arm in arms:
            row = mean.filter((pl.col("arm") == arm) & (pl.col("iteration") == i))
            if row.is_empty():
                cells += ["-", "-", "-"]
                continue
            r = row.row(0, named=True)
            cells += [f"{r['accuracy']:.3f} ± {r['sd'] or 0:.3f}", f"{r['failures_per_trajectory']:.3f}",
                      "-" if r["truncation_rate"] is None else f"{r['truncation_rate']:.3f}"]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def toy_markdown(frame: pl.DataFrame, args: argparse.Namespace, toy: str, heldout: str = "") -> str:
    commands = "\n".join(f"{arm}: {command_line(arm_flags(args, toy, arm, 0))}" for arm in args.arms)
    seeds = frame["seed"].n_unique()
    last_iteration = frame["iteration"].max()
    budget = ", ".join(f"`{option_of(k)} {v}`" for k, v in args.budget.items()) or "`cleaner run`'s defaults"
    sections = [
        f"# {toy}: {args.models[toy]}, {seeds} seed(s) x {last_iteration + 1} iterations, "
        f"{args.prompts} x {args.group_size} rollouts per iteration; budget: {budget}",
        f"One `cleaner run` per arm (seed 0; the other seeds differ only by `--seed`), all run by\n\n"
        f"```\n{args.command}\n```\n\n```\n{commands}\n```",
        "## Paired by seed against the baseline\n\n" + paired_markdown(paired(frame, args.arms, args.last), args.last),
        f"## Iterations to the baseline's final accuracy\n\nTarget: the baseline's mean accuracy over iterations "
        f"{last_iteration - args.final + 1}-{last_iteration}, seed by seed. Iterations to target: the last iteration "
        f"of the first {args.window}-iteration window whose mean accuracy reaches it (`>{last_iteration}`: never); "
        "the ratio is to the baseline's own on the same seed.\n\n"
        + steps_markdown(steps_to_target(frame, args.window, args.final), args.arms, last_iteration),
    ]
    if heldout:
        sections.append(heldout)
    sections += [
        "## The credit of failed calls per iteration: mean advantage of their tokens (raw view), and the "
        "share of them in positive-advantage rollouts\n\n" + credit_markdown(frame, args.arms),
        "## Where the accuracy comes from\n\n" + premise_markdown(frame, args.arms, args.last),
        "## Accuracy, failed calls per trajectory and the share out of budget per iteration (mean ± std over "
        "seeds)\n\n" + per_iteration_markdown(frame, args.arms),
    ]
    return "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------------------------
# Held-out problems (bench/heldout.py)


def evaluate_heldout(args: argparse.Namespace, toy: str, frame: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """The initial policy and each (arm, seed)'s last checkpoint on the held-out problems, checked
    disjoint from every prompt the runs trained on; the rows and the table's section."""
    data = Path(args.out) / "heldout_toy.parquet"
    write_heldout(data, args.heldout_problems)
    check = check_disjoint(args.heldout_problems, [run_dir(args, toy, arm, seed) / "warehouse"
                                                   for arm in args.arms for seed in range(args.seeds)])
    if check.in_training or check.in_corpus:
        raise SystemExit(f"error: held-out problems were trained on: {check.text()}")
    last = frame.filter(pl.col("iteration") == pl.col("iteration").max())
    labels = {str(args.models[toy]): ("initial", None)}
    labels |= {row["policy_out"]: (row["arm"], row["seed"]) for row in last.iter_rows(named=True)}
    config = eval_config(list(labels), data, arm_config(args, toy, "baseline", 0).collect, args.heldout_samples)
    warehouse = Path(args.out) / toy / "heldout"
    rows = heldout_frame(warehouse, labels, run_evals(warehouse, config))
    text = "\n\n".join([
        "## Held-out problems: the last checkpoint of each arm and seed",
        f"{check.text()} Each checkpoint answers each problem {args.heldout_samples} times with the raw context "
        "(a failed call uses up budget, for every arm alike) and with SAAR's (the paper's test time: a fixed "
        "failure is rolled back out of the context); `initial` is the policy every arm started from. Paired by "
        "seed as above. The problems are written by bench/heldout.py (`write_heldout`); one checkpoint's "
        f"evaluation:\n\n```\n{eval_command(config, warehouse)}\n```",
        heldout_markdown(heldout_paired(rows, args.arms)),
    ])
    return rows, text


# ---------------------------------------------------------------------------------------------
# Plot (bench/paper_plot.py)


PANELS = {**METRICS, "failed_call_advantage": "failed-call credit (mean advantage)"}


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
    for name in BUDGET_FLAGS:
        parser.add_argument(option_of(name), type=int, default=None, help="as `cleaner run`'s; unset: its default")
    parser.add_argument("--out", default="runs/paper_table", help="run directories: <out>/<toy>/<arm>/seed-<s>")
    parser.add_argument("--results", default="bench/results", help="where <name>_<toy>.md and .png go")
    parser.add_argument("--name", default="paper_table", help="the results' file names: <name>_<toy>.md and .png")
    parser.add_argument("--last", type=int, default=5, help="iterations averaged in the paired table")
    parser.add_argument("--window", type=int, default=3, help="iterations averaged to decide a target is reached")
    parser.add_argument("--final", type=int, default=3, help="the baseline's last iterations that make the target")
    parser.add_argument("--heldout-problems", type=int, default=0,
                        help="held-out toy problems each last checkpoint answers (bench/heldout.py); 0: none")
    parser.add_argument("--heldout-samples", type=int, default=2, help="samples per held-out problem")
    args = parser.parse_args()
    args.command = "python " + " ".join(shlex.quote(word) for word in sys.argv)
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
    args.budget = {name: getattr(args, name) for name in BUDGET_FLAGS if getattr(args, name) is not None}
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
        heldout, section = evaluate_heldout(args, toy, mine) if args.heldout_problems else (None, "")
        text = toy_markdown(mine, args, toy, section)
        (results / f"{args.name}_{toy}.md").write_text(text)
        plot(mine, PANELS, args.arms, results / f"{args.name}_{toy}.png", f"{toy}: {args.models[toy]}", heldout)
        print(text)


if __name__ == "__main__":
    main()
