"""Tasks: the toy arithmetic family and verl-style RL Parquet datasets.

Design decisions:
- A `Task` is the unit the agent loop samples a GRPO group for: chat messages, the ground truth
  and the `data_source` that selects the reward (cleaner/engine/grading/).
- The toy family asks for `(A * B + C) mod D` with 3-digit A, B, C: too long to do in the head of
  a 0.5M-parameter model, easy with the Python tool. It is deterministic in (n, seed), and the
  numbers of prompt i depend only on (seed, i), so `toy_tasks(10, s)[:5] == toy_tasks(5, s)`.
- `load_rl_parquet` reads the Open-AgentRL-30K layout (`prompt`, `reward_model.ground_truth`,
  `data_source`, optional `extra_info`); with `PromptStyle.REFERENCE` (the default) the prompts get
  the reference's additions for training sources (prompts.py), with `BARE` they stay as stored.
  The ground truth reaches a user's reward function as the row held it (a string, a number, a
  struct as a dict, a list), as verl hands it over; it is stored as text (JSON where it is not a
  string), and the built-in grader takes a list's first item as the accepted answer.
  The evaluation layouts are read by datasets.py. Every bad file or row raises `DatasetError` (a
  ValueError) naming the file, the row and what was expected; nothing is silently skipped.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.config import PromptStyle
from cleaner.engine.collect.prompts import reference_training_messages
from cleaner.errors import CleanerError
from cleaner.plugins import plain

TOY_SOURCE = "toy"


class DatasetError(CleanerError, ValueError):
    """A dataset file that cannot be read as tasks; the message names the file, row and expectation."""

# Phrasings of the same question; the expression is always (A * B + C) mod D.
TOY_TEMPLATES = (
    "What is ({a} * {b} + {c}) mod {d}?",
    "Compute ({a} * {b} + {c}) mod {d}.",
    "Find the remainder when {a} * {b} + {c} is divided by {d}.",
)


@dataclass(frozen=True)
class Task:
    prompt_id: str
    messages: tuple[dict, ...]  # chat messages {"role", "content"}: system optional, then user
    ground_truth: str  # as text, as stored (rollouts.ground_truth): a string as is, anything else as JSON
    data_source: str  # selects the reward; "toy" for the toy family
    source_row: int | None = None  # its row in the dataset file (errors name it); None for toy tasks
    extra_info: object = None  # the row's `extra_info` (a reward function gets it, as verl's do); None: none
    truth: object = None  # the row's ground truth as the file held it (a user's reward function gets it
    #                       as verl hands it: a dict, a list, a number); None: `ground_truth` is all there is

    @property
    def raw_truth(self) -> object:
        """What a verl reward function gets as `ground_truth`: the value as the row held it."""
        return self.ground_truth if self.truth is None else self.truth

    @property
    def graded_truth(self) -> str:
        """What the built-in grader compares against: the text, a list's first accepted answer."""
        if isinstance(self.truth, list):
            first = self.truth[0]
            return first if isinstance(first, str) else json.dumps(first, ensure_ascii=False)
        return self.ground_truth


@dataclass(frozen=True)
class ToyProblem:
    """The numbers behind one toy prompt (the corpus writes code from them)."""

    a: int
    b: int
    c: int
    d: int
    template: int  # index into TOY_TEMPLATES

    @property
    def question(self) -> str:
        return TOY_TEMPLATES[self.template].format(a=self.a, b=self.b, c=self.c, d=self.d)

    @property
    def answer(self) -> int:
        return (self.a * self.b + self.c) % self.d


# ---------------------------------------------------------------------------------------------
# Toy family


def toy_problem(seed: int, index: int) -> ToyProblem:
    """The problem of prompt `index` under `seed` (independent of how many are drawn)."""
    rng = random.Random(f"toy/{seed}/{index}")
    return ToyProblem(
        a=rng.randint(100, 999),
        b=rng.randint(100, 999),
        c=rng.randint(100, 999),
        d=rng.randint(11, 97),
        template=rng.randrange(len(TOY_TEMPLATES)),
    )


def toy_tasks(n: int, seed: int) -> list[Task]:
    """`n` toy tasks, deterministic in (n, seed); prompt ids are `toy-<seed>-<i>`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    tasks = []
    for index in range(n):
        problem = toy_problem(seed, index)
        tasks.append(Task(
            prompt_id=f"toy-{seed}-{index}",
            messages=({"role": "user", "content": problem.question},),
            ground_truth=str(problem.answer),
            data_source=TOY_SOURCE,
        ))
    return tasks


# ---------------------------------------------------------------------------------------------
# verl-style RL Parquet

REQUIRED_COLUMNS = ("prompt", "reward_model", "data_source")


def row_error(path: Path, index: int, expected: str, got: object) -> DatasetError:
    return DatasetError(f"{path}: row {index}: expected {expected}, got {got!r:.120}")


def _parse_messages(path: Path, index: int, prompt: object) -> tuple[dict, ...]:
    if hasattr(prompt, "tolist"):  # numpy arrays from pandas-style readers
        prompt = prompt.tolist()
    if not isinstance(prompt, list) or not prompt:
        raise row_error(path, index, "`prompt` as a non-empty list of {role, content}", prompt)
    messages = []
    for message in prompt:
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)):
            raise row_error(path, index, "each `prompt` message to have string role and content", message)
        messages.append({"role": message["role"], "content": message["content"]})
    if messages[-1]["role"] != "user":
        raise row_error(path, index, "the last `prompt` message to be the user's", messages[-1]["role"])
    return tuple(messages)


def _parse_row(path: Path, index: int, row: dict, style: PromptStyle, file_source: str, tools: bool) -> Task:
    messages = _parse_messages(path, index, row["prompt"])
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise row_error(path, index, "`reward_model` as a struct with `ground_truth`", reward_model)
    truth = plain(reward_model["ground_truth"])  # numpy values of a pandas-written file as Python's
    if not _usable_truth(truth):
        raise row_error(path, index, "a non-empty `reward_model.ground_truth` (a string, a number, a struct, or a "
                                     "list of accepted answers)", truth)
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise row_error(path, index, "a non-empty string `data_source`", data_source)
    extra_info = row.get("extra_info")
    row_index = extra_info.get("index") if isinstance(extra_info, dict) else None
    prompt_id = f"{data_source}-{row_index if row_index is not None else index}"
    if style == PromptStyle.REFERENCE:
        messages = reference_training_messages(messages, file_source, data_source, tools)
    text = truth if isinstance(truth, str) else json.dumps(truth, ensure_ascii=False)
    return Task(prompt_id, messages, text, data_source, index, extra_info, None if isinstance(truth, str) else truth)


def _usable_truth(truth: object) -> bool:
    """A ground truth a grader can hold: a non-empty string, a finite number, a non-empty struct, or
    a non-empty list whose first item (the built-in grader's accepted answer) is one of those."""
    if isinstance(truth, bool):
        return False
    if isinstance(truth, str):
        return truth != ""
    if isinstance(truth, int | float):
        return math.isfinite(truth)
    if isinstance(truth, dict):
        return bool(truth)
    if isinstance(truth, list):
        return bool(truth) and not isinstance(truth[0], list) and _usable_truth(truth[0])
    return False


def read_parquet_table(path: str | Path) -> pa.Table:
    """The whole table of a Parquet file; DatasetError naming it if it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such Parquet file")
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises several types for a corrupt file  # noqa: BLE001
        raise DatasetError(f"{path}: not a readable Parquet file ({error})") from error
    _check_values(path, table)
    return table


def _check_values(path: Path, table: pa.Table) -> None:
    """DatasetError naming the row and column of the first value Python cannot read: Parquet does
    not check that its strings are UTF-8, pyarrow does only when asked (`validate(full=True)`)."""
    try:
        table.validate(full=True)
        return
    except pa.ArrowInvalid:
        pass
    for name, column in zip(table.column_names, table.columns, strict=True):
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid as invalid:
            problem = invalid
        for index in range(len(column)):
            try:
                column[index].as_py()
            except UnicodeDecodeError as error:
                raise DatasetError(f"{path}: row {index}: column `{name}` holds text that is not valid UTF-8 "
                                   f"(byte 0x{error.object[error.start]:02x} at position {error.start} of a string); "
                                   "the file's text must be UTF-8") from error
        raise DatasetError(f"{path}: column `{name}` is not valid ({problem})")


def verl_tasks(path: Path, table: pa.Table, prompt_style: PromptStyle, tools: bool = True) -> list[Task]:
    """Tasks of a table in the verl RL layout. The reference picks a file's prompt mapping by its
    FIRST row's data source (prompts.py), so the whole table is needed, not row by row."""
    rows = table.to_pylist()
    file_source = rows[0].get("data_source") if rows else None
    file_source = file_source if isinstance(file_source, str) else ""
    tasks = [_parse_row(path, index, row, prompt_style, file_source, tools) for index, row in enumerate(rows)]
    _check_unique_ids(path, tasks)
    return tasks


def _check_unique_ids(path: Path, tasks: list[Task]) -> None:
    """DatasetError naming the rows that share a prompt id: the id names a GRPO group and its
    rollouts, so two rows under one id would be collected as one group and stored twice."""
    first: dict[str, int | None] = {}
    clashes: list[tuple[int | None, int | None, str]] = []
    for task in tasks:
        if task.prompt_id in first:
            clashes.append((first[task.prompt_id], task.source_row, task.prompt_id))
        else:
            first[task.prompt_id] = task.source_row
    if clashes:
        shown = ", ".join(f"rows {a} and {b} ({prompt_id!r})" for a, b, prompt_id in clashes[:3])
        more = f" and {len(clashes) - 3} more" if len(clashes) > 3 else ""
        raise DatasetError(f"{path}: {len(clashes)} row(s) repeat another row's prompt id (data_source and "
                           f"extra_info.index): {shown}{more}; each row's id names its GRPO group and must be "
                           "unique: give every row its own extra_info.index")


def check_verl_columns(path: Path, table: pa.Table) -> None:
    """DatasetError naming the file unless the table has the verl RL layout's columns."""
    missing = [name for name in REQUIRED_COLUMNS if name not in table.column_names]
    if missing:
        raise DatasetError(f"{path}: missing column(s) {missing}; expected {list(REQUIRED_COLUMNS)} "
                           f"(verl RL layout), found {table.column_names}")


def load_rl_parquet(path: str | Path, limit: int | None = None,
                    prompt_style: PromptStyle = PromptStyle.REFERENCE) -> list[Task]:
    """Read a verl-style RL Parquet file into tasks (the first `limit` rows if given)."""
    path = Path(path)
    table = read_parquet_table(path)
    check_verl_columns(path, table)
    if limit is not None:
        table = table.slice(0, limit)
    return verl_tasks(path, table, PromptStyle(prompt_style))
