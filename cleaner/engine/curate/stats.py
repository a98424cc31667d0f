"""Pass statistics per prompt: the paper's JSON Lines format, read and written, and the key that ties a
prompt's statistics to its dataset row (docs/architecture.md §16).

Design decisions:
- The format is the one Open-CLEANER ships (`Open-AgentRL-30K.filtered.parquet.success.jsonl`, written
  by its `recipe/cleaner/dataset_filter.py`): one JSON object per line with `uid`, `data_source`,
  `successes`, `attempts`, `success_rate`, `avg_score`, `keep`, in that order, so its file and ours are
  interchangeable. Reading is strict: a line that is not such an object (a missing or mistyped field,
  successes outside [0, attempts], a success_rate that is not successes / attempts) is an error naming
  the file and line; `data_source` may be missing, read as `unknown` as the reference does. A line
  with 0 attempts (the reference writes them for prompts its validation never reached) has no rate:
  it is kept as a prompt without statistics. The same (uid, data_source) twice is an error.
- `keep` is written as the shipped file has it (success_rate < 1: its filter's min 0, max below 1)
  and never read for a decision, as the paper's filter ignores it too.
- The key (`uid`). cleaner's loader names a verl row `<data_source>-<extra_info.index>` (else the
  row's position; collect/tasks.py), so a warehouse prompt's uid is its prompt id without the
  `<data_source>-` prefix (`uid_of`). A dataset row's uid is its `uid` column where the file has one
  (the reference's rule), else `extra_info.index`, else its position (`dataset_uids`): the two agree
  for every file cleaner collects from, unless it holds a `uid` column of other values.
- The statistics of a warehouse are its rollouts pooled per prompt over the iterations and
  evaluations named: successes are correct rollouts, attempts the rollouts the policy decided,
  avg_score their mean reward. A rollout an infrastructure fault ended (a failed generation, or a
  call that kept failing with `infra_error`) says nothing of the prompt's difficulty: it counts in
  neither, as purify leaves it out of its group's statistics; a prompt with no other rollout has no
  statistics.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from cleaner.engine.collect.tasks import row_error
from cleaner.errors import CleanerError

FIELDS = ("uid", "data_source", "successes", "attempts", "success_rate", "avg_score", "keep")
UNKNOWN_SOURCE = "unknown"  # a line without data_source, as the reference reads it


class StatsError(CleanerError, ValueError):
    """A statistics file that is not the format; the message names the file and line."""


@dataclass(frozen=True)
class PromptStats:
    """One prompt's pass statistics (one line of the format)."""

    uid: str  # the prompt's key in its dataset (module notes)
    data_source: str | None  # the prompt's data source (None: null in the file); decides its category
    successes: int  # correct rollouts
    attempts: int  # rollouts the policy decided
    avg_score: float  # their mean reward
    line: int = 0  # the file's line it was read from (1-based); 0: from a warehouse

    @property
    def rate(self) -> Fraction | None:
        """successes / attempts, exact; None without attempts."""
        return Fraction(self.successes, self.attempts) if self.attempts else None

    def to_json(self) -> str:
        rate = self.successes / self.attempts if self.attempts else 0.0
        values = (self.uid, self.data_source, self.successes, self.attempts, rate, self.avg_score, rate < 1.0)
        return json.dumps(dict(zip(FIELDS, values, strict=True)), ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Keys


def uid_of(prompt_id: str, data_source: str) -> str:
    """A warehouse prompt's uid: its prompt id without the `<data_source>-` prefix the loader gave it."""
    prefix = f"{data_source}-"
    return prompt_id[len(prefix):] if prompt_id.startswith(prefix) and len(prompt_id) > len(prefix) else prompt_id


def dataset_uids(path: Path, extra_infos: Sequence[object], uid_column: Sequence[object] | None) -> list[str]:
    """Each dataset row's uid: its `uid` column's value, else `extra_info.index`, else its position;
    DatasetError naming the row of a null uid."""
    if uid_column is not None:
        for index, value in enumerate(uid_column):
            if value is None:
                raise row_error(path, index, "a non-null `uid`", value)
        return [_text(value) for value in uid_column]
    keys = (extra.get("index") if isinstance(extra, dict) else None for extra in extra_infos)
    return [_text(index if key is None else key) for index, key in enumerate(keys)]


def _text(value: object) -> str:
    """A key as the reference compares keys: `str()` of the value (pandas' astype(str))."""
    return value if isinstance(value, str) else str(value)


# ---------------------------------------------------------------------------------------------
# Pooling a warehouse's rollouts


def pooled(prompt_id: str, data_source: str, successes: int, attempts: int, reward_sum: float) -> PromptStats | None:
    """The statistics of a prompt from its decided rollouts (None when an infrastructure fault ended
    every one of them)."""
    if attempts == 0:
        return None
    return PromptStats(uid_of(prompt_id, data_source), data_source, successes, attempts, reward_sum / attempts)


def ordered(stats: Iterable[PromptStats]) -> list[PromptStats]:
    """Statistics in a stable order: by data source, then numeric uids in number order, then the rest."""
    def key(item: PromptStats) -> tuple:
        digits = item.uid.isdigit()
        return (item.data_source or "", not digits, int(item.uid) if digits else 0, item.uid)
    return sorted(stats, key=key)


def write_lines(stats: Sequence[PromptStats]) -> str:
    return "".join(item.to_json() + "\n" for item in stats)


# ---------------------------------------------------------------------------------------------
# Reading a file


def read_stats(path: Path) -> list[PromptStats]:
    """Every line of a statistics file (blank lines skipped); StatsError naming the file and line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as error:
        raise StatsError(f"--stats {path}: no such file") from error
    except (OSError, UnicodeDecodeError) as error:
        raise StatsError(f"--stats {path}: cannot be read as UTF-8 text ({error})") from error
    stats, first = [], {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        item = _parse_line(path, number, line)
        key = (item.uid, item.data_source)
        if key in first:
            raise StatsError(f"{path}: line {number}: uid {item.uid!r} of data source {item.data_source!r} is already "
                             f"on line {first[key]}; each prompt's statistics come once")
        first[key] = number
        stats.append(item)
    if not stats:
        raise StatsError(f"--stats {path}: the file holds no statistics (expected one JSON object per line with "
                         f"{', '.join(FIELDS)})")
    return stats


def _parse_line(path: Path, number: int, line: str) -> PromptStats:
    where = f"{path}: line {number}"
    try:
        data = json.loads(line)
    except ValueError as error:
        raise StatsError(f"{where}: not a JSON object ({error.args[0]}); expected one per line with "
                         f"{', '.join(FIELDS)}") from error
    if not isinstance(data, dict):
        raise StatsError(f"{where}: expected a JSON object with {', '.join(FIELDS)}, got {type(data).__name__}")
    missing = [name for name in FIELDS if name not in data and name != "data_source"]
    if missing:
        raise StatsError(f"{where}: missing {', '.join(missing)}; expected {', '.join(FIELDS)}")
    uid, source = data["uid"], data.get("data_source", UNKNOWN_SOURCE)
    successes, attempts, rate, score = (data[name] for name in ("successes", "attempts", "success_rate", "avg_score"))
    _expect(where, "uid", uid, isinstance(uid, str | int) and not isinstance(uid, bool), "a string or an integer")
    _expect(where, "data_source", source, source is None or isinstance(source, str), "a string")
    for name, value in (("successes", successes), ("attempts", attempts)):
        _expect(where, name, value, _integer(value) and value >= 0, "an integer >= 0")
    _expect(where, "successes", successes, successes <= attempts, f"at most attempts ({attempts})")
    for name, value in (("success_rate", rate), ("avg_score", score)):
        _expect(where, name, value, _number(value), "a finite number")
    expected = successes / attempts if attempts else None
    _expect(where, "success_rate", rate, expected is None or abs(rate - expected) <= 1e-6,
            f"successes / attempts ({successes}/{attempts})")
    _expect(where, "keep", data["keep"], isinstance(data["keep"], bool), "true or false")
    return PromptStats(_text(uid), source, int(successes), int(attempts), float(score), number)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _expect(where: str, name: str, value: object, holds: bool, expected: str) -> None:
    if not holds:
        raise StatsError(f"{where}: `{name}` must be {expected}, got {value!r}")
