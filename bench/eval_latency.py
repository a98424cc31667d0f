"""Test-time SAAR's latency: the same problems and seeds evaluated with and without SAAR, in one run.

The paper reports that rendering the context with SAAR at test time costs +8.8% latency. Here each
repeat runs both settings over the same problems (the toy family written in the AIME 2024 layout,
or `--dataset`) with the same seeds, through the agent loop `cleaner eval` uses (generation, tool
calls, grading; no warehouse writes), alternating which setting goes first so warm-up and load
drifts fall on both. It prints each pass, the median seconds per setting, their ratio, and the
tokens behind them: generated tokens and the context tokens prefilled before every generation.
Torch runs one intra-op thread by default (`--threads`): on a shared machine, threads that wait for
each other at every operator turn other processes' load into multi-second stalls.

    .venv/bin/python bench/eval_latency.py --problems 64 --n 4 --repeats 5 --write-benchmarks

`--write-benchmarks` replaces the "## Evaluation: test-time SAAR latency" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from benchmarks_md import write_section  # bench/, beside this script
from rich.console import Console
from rich.table import Table

from cleaner.config import DEFAULT_POLICY, EvalConfig
from cleaner.engine.collect.datasets import load_dataset
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.grading.programs import Grader
from cleaner.engine.model import load_backend
from cleaner.engine.model.chat import ChatFormat
from cleaner.records import SegmentKind
from cleaner.sandbox import SandboxConfig, make_sandbox

HEADING = "## Evaluation: test-time SAAR latency"
PROGRESS = Console(stderr=True)
NOTE = (
    "Both settings sample the same first turn of every rollout; they differ after a failed call, where "
    "SAAR drops the failed attempt and its error from the context (the context tokens column). The "
    "torch backend prefills every context from scratch each turn, so a shorter context costs less; "
    "an engine with prefix caching (SGLang, as the paper's) reuses the raw context's cache, while a "
    "context SAAR rewrote must be prefilled again from the rewrite on. That cost is not measured here."
)


@dataclass(frozen=True)
class Pass:
    saar: bool
    seconds: float
    rollouts: int
    accuracy: float
    failures_per_trajectory: float
    generated_tokens: int
    context_tokens: int  # prefilled before every generation, summed


def toy_dataset(directory: Path, problems: int, seed: int) -> Path:
    path = directory / "toy_aime24.parquet"
    rows = [{"Problem": task.messages[-1]["content"], "Answer": int(task.ground_truth), "data_source": "AIME2024"}
            for task in toy_tasks(problems, seed)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def one_pass(tasks, config: EvalConfig, saar: bool, backend, sandbox) -> Pass:
    collect_config = config.collect_config(config.models[0], config.datasets[0][1], saar, len(tasks))
    context_tokens = []
    started = time.perf_counter()
    batches = []
    collect(tasks, collect_config, backend, sandbox, ChatFormat(backend.tokenizer), write=batches.append,
            reward_fn=Grader(), progress=False, on_context=lambda _, context: context_tokens.append(len(context)))
    seconds = time.perf_counter() - started
    rollouts = [rollout for batch in batches for rollout in batch.rollouts]
    generated = sum(len(segment.token_ids) for batch in batches for segment in batch.segments
                    if segment.kind == SegmentKind.ASSISTANT)
    return Pass(saar, seconds, len(rollouts), sum(r.correct for r in rollouts) / len(rollouts),
                sum(r.n_failed_calls for r in rollouts) / len(rollouts), generated, sum(context_tokens))


def run(config: EvalConfig, repeats: int) -> list[Pass]:
    tasks = load_dataset(config.datasets[0][1], config.prompt_style, config.limit).tasks
    backend = load_backend(config.backend, config.models[0], device=config.device)
    passes = []
    with make_sandbox(config.sandbox) as sandbox:
        one_pass(tasks[:4], dataclasses.replace(config, n=1), True, backend, sandbox)  # warm-up
        for repeat in range(repeats):
            for saar in ((True, False) if repeat % 2 == 0 else (False, True)):
                passes.append(one_pass(tasks, config, saar, backend, sandbox))
                PROGRESS.print(f"repeat {repeat} saar={saar}: {passes[-1].seconds:.2f} s")
    return passes


def summary_rows(passes: list[Pass]) -> list[tuple[str, ...]]:
    rows = []
    for saar in (True, False):
        mine = [p for p in passes if p.saar == saar]
        rows.append(("on" if saar else "off", f"{statistics.median(p.seconds for p in mine):.2f}",
                     f"{min(p.seconds for p in mine):.2f}", " / ".join(f"{p.seconds:.2f}" for p in mine),
                     str(mine[0].rollouts), f"{mine[0].accuracy:.3f}", f"{mine[0].failures_per_trajectory:.3f}",
                     str(mine[0].generated_tokens), str(mine[0].context_tokens)))
    return rows


def ratio(passes: list[Pass], statistic=statistics.median) -> float:
    """SAAR seconds over raw seconds, each setting summarised by `statistic` over its passes."""
    on = statistic([p.seconds for p in passes if p.saar])
    off = statistic([p.seconds for p in passes if not p.saar])
    return on / off


COLUMNS = ("SAAR", "median s", "min s", "passes s", "rollouts", "accuracy", "fail/traj", "generated tokens",
           "context tokens")


def render(passes: list[Pass], command: str) -> str:
    load = os.getloadavg()[0]
    lines = [
        HEADING, "",
        f"The same problems and seeds with and without SAAR, alternating order, in one run on "
        f"{os.cpu_count()} CPU cores (1-minute load average {load:.1f} at the end; the machine is shared):",
        "", "```", command, "```", "",
        "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS),
        *["| " + " | ".join(row) + " |" for row in summary_rows(passes)],
        "", f"Latency ratio, median SAAR / median without: **{ratio(passes):.3f}** "
        f"({(ratio(passes) - 1) * 100:+.1f}%; the paper reports +8.8% for its models); of the fastest "
        f"passes: {ratio(passes, min):.3f}.", "", NOTE, "",
    ]
    return "\n".join(lines)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_POLICY))
    parser.add_argument("--dataset", type=Path, help="a dataset file; default: toy problems in the AIME 2024 layout")
    parser.add_argument("--problems", type=int, default=64, help="toy problems (or the first N of --dataset)")
    parser.add_argument("--n", type=int, default=4, help="samples per problem")
    parser.add_argument("--repeats", type=int, default=5, help="passes per setting")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="1.0 for the tiny policy (at the paper's 0.6 it almost never fails a call)")
    parser.add_argument("--prompt-style", default="bare", help="bare for the tiny policy; reference for real models")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--max-response-tokens", type=int, default=768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--write-benchmarks", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        dataset = args.dataset or toy_dataset(Path(directory), args.problems, seed=args.seed)
        config = EvalConfig(models=(args.model,), datasets=(("bench", str(dataset)),), saar=(True, False),
                            n=args.n, prompt_style=args.prompt_style, limit=args.problems, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, max_response_tokens=args.max_response_tokens,
                            seed=args.seed, batch_rollouts=args.problems * args.n, device=args.device,
                            sandbox=SandboxConfig(workers=2))
        passes = run(config, args.repeats)
    table = Table(title="test-time SAAR latency")
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for row in summary_rows(passes):
        table.add_row(*row)
    Console().print(table)
    Console().print(f"latency ratio (median SAAR / median without): {ratio(passes):.3f}; "
                    f"of the fastest passes: {ratio(passes, min):.3f}")
    if args.write_benchmarks:
        command = ".venv/bin/python bench/eval_latency.py " + shlex.join(sys.argv[1:])
        write_section(HEADING, render(passes, command))


if __name__ == "__main__":
    main()
