"""What `--skip-settled-prompts` saves on the toy policies, measured side by side in one run.

Each toy runs twice from the same policy with the same seed on the same toy dataset (a fixed pool of
toy problems in verl's layout, so prompts come back every few iterations): once collecting every
prompt as it comes, once skipping the prompts whose last group was settled (all correct or all
wrong). Per iteration it reads from the warehouse the informative groups (two or more different
rewards: a non-zero advantage) and the collection's wall time, and reports per arm the mean
informative groups per iteration, the collect seconds per informative group and the rollouts
generated, over the iterations after the first pass through the pool (before it, nothing can be
skipped).

    python bench/prompt_skipping.py --toys mixed,env,recover --pool 48 --prompts 16 --iterations 10 \\
        --out runs/prompt_skipping --results bench/results
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.config import DEFAULT_POLICY, ENV_POLICY, RECOVER_POLICY
from cleaner.config.flags import command_line, flag_layer
from cleaner.config.layers import RUN_BASE_LAYER, resolve_run_config
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.loop.iterations import run_loop
from cleaner.warehouse import Warehouse

TOYS = {"mixed": DEFAULT_POLICY, "env": ENV_POLICY, "recover": RECOVER_POLICY}
ARMS = {"every prompt": {}, "skip settled": {"skip_settled_prompts": -1}}
POOL_SEED = 2**32 + 7  # no iteration's toy tasks draw it


def write_pool(path: Path, problems: int) -> None:
    rows = [{"prompt": [{"role": "user", "content": task.messages[-1]["content"]}],
             "reward_model": {"style": "rule", "ground_truth": task.ground_truth}, "data_source": "toy",
             "extra_info": {"index": index}} for index, task in enumerate(toy_tasks(problems, POOL_SEED))]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def arm_flags(args: argparse.Namespace, toy: str, arm: str, data: Path) -> dict:
    return {"run_dir": str(Path(args.out) / toy / arm.replace(" ", "-")), "iterations": args.iterations,
            "model": str(TOYS[toy]), "data": str(data), "prompt_style": "bare", "prompts": args.prompts,
            "group_size": args.group_size, "lr": args.lr, "seed": args.seed, **ARMS[arm]}


def measured(run_dir: Path) -> pl.DataFrame:
    """Per iteration: informative groups, rollouts and the collect seconds (the run's own record)."""
    connection = Warehouse(run_dir / "warehouse").connect()
    groups = pl.from_arrow(connection.sql(
        "SELECT iteration, count(*) FILTER (WHERE lo <> hi) AS informative, count(*) AS groups, sum(n) AS rollouts "
        "FROM (SELECT iteration, group_id, min(reward) AS lo, max(reward) AS hi, count(*) AS n FROM rollouts "
        "GROUP BY ALL) GROUP BY ALL").to_arrow_table())
    seconds = pl.from_arrow(connection.sql(
        "SELECT iteration, arg_max(collect_s, created_at) AS collect_s, arg_max(accuracy, created_at) AS accuracy "
        "FROM iterations GROUP BY ALL").to_arrow_table())
    connection.close()
    return groups.join(seconds, on="iteration").sort("iteration")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--toys", default="mixed,env,recover")
    parser.add_argument("--pool", type=int, default=48, help="toy problems in the dataset")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/prompt_skipping")
    parser.add_argument("--results", default="bench/results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    data = Path(args.out) / "pool.parquet"
    write_pool(data, args.pool)
    first_pass = -(-args.pool // args.prompts)  # iterations before a prompt can come back
    lines = ["# Prompts skipped when settled, on the toy policies", "",
             f"`python {' '.join(sys.argv)}`", "",
             f"A pool of {args.pool} toy problems, {args.prompts} prompts x {args.group_size} samples an iteration, "
             f"{args.iterations} iterations; figures over iterations {first_pass}-{args.iterations - 1} (after the "
             "first pass through the pool).", "",
             "| toy | arm | informative groups / iteration | rollouts / iteration | collect s / iteration | "
             "collect s / informative group | accuracy |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for toy in args.toys.split(","):
        for arm in ARMS:
            flags = arm_flags(args, toy, arm, data)
            logging.info("%s", command_line(flags))
            run_loop(resolve_run_config(RUN_BASE_LAYER, flag_layer(flags)), resume=True, progress=False)
            frame = measured(Path(flags["run_dir"])).filter(pl.col("iteration") >= first_pass)
            informative, seconds = frame["informative"].mean(), frame["collect_s"].mean()
            lines.append(f"| {toy} | {arm} | {informative:.2f} | {frame['rollouts'].mean():.0f} | {seconds:.1f} | "
                         f"{seconds / max(informative, 1e-9):.2f} | {frame['accuracy'].mean():.3f} |")
    out = Path(args.results) / "prompt_skipping.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
