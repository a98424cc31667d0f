"""The paper's comparison in miniature on the toy task.

Three arms, same seeds, same initial policy; each arm is one `cleaner run` command (printed at the
start), run for N iterations:
  baseline        --rollback-prob 0 --collect-view raw (raw trajectories, raw collection context)
  cleaner         p = 1, gamma = 0.5 (the paper's CLEANER; purified collection context)
  cleaner+pos     as cleaner, with --purify-when positive (ours, not the paper's)
Reports per-iteration accuracy and tool failures per trajectory (mean +- std across seeds), and
the iterations each arm needs to reach the baseline's final accuracy. Writes a Markdown table and
a JSON file of every number.

    python bench/paper_table.py --seeds 3 --iterations 15 --prompts 32 --out bench/results/paper_table

Every iteration collects, purifies and trains, so this is hours on two CPU cores at the sizes above;
runs are resumable (re-run the same command after an interruption).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

import polars as pl

from cleaner.engine.config import RunConfig
from cleaner.engine.run_config import RUN_BASE_LAYER, command_line, flag_layer, resolve_run_config
from cleaner.runner import run_loop

# The `cleaner run` flags of each arm, beyond the ones every arm shares (arm_flags).
ARMS = {
    "baseline": {"rollback_prob": 0.0, "collect_view": "raw"},
    "cleaner": {},
    "cleaner+pos": {"purify_when": "positive"},
}


def arm_flags(arm: str, seed: int, args: argparse.Namespace) -> dict:
    return {"run_dir": str(Path(args.out) / arm / f"seed-{seed}"), "iterations": args.iterations,
            "prompts": args.prompts, "group_size": args.group_size, "lr": args.lr, "seed": seed,
            **ARMS[arm]}


def arm_config(arm: str, seed: int, args: argparse.Namespace) -> RunConfig:
    """Exactly the config `cleaner run` resolves from the arm's flags."""
    return resolve_run_config(RUN_BASE_LAYER, flag_layer(arm_flags(arm, seed, args)))


def collect_results(args: argparse.Namespace) -> pl.DataFrame:
    records = []
    for arm in ARMS:
        logging.info("arm %s, seed 0: %s", arm, command_line(arm_flags(arm, 0, args)))
    for seed in range(args.seeds):
        for arm in ARMS:
            config = arm_config(arm, seed, args)
            logging.info("arm %s seed %d -> %s", arm, seed, config.run_dir)
            rows = run_loop(config, resume=True, progress=False)
            records += [{"arm": arm, "seed": seed, **{k: v for k, v in dataclasses.asdict(r).items()
                                                         if not k.endswith("_json")}} for r in rows]
    return pl.DataFrame(records).unique(subset=["arm", "seed", "iteration"], keep="last")


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


def iterations_to_reach(summary: pl.DataFrame) -> dict[str, int | None]:
    """First iteration at which each arm's mean accuracy reaches the baseline's final mean accuracy."""
    baseline = summary.filter(pl.col("arm") == "baseline").sort("iteration")
    target = baseline["acc_mean"][-1]
    reached = {}
    for arm in ARMS:
        hits = summary.filter((pl.col("arm") == arm) & (pl.col("acc_mean") >= target))["iteration"]
        reached[arm] = int(hits.min()) if len(hits) else None
    return reached


def markdown(summary: pl.DataFrame, reached: dict[str, int | None]) -> str:
    lines = ["| iteration | " + " | ".join(f"{arm} acc | {arm} fail/traj" for arm in ARMS) + " |",
             "| --- |" + " --- | --- |" * len(ARMS)]
    for iteration in sorted(summary["iteration"].unique().to_list()):
        cells = []
        for arm in ARMS:
            row = summary.filter((pl.col("arm") == arm) & (pl.col("iteration") == iteration))
            if row.is_empty():
                cells += ["-", "-"]
                continue
            r = row.row(0, named=True)
            cells += [f"{r['acc_mean']:.3f} ± {r['acc_std'] or 0:.3f}", f"{r['fail_mean']:.3f} ± {r['fail_std'] or 0:.3f}"]
        lines.append(f"| {iteration} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Iterations to reach the baseline's final accuracy: "
                 + ", ".join(f"{arm} {n if n is not None else 'not reached'}" for arm, n in reached.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--out", default="bench/results/paper_table")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    frame = collect_results(args)
    summary = summary_table(frame)
    reached = iterations_to_reach(summary)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    frame.write_json(out / "iterations.json")
    text = markdown(summary, reached)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
