"""Held-out toy problems for bench/paper_table.py: written once, checked against every trained prompt,
and answered by each arm's last checkpoint through `cleaner eval`.

Design decisions:
- The problems are `toy_tasks(n, HELDOUT_SEED)`. The toy family draws prompt i of a seed from
  `random.Random(f"toy/{seed}/{i}")`, and an iteration's seed is a 32-bit hash of (run seed,
  iteration) (cleaner/engine/collect/job.py `iteration_seed`), so the seed 2**32 is one no
  iteration of any run draws. Disjointness is still checked, not assumed: no held-out question may
  occur in the prompt text of any trained rollout (every iteration of every run evaluated), nor be
  a problem of the corpora the tiny policies were bootstrapped on (cleaner/toys/corpus.py).
- They are written in the AIME 2024 layout (`Problem`, `Answer`, `data_source`) and evaluated with
  `--prompt-style bare`, so the user message is the question alone, as in training, and graded on
  the last `\\boxed{}`.
- The evaluation samples as training did (temperature 1, top-p 1) under the run's budget (turns,
  retries, tokens per generation and per response). Both test-time settings run: `--no-saar`, the
  raw context, in which a failed call uses up budget for every arm alike, and `--saar`, the paper's
  test time, in which a recovered call's failure is rolled back out of the context (and the budget).
- Every evaluation of a toy goes into one warehouse, `<out>/<toy>/heldout`, so one SQL query compares
  the checkpoints; re-running the same command skips the evaluations already stored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.config import ASSETS_DIR, CollectConfig, EvalConfig, PromptStyle
from cleaner.config.flags import command_line
from cleaner.engine.collect.tasks import toy_problem, toy_tasks
from cleaner.engine.eval.job import eval_job
from cleaner.records import FinishReason
from cleaner.toys.corpus import CORPUS_SEED_OFFSET
from cleaner.warehouse import Warehouse

HELDOUT_SEED = 2**32  # no iteration draws it: iteration seeds are 32-bit
DATA_SOURCE = "AIME2024"  # the layout's source: graded on the last \boxed{}
# finish reasons of a rollout that ran out of budget before answering; as SQL: IN {OUT_OF_BUDGET}
OUT_OF_BUDGET = (FinishReason.MAX_TOKENS.value, FinishReason.MAX_TURNS.value)


# ---------------------------------------------------------------------------------------------
# The problems and their disjointness from training


def write_heldout(path: Path, problems: int, seed: int = HELDOUT_SEED) -> list[str]:
    """Write the held-out problems in the AIME 2024 layout; their questions, in order."""
    tasks = toy_tasks(problems, seed)
    rows = [{"Problem": task.messages[-1]["content"], "Answer": int(task.ground_truth), "data_source": DATA_SOURCE}
            for task in tasks]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [row["Problem"] for row in rows]


def trained_prompts(warehouse: Path) -> set[str]:
    """The prompt text of every rollout a run collected (all iterations)."""
    connection = Warehouse(warehouse).connect()
    texts = {text for (text,) in connection.sql("SELECT DISTINCT text FROM segments WHERE kind = 'prompt'").fetchall()}
    connection.close()
    return texts


def overlapping(questions: Iterable[str], prompt_texts: Iterable[str]) -> list[str]:
    """The questions that occur in any of the prompt texts (a trained prompt is the chat template
    around its question)."""
    texts = list(prompt_texts)
    return [question for question in questions if any(question in text for text in texts)]


def corpus_problems(assets: Path = ASSETS_DIR) -> set[tuple[int, int, int, int]]:
    """(a, b, c, d) of every problem of every corpus a committed tiny policy was bootstrapped on,
    read from the bootstrap configs saved next to the weights."""
    problems = set()
    for path in sorted(assets.glob("*/bootstrap*config.json")):
        corpus = json.loads(path.read_text()).get("corpus")
        if corpus is None:
            continue
        for index in range(corpus["size"]):
            p = toy_problem(corpus["seed"] + CORPUS_SEED_OFFSET, index)
            problems.add((p.a, p.b, p.c, p.d))
    return problems


@dataclass(frozen=True)
class Disjointness:
    problems: int  # held-out problems
    trained_prompts: int  # distinct prompt texts of the runs checked
    in_training: tuple[str, ...]  # held-out questions found in a trained prompt: must be empty
    corpus_problems: int  # distinct problems of the bootstrap corpora
    in_corpus: int  # held-out problems with a corpus problem's numbers: must be 0

    def text(self) -> str:
        return (f"{self.problems} held-out problems (`toy_tasks({self.problems}, {HELDOUT_SEED})`); "
                f"{len(self.in_training)} of them occur in the {self.trained_prompts} distinct prompts of the runs' "
                f"warehouses, {self.in_corpus} share their numbers with one of the {self.corpus_problems} problems "
                "of the tiny policies' bootstrap corpora.")


def check_disjoint(problems: int, warehouses: Sequence[Path], seed: int = HELDOUT_SEED) -> Disjointness:
    questions = [task.messages[-1]["content"] for task in toy_tasks(problems, seed)]
    texts = set().union(*(trained_prompts(w) for w in warehouses))
    corpus = corpus_problems()
    numbers = [(p.a, p.b, p.c, p.d) for p in (toy_problem(seed, i) for i in range(problems))]
    return Disjointness(problems, len(texts), tuple(overlapping(questions, texts)), len(corpus),
                        sum(n in corpus for n in numbers))


# ---------------------------------------------------------------------------------------------
# Evaluating


def eval_config(models: Sequence[str], data: Path, collect: CollectConfig, samples: int) -> EvalConfig:
    """Every model on the held-out file, without and with SAAR, sampled and budgeted as `collect`."""
    return EvalConfig(models=tuple(models), datasets=(("heldout", str(data)),), saar=(False, True), n=samples,
                      prompt_style=PromptStyle.BARE, temperature=collect.temperature, top_p=collect.top_p,
                      max_turns=collect.max_turns, max_retries=collect.max_retries,
                      max_new_tokens=collect.max_new_tokens, max_response_tokens=collect.max_response_tokens,
                      gamma=collect.gamma, similarity_on=collect.similarity_on, seed=0)


def eval_command(config: EvalConfig, warehouse: Path, model: str = "CHECKPOINT") -> str:
    """The `cleaner eval` command of one model of `config`."""
    flags = {"model": model, "dataset": f"heldout={config.datasets[0][1]}", "n": config.n,
             "prompt_style": config.prompt_style.value, "temperature": config.temperature, "top_p": config.top_p,
             "max_turns": config.max_turns, "max_retries": config.max_retries,
             "max_new_tokens": config.max_new_tokens, "max_response_tokens": config.max_response_tokens,
             "gamma": config.gamma, "similarity_on": config.similarity_on.value, "seed": config.seed}
    return f"{command_line(flags, 'eval')} --no-saar --saar -w {warehouse}"


def run_evals(warehouse: Path, config: EvalConfig) -> list[str]:
    """Run (or find stored) every evaluation of `config`; their eval ids."""
    logging.info("held-out: %d model(s) -> %s", len(config.models), warehouse)
    return [row.eval_id for row in eval_job(Warehouse(warehouse), config, progress=False).rows]


def heldout_frame(warehouse: Path, labels: Mapping[str, tuple[str, int | None]],
                  eval_ids: Sequence[str] | None = None) -> pl.DataFrame:
    """One row per (model, SAAR setting): its arm and seed from `labels` (model -> (arm, seed)),
    accuracy (avg@n), failed calls per trajectory and the share of rollouts out of budget. With
    `eval_ids`, only those evaluations (a warehouse may hold others: other sample counts, budgets)."""
    connection = Warehouse(warehouse).connect()
    runs = pl.from_arrow(connection.sql(
        "SELECT eval_id, model, saar, avg_at_n AS accuracy, failures_per_trajectory, rollouts FROM eval_runs"
    ).to_arrow_table())
    budget = pl.from_arrow(connection.sql(
        f"SELECT collect_config_id AS eval_id, avg((finish_reason IN {OUT_OF_BUDGET})::DOUBLE) AS truncation_rate "
        "FROM eval_rollouts GROUP BY ALL").to_arrow_table())
    connection.close()
    if eval_ids is not None:
        runs = runs.filter(pl.col("eval_id").is_in(list(eval_ids)))
    label = pl.DataFrame([{"model": m, "arm": arm, "seed": seed} for m, (arm, seed) in labels.items()],
                         schema={"model": pl.String, "arm": pl.String, "seed": pl.Int64})
    return runs.join(budget, on="eval_id", how="left").join(label, on="model", how="inner")


# ---------------------------------------------------------------------------------------------
# Table

HELDOUT_METRICS = ("accuracy", "failures_per_trajectory", "truncation_rate")


def heldout_paired(frame: pl.DataFrame, arms: Sequence[str]) -> pl.DataFrame:
    """Per arm and SAAR setting: each metric's mean over seeds, and its difference to the baseline's
    checkpoint of the same seed (mean and std over seeds); the seeds on which the arm's accuracy beat
    the baseline's. Rows without a seed (the initial policy) are kept as they are, differences null."""
    seeded = frame.filter(pl.col("seed").is_not_null())
    base = seeded.filter(pl.col("arm") == "baseline").select(
        "seed", "saar", *(pl.col(m).alias(f"base_{m}") for m in HELDOUT_METRICS))
    differences = seeded.join(base, on=["seed", "saar"]).with_columns(
        (pl.col(m) - pl.col(f"base_{m}")).alias(f"d_{m}") for m in HELDOUT_METRICS)
    table = (differences.group_by("arm", "saar")
             .agg(*(pl.col(m).mean() for m in HELDOUT_METRICS), *(pl.col(f"d_{m}").mean() for m in HELDOUT_METRICS),
                  *(pl.col(f"d_{m}").std().alias(f"sd_{m}") for m in HELDOUT_METRICS),
                  (pl.col("d_accuracy") > 0).sum().alias("seeds_above"), pl.len().alias("seeds")))
    initial = frame.filter(pl.col("seed").is_null()).select(
        "arm", "saar", *HELDOUT_METRICS, pl.lit(0, pl.UInt32).alias("seeds"))
    order = {arm: i for i, arm in enumerate(arms)}
    return (pl.concat([initial, table], how="diagonal_relaxed")
            .sort(pl.col("arm").replace_strict(order, default=-1), "saar"))


def heldout_markdown(table: pl.DataFrame) -> str:
    lines = ["| arm | test-time context | accuracy | vs baseline | seeds above | failed calls / traj | vs baseline | "
             "out of budget | vs baseline |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in table.iter_rows(named=True):
        cells = []
        for m in HELDOUT_METRICS:
            cells.append(f"{r[m]:.3f}")
            spread = "-" if r.get(f"sd_{m}") is None else f"{r[f'sd_{m}']:.3f}"  # one seed: no spread
            cells.append("" if r.get(f"d_{m}") is None else f"{r[f'd_{m}']:+.3f} ± {spread}")
            if m == "accuracy":
                cells.append(f"{r['seeds_above']}/{r['seeds']}" if r["seeds"] else "")
        context = "SAAR" if r["saar"] else "raw"
        lines.append(f"| {r['arm']} | {context} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
