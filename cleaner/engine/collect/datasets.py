"""Dataset files in the layouts researchers keep on disk, read into tasks (docs/architecture.md §12).

Five layouts, each with a `data_source` column:
- verl: the RL layout of Open-AgentRL-30K (`prompt` messages, `reward_model.ground_truth`), read
  by tasks.py's `load_rl_parquet`;
- the Open-AgentRL-Eval files: AIME 2024 (`Problem`, `Answer`), AIME 2025 (`problem`, `answer`),
  GPQA-Diamond (`problem`, `solution` = the letter, `domain`) and LiveCodeBench v6 (`problem`,
  `reward_model` = a JSON string `{"ground_truth": {"inputs": [...], "outputs": [...]}}`).

Design decisions:
- The layout is read off the columns, never off the file name or the data source, so a renamed or
  re-sourced file still loads. Layouts are tried from the most specific set of columns to the
  least (LiveCodeBench and GPQA also have `problem`, which AIME 2025 needs); a file matching none is
  an error naming the file, the columns found and every layout with its columns.
- Prompts are the reference's for each layout (prompts.py) or, with `PromptStyle.BARE`, the problem
  text alone. A task's ground truth is a string: the answer, the letter, or, for LiveCodeBench, the
  tests as canonical JSON `{"inputs": [...], "outputs": [...]}` (the grader reads it back).
- Prompt ids are `<data_source>-<row>`: seeds derive from them, so a problem keeps its samples
  whichever model or SAAR setting evaluates it.
- Functional (LeetCode-style `fn_name`) tests are not supported: LiveCodeBench rows are graded as
  stdin/stdout programs, as the reference's prompt asks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import pyarrow as pa

from cleaner.config import PromptStyle
from cleaner.engine.collect.prompts import aime_prompt, gpqa_prompt, livecodebench_prompt
from cleaner.engine.collect.tasks import (
    DatasetError,
    Task,
    read_parquet_table,
    row_error,
    verl_tasks,
)


class Layout(StrEnum):
    VERL = "verl"
    AIME2024 = "aime2024"
    AIME2025 = "aime2025"
    GPQA_DIAMOND = "gpqa_diamond"
    LIVECODEBENCH_V6 = "livecodebench_v6"


# Required columns per layout, most specific first (the order detection tries them in).
LAYOUT_COLUMNS: tuple[tuple[Layout, tuple[str, ...]], ...] = (
    (Layout.LIVECODEBENCH_V6, ("problem", "reward_model", "data_source")),
    (Layout.GPQA_DIAMOND, ("problem", "solution", "domain", "data_source")),
    (Layout.AIME2025, ("problem", "answer", "data_source")),
    (Layout.AIME2024, ("Problem", "Answer", "data_source")),
    (Layout.VERL, ("prompt", "reward_model", "data_source")),
)


def detect_layout(path: Path | str, columns: list[str]) -> Layout:
    """The layout whose columns the file has; DatasetError naming the file and every layout if none."""
    for layout, required in LAYOUT_COLUMNS:
        if all(name in columns for name in required):
            return layout
    accepted = "; ".join(f"{layout} ({', '.join(required)})" for layout, required in LAYOUT_COLUMNS)
    raise DatasetError(f"{path}: no known dataset layout has columns {columns}; accepted layouts: {accepted}")


# ---------------------------------------------------------------------------------------------
# Rows of the evaluation layouts


@dataclass(frozen=True)
class _Row:
    """What a layout's row gives: the problem, the reference's prompt and the ground truth."""

    problem: str
    reference_prompt: str
    ground_truth: str


def _text(path: Path, index: int, row: dict, column: str) -> str:
    value = row.get(column)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # AIME answers are often stored as integers
    if not isinstance(value, str) or not value.strip():
        raise row_error(path, index, f"a non-empty `{column}`", value)
    return value


def _aime2024(path: Path, index: int, row: dict, tools: bool) -> _Row:
    problem = _text(path, index, row, "Problem")
    return _Row(problem, aime_prompt(problem, tools), _text(path, index, row, "Answer"))


def _aime2025(path: Path, index: int, row: dict, tools: bool) -> _Row:
    problem = _text(path, index, row, "problem")
    return _Row(problem, aime_prompt(problem, tools), _text(path, index, row, "answer"))


def _gpqa(path: Path, index: int, row: dict, tools: bool) -> _Row:
    problem, domain = _text(path, index, row, "problem"), _text(path, index, row, "domain")
    return _Row(problem, gpqa_prompt(problem, domain, tools), _text(path, index, row, "solution"))


def _livecodebench(path: Path, index: int, row: dict, tools: bool) -> _Row:
    problem = _text(path, index, row, "problem")
    expected = '`reward_model` as a JSON string {"ground_truth": {"inputs": [...], "outputs": [...]}}'
    try:
        tests = json.loads(_text(path, index, row, "reward_model"))["ground_truth"]
        inputs, outputs = tests["inputs"], tests["outputs"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise row_error(path, index, expected, row.get("reward_model")) from error
    if (not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs)
            or not inputs or not all(isinstance(text, str) for text in inputs + outputs)):
        raise row_error(path, index, "as many string inputs as outputs, at least one", tests)
    ground_truth = json.dumps({"inputs": inputs, "outputs": outputs})
    return _Row(problem, livecodebench_prompt(problem, inputs, outputs, tools), ground_truth)


_ROW_READERS: dict[Layout, Callable[[Path, int, dict, bool], _Row]] = {
    Layout.AIME2024: _aime2024, Layout.AIME2025: _aime2025, Layout.GPQA_DIAMOND: _gpqa,
    Layout.LIVECODEBENCH_V6: _livecodebench,
}


def _eval_tasks(path: Path, table: pa.Table, layout: Layout, prompt_style: PromptStyle, tools: bool) -> list[Task]:
    tasks = []
    for index, row in enumerate(table.to_pylist()):
        source = row.get("data_source")
        if not isinstance(source, str) or not source:
            raise row_error(path, index, "a non-empty string `data_source`", source)
        read = _ROW_READERS[layout](path, index, row, tools)
        content = read.reference_prompt if prompt_style == PromptStyle.REFERENCE else read.problem
        tasks.append(Task(f"{source}-{index}", ({"role": "user", "content": content},), read.ground_truth, source,
                          index))
    return tasks


# ---------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class LoadedDataset:
    path: Path
    layout: Layout
    tasks: list[Task]


def load_dataset(path: Path | str, prompt_style: PromptStyle = PromptStyle.REFERENCE,
                 limit: int | None = None, tools: bool = True) -> LoadedDataset:
    """The tasks of a dataset file in any known layout (the first `limit` rows if given); with
    `tools` off, the reference's prompts of its no-tool baseline (prompts.py)."""
    path, prompt_style = Path(path), PromptStyle(prompt_style)
    table = read_parquet_table(path)
    layout = detect_layout(path, table.column_names)
    if limit is not None:
        table = table.slice(0, limit)
    if layout == Layout.VERL:
        return LoadedDataset(path, layout, verl_tasks(path, table, prompt_style, tools))
    return LoadedDataset(path, layout, _eval_tasks(path, table, layout, prompt_style, tools))
