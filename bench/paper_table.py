"""The paper's comparison in miniature, on one toy policy: eight arms, same seeds, same start.

Each arm is one `cleaner run` command (printed at the start) run for N iterations:
  baseline       --rollback-prob 0 --collect-view raw   (GRPO on raw trajectories)
  cleaner-call   --similarity-on call                   (CLEANER as the paper ran it)
  cleaner-code   (defaults: code similarity)            (CLEANER with code similarity, ours)
  cleaner-deep   --gamma 1.5                            (every merge deep: the reference's gamma)
  positive       --purify-when positive                 (purify only above-mean rollouts, ours)
  is-gated       --rollback-is-threshold 0.5 --rollback-is-mode mean   (the authors' follow-up)
  is-gated-sum   --rollback-is-threshold 0.5                            (the IS as the design defines it)
  negatives      --negative-samples                     (the reference's DPO term on recovered failures)
Reports per-iteration accuracy and tool failures per trajectory (mean +- std across seeds), the
iterations each arm needs to reach the baseline's final accuracy, and the premise diagnostic at
iteration 0 (clean vs recovered accuracy); writes a Markdown table, a JSON file of every number and
a plot. Runs are resumable: re-run the same command after an interruption.

    python bench/paper_table.py --model assets/tiny-policy --seeds 3 --iterations 15 --prompts 16 \\
        --out runs/paper_table/mixed --plot bench/results/paper_table_mixed.png
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import polars as pl

from cleaner.engine.config import DEFAULT_POLICY, RunConfig
from cleaner.engine.run_config import RUN_BASE_LAYER, command_line, flag_layer, resolve_run_config
from cleaner.runner import run_loop
from cleaner.warehouse import Warehouse

# The `cleaner run` flags of each arm, beyond the ones every arm shares (arm_flags).
ARMS = {
    "baseline": {"rollback_prob": 0.0, "collect_view": "raw"},
    "cleaner-call": {"similarity_on": "call"},
    "cleaner-code": {},
    "cleaner-deep": {"gamma": 1.5},
    "positive": {"purify_when": "positive"},
    "is-gated": {"rollback_is_threshold": 0.5, "rollback_is_mode": "mean"},
    "is-gated-sum": {"rollback_is_threshold": 0.5},
    "negatives": {"negative_samples": True},
}


def arm_flags(arm: str, seed: int, args: argparse.Namespace) -> dict:
    return {"run_dir": str(Path(args.out) / arm / f"seed-{seed}"), "iterations": args.iterations,
            "model": args.model, "prompts": args.prompts, "group_size": args.group_size, "lr": args.lr,
            "seed": seed, **ARMS[arm]}


def arm_config(arm: str, seed: int, args: argparse.Namespace) -> RunConfig:
    """Exactly the config `cleaner run` resolves from the arm's flags."""
    return resolve_run_config(RUN_BASE_LAYER, flag_layer(arm_flags(arm, seed, args)))


def collect_results(args: argparse.Namespace) -> pl.DataFrame:
    records = []
    for arm in args.arms:
        logging.info("arm %s, seed 0: %s", arm, command_line(arm_flags(arm, 0, args)))
    for seed in range(args.seeds):
        for arm in args.arms:
            config = arm_config(arm, seed, args)
            logging.info("arm %s seed %d -> %s", arm, seed, config.run_dir)
            rows = run_loop(config, resume=True, progress=False)
            records += [{"arm": arm, "seed": seed, **{k: v for k, v in dataclasses.asdict(r).items()
                                                         if not k.endswith("_json")}} for r in rows]
    return pl.DataFrame(records, infer_schema_length=None).unique(subset=["arm", "seed", "iteration"], keep="last")


def summary_table(frame: pl.DataFrame) -> pl.DataFrame:
    """Mean and std across seeds, per arm and iteration."""
    return (
        frame.group_by("arm", "iteration")
        .agg(
            pl.col("accuracy").mean().alias("acc_mean"), pl.col("accuracy").std().alias("acc_std"),
            pl.col("failures_per_trajectory").mean().alias("fail_mean"),
            pl.col("failures_per_trajectory").std().alias("fail_std"),
        )
        .sort("arm", "iteration")
    )


def iterations_to_reach(summary: pl.DataFrame, arms: list[str]) -> dict[str, int | None]:
    """First iteration at which each arm's mean accuracy reaches the baseline's final mean accuracy."""
    baseline = summary.filter(pl.col("arm") == "baseline").sort("iteration")
    target = baseline["acc_mean"][-1]
    reached = {}
    for arm in arms:
        hits = summary.filter((pl.col("arm") == arm) & (pl.col("acc_mean") >= target))["iteration"]
        reached[arm] = int(hits.min()) if len(hits) else None
    return reached


def _last_iterations(frame: pl.DataFrame, last: int) -> pl.DataFrame:
    return frame.filter(pl.col("iteration") > frame["iteration"].max() - last)


def _arm_order(arms: list[str]) -> pl.Expr:
    """Sort key: the arms in the order given (ARMS), unknown ones last."""
    return pl.col("arm").replace_strict({arm: i for i, arm in enumerate(arms)}, default=len(arms))


def arm_summary(frame: pl.DataFrame, arms: list[str], last: int) -> pl.DataFrame:
    """Per arm, over the last `last` iterations: accuracy and failures per trajectory (mean and std
    across seeds of each seed's mean), their difference to the baseline of the same seed (the
    arms share seeds, so the pairing removes the seed's own luck), the seeds on which the arm beat
    the baseline, and what SAAR did (merges and gated merges per iteration)."""
    final = _last_iterations(frame, last)
    per_seed = final.group_by("arm", "seed").agg(
        pl.col("accuracy").mean().alias("acc"), pl.col("failures_per_trajectory").mean().alias("fail"),
        (pl.col("n_shallow") + pl.col("n_deep")).mean().alias("merges"), pl.col("n_gated").mean().alias("gated"))
    baseline = per_seed.filter(pl.col("arm") == "baseline").select(
        "seed", pl.col("acc").alias("base_acc"), pl.col("fail").alias("base_fail"))
    start = frame.filter(pl.col("iteration") == 0).group_by("arm").agg(pl.col("accuracy").mean().alias("acc_0"))
    return (
        per_seed.join(baseline, on="seed")
        .with_columns((pl.col("acc") - pl.col("base_acc")).alias("d_acc"),
                      (pl.col("fail") - pl.col("base_fail")).alias("d_fail"))
        .group_by("arm")
        .agg(pl.col("acc").mean().alias("acc_mean"), pl.col("acc").std().alias("acc_std"),
             pl.col("d_acc").mean().alias("d_acc_mean"), pl.col("d_acc").std().alias("d_acc_std"),
             (pl.col("d_acc") > 0).sum().alias("seeds_above"), pl.len().alias("seeds"),
             pl.col("fail").mean().alias("fail_mean"), pl.col("d_fail").mean().alias("d_fail_mean"),
             pl.col("d_fail").std().alias("d_fail_std"), pl.col("merges").mean(), pl.col("gated").mean())
        .join(start, on="arm")
        .sort(_arm_order(arms))
    )


def summary_markdown(arms_frame: pl.DataFrame, last: int) -> str:
    def pm(mean, std):
        return f"{mean:+.3f} ± {std or 0:.3f}"

    lines = [f"| arm | acc, iteration 0 | acc, last {last} | vs baseline (same seed) | seeds above | "
             f"fail/traj, last {last} | vs baseline | merges / iteration | gated / iteration |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in arms_frame.iter_rows(named=True):
        lines.append(
            f"| {r['arm']} | {r['acc_0']:.3f} | {r['acc_mean']:.3f} ± {r['acc_std'] or 0:.3f} | "
            f"{pm(r['d_acc_mean'], r['d_acc_std'])} | {r['seeds_above']}/{r['seeds']} | {r['fail_mean']:.3f} | "
            f"{pm(r['d_fail_mean'], r['d_fail_std'])} | {r['merges']:.1f} | {r['gated']:.1f} |")
    return "\n".join(lines)


def premise_summary(frame: pl.DataFrame, arms: list[str], last: int) -> pl.DataFrame:
    """Where each arm's accuracy comes from over the last `last` iterations (all seeds pooled): the
    first-call error rate, and the share and accuracy of clean, recovered and unrecovered rollouts;
    with the mean advantage recovered rollouts were trained with over the whole run."""
    final = _last_iterations(frame, last)
    total = pl.col("clean_rollouts") + pl.col("recovered_rollouts") + pl.col("unrecovered_rollouts")

    def weighted(name: str) -> pl.Expr:  # accuracy over rollouts, not a mean of iteration means
        return ((pl.col(f"{name}_accuracy").fill_nan(0) * pl.col(f"{name}_rollouts")).sum()
                / pl.col(f"{name}_rollouts").sum()).alias(f"{name}_acc")

    run_advantage = frame.group_by("arm").agg(
        ((pl.col("recovered_advantage").fill_nan(0) * pl.col("recovered_rollouts")).sum()
         / pl.col("recovered_rollouts").sum()).alias("recovered_adv_run"))
    return (
        final.group_by("arm")
        .agg(pl.col("first_attempt_error_rate").mean().alias("first_err"),
             (pl.col("clean_rollouts").sum() / total.sum()).alias("clean_share"), weighted("clean"),
             (pl.col("recovered_rollouts").sum() / total.sum()).alias("recovered_share"), weighted("recovered"),
             (pl.col("unrecovered_rollouts").sum() / total.sum()).alias("unrecovered_share"))
        .join(run_advantage, on="arm")
        .sort(_arm_order(arms))
    )


def premise_markdown(premise: pl.DataFrame, last: int) -> str:
    lines = [f"| arm (last {last} iterations) | first-call errors | clean: share, accuracy | recovered: share, "
             "accuracy | unrecovered share | recovered rollouts' mean advantage (whole run) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in premise.iter_rows(named=True):
        lines.append(f"| {r['arm']} | {r['first_err']:.3f} | {r['clean_share']:.3f}, {r['clean_acc']:.3f} | "
                     f"{r['recovered_share']:.3f}, {r['recovered_acc']:.3f} | {r['unrecovered_share']:.3f} | "
                     f"{r['recovered_adv_run']:+.3f} |")
    return "\n".join(lines)


def training_signal(args: argparse.Namespace) -> str:
    """What each arm trained on, read from its warehouses (all seeds): the mean advantage per
    trained token (group-normalised advantages sum to zero per group; what purification removes
    from the trained tokens moves this away from the baseline's) and the policy's entropy on the
    trained tokens early and late (a context rewritten after sampling puts tokens where the policy
    would not have put them)."""
    lines = ["| arm | mean advantage per trained token | entropy, iterations 0-2 | entropy, last 3 |",
             "| --- | --- | --- | --- |"]
    last = args.iterations - 3
    for arm in args.arms:
        push = tokens = 0.0
        early, late = [], []
        for seed in range(args.seeds):
            connection = Warehouse(Path(args.out) / arm / f"seed-{seed}" / "warehouse").connect()
            (num, den), = connection.execute(
                "SELECT sum(advantage * list_sum(loss_mask)), sum(list_sum(loss_mask)) FROM purified "
                "WHERE negative_seq IS NULL AND NOT infra_fault").fetchall()
            push, tokens = push + num, tokens + den
            early += [e for (e,) in connection.execute("SELECT entropy FROM train_steps WHERE iteration < 3").fetchall()]
            late += [e for (e,) in connection.execute(
                "SELECT entropy FROM train_steps WHERE iteration >= ?", [last]).fetchall()]
            connection.close()
        lines.append(f"| {arm} | {push / tokens:+.4f} | {sum(early) / len(early):.3f} | {sum(late) / len(late):.3f} |")
    return "\n".join(lines)


def premise_at_start(frame: pl.DataFrame) -> pl.DataFrame:
    """The premise diagnostic of iteration 0, per arm (mean over seeds)."""
    return (
        frame.filter(pl.col("iteration") == 0).group_by("arm")
        .agg(pl.col("clean_rollouts").sum(), pl.col("clean_accuracy").mean(),
             pl.col("recovered_rollouts").sum(), pl.col("recovered_accuracy").mean())
        .sort("arm")
    )


def markdown(summary: pl.DataFrame, reached: dict[str, int | None], premise: pl.DataFrame, arms: list[str]) -> str:
    lines = ["| iteration | " + " | ".join(f"{arm} acc | {arm} fail/traj" for arm in arms) + " |",
             "| --- |" + " --- | --- |" * len(arms)]
    for iteration in sorted(summary["iteration"].unique().to_list()):
        cells = []
        for arm in arms:
            row = summary.filter((pl.col("arm") == arm) & (pl.col("iteration") == iteration))
            if row.is_empty():
                cells += ["-", "-"]
                continue
            r = row.row(0, named=True)
            cells += [f"{r['acc_mean']:.3f} ± {r['acc_std'] or 0:.3f}", f"{r['fail_mean']:.3f} ± {r['fail_std'] or 0:.3f}"]
        lines.append(f"| {iteration} | " + " | ".join(cells) + " |")
    lines += ["", "Iterations to reach the baseline's final accuracy: "
              + ", ".join(f"{arm} {n if n is not None else 'not reached'}" for arm, n in reached.items()), ""]
    baseline = premise.filter(pl.col("arm") == "baseline")
    if not baseline.is_empty():
        r = baseline.row(0, named=True)
        ratio = r["recovered_accuracy"] / r["clean_accuracy"] if r["clean_accuracy"] else float("nan")
        lines.append(f"Premise at iteration 0 (baseline arm, all seeds): {r['clean_rollouts']} clean rollouts, "
                     f"accuracy {r['clean_accuracy']:.3f}; {r['recovered_rollouts']} recovered, accuracy "
                     f"{r['recovered_accuracy']:.3f}; recovered / clean {ratio:.2f}")
    return "\n".join(lines)


def plot(summary: pl.DataFrame, arms: list[str], path: Path, title: str) -> None:
    import matplotlib  # matplotlib costs start-up time: loaded only to plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (start-up time, as above)

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for arm in arms:
        data = summary.filter(pl.col("arm") == arm).sort("iteration")
        x = data["iteration"].to_list()
        for axis, mean, std in ((axes[0], "acc_mean", "acc_std"), (axes[1], "fail_mean", "fail_std")):
            m, s = data[mean].to_numpy(), data[std].fill_null(0).to_numpy()
            style = {"color": "black", "linestyle": "--", "zorder": 5} if arm == "baseline" else {}
            axis.plot(x, m, marker="o", markersize=3, label=arm, **style)
            axis.fill_between(x, m - s, m + s, alpha=0.12)
    axes[0].set_title("accuracy (mean ± std over seeds)")
    axes[1].set_title("failed tool calls per trajectory")
    for axis in axes:
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_POLICY))
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default="runs/paper_table/mixed")
    parser.add_argument("--plot", default=None, help="PNG to write (default: <out>/paper_table.png)")
    parser.add_argument("--last", type=int, default=5, help="iterations averaged in the summary table")
    args = parser.parse_args()
    args.arms = [arm for arm in args.arms.split(",") if arm]
    unknown = set(args.arms) - set(ARMS)
    if unknown or "baseline" not in args.arms:
        parser.error(f"arms must include baseline and come from {list(ARMS)}; got {args.arms}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    frame = collect_results(args)
    summary = summary_table(frame)
    reached = iterations_to_reach(summary, args.arms)
    premise = premise_at_start(frame)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame.write_json(out / "iterations.json")
    text = (summary_markdown(arm_summary(frame, args.arms, args.last), args.last) + "\n\n"
            + premise_markdown(premise_summary(frame, args.arms, args.last), args.last) + "\n\n"
            + training_signal(args) + "\n\n"
            + markdown(summary, reached, premise, args.arms))
    (out / "table.md").write_text(text + "\n")
    plot(summary, args.arms, Path(args.plot) if args.plot else out / "paper_table.png", str(args.model))
    print(text)


if __name__ == "__main__":
    main()
