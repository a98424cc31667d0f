"""The paper's pass-rate filter as functions: dataset rows matched to statistics, categories by data
source, and the per-rate, per-category draws (docs/architecture.md §16).

Design decisions, each the reference's (`filter_dataset_by_statistics.py`) unless it says otherwise:
- A row matches the statistics of its uid; rows without statistics are dropped, and counted. Where
  the dataset or the statistics hold a uid more than once (verl files that number each data source
  from 0), the data source must match too; the reference matches the uid alone and keeps the last
  line of a repeated one.
- A prompt's category comes from its STATISTICS' data source (`category_of`): the reference's table
  of names, lower-cased, first by exact name, then by the first name of the table, in its order,
  that contains the source or that the source contains; `other` for none, null or `unknown`.
- For each success rate and each of code / non-code, floor(count x ratio) prompts are kept, the
  product taken in floating point as the reference's `int(count * ratio)` (so 100 x 0.57 keeps 56).
  With `retain_code`, code prompts keep ratio 1.0 at every rate but 0. All are kept when the count
  reaches the pool, none at 0, and otherwise they are drawn by numpy's legacy generator, seeded
  seed + int(1000 x rate) for code and seed + 1 + int(1000 x rate) for the rest, with
  `choice(pool, size, replace=False)` over the pool in dataset order: with seed 42, the reference's
  very draws, so the same prompts are kept.
- The rates are the fractions that occur (successes / attempts, exact), so attempts other than 8
  work; the reference's loop visits i/8 alone and drops a prompt at any other rate.
- Kept rows stay in the dataset's order.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from cleaner.engine.curate.stats import UNKNOWN_SOURCE, PromptStats

# The reference's DATA_SOURCE_CATEGORY, in its order (the order decides substring matches).
CATEGORY_NAMES = (
    ("code", ("leetcode", "codeforces", "apps", "mbpp", "humaneval", "codecontests", "taco", "code", "programming",
              "bigcodebench", "livecodebench")),
    ("math", ("math", "gsm8k", "mathqa", "aime", "olympiad", "competition_math", "algebra", "geometry",
              "number_theory", "counting", "prealgebra", "precalculus", "intermediate_algebra", "amc", "numina",
              "deepscaler", "open-r1-math")),
    ("science", ("scibench", "scienceqa", "physics", "chemistry", "biology", "science", "gpqa")),
)
TABLE = tuple((name, category) for category, names in CATEGORY_NAMES for name in names)
CATEGORIES = ("code", "math", "science", "other")
CODE = "code"


def category_of(data_source: str | None) -> str:
    """The reference's category of a data source: code, math, science or other."""
    if data_source is None or data_source == UNKNOWN_SOURCE:
        return "other"
    lowered = data_source.lower()
    exact = dict(TABLE)
    if lowered in exact:
        return exact[lowered]
    return next((category for name, category in TABLE if name in lowered or lowered in name), "other")


# ---------------------------------------------------------------------------------------------
# Matching


def match_rows(uids: Sequence[str], sources: Sequence[str], stats: Sequence[PromptStats]) -> list[PromptStats | None]:
    """Each dataset row's statistics (None: it has none): by uid, and by data source too where the
    dataset or the statistics repeat the uid."""
    by_uid: dict[str, list[PromptStats]] = defaultdict(list)
    for item in stats:
        by_uid[item.uid].append(item)
    repeated = Counter(uids)
    matched = []
    for uid, source in zip(uids, sources, strict=True):
        candidates = by_uid.get(uid, [])
        if len(candidates) == 1 and repeated[uid] == 1:
            matched.append(candidates[0])
        else:
            matched.append(next((item for item in candidates if item.data_source == source), None))
    return matched


# ---------------------------------------------------------------------------------------------
# The draws


@dataclass(frozen=True)
class Draw:
    """One (rate, category) pool and what was kept of it."""

    pool: int  # prompts at the rate in the category
    ratio: float  # the ratio applied
    kept: int  # floor(pool x ratio)
    seed: int | None  # the draw's seed; None when all or none were kept (no draw)


@dataclass(frozen=True)
class Level:
    """A success rate's prompts, code and the rest."""

    rate: Fraction
    code: Draw
    other: Draw

    @property
    def prompts(self) -> int:
        return self.code.pool + self.other.pool

    @property
    def kept(self) -> int:
        return self.code.kept + self.other.kept


@dataclass(frozen=True)
class Selection:
    """What the filter kept of a dataset's rows with statistics."""

    kept_rows: tuple[int, ...]  # dataset row positions, in dataset order
    levels: tuple[Level, ...]  # by rate, ascending: every rate of a matched prompt, and every rate named
    matched: tuple[PromptStats | None, ...]  # each dataset row's statistics (None: none, or without attempts)


def select(matched: Sequence[PromptStats | None], ratios: Mapping[Fraction, float], retain_code: bool = False,
           seed: int = 42) -> Selection:
    """The rows kept (module notes); `ratios` maps a success rate to its ratio (1.0 where absent)."""
    usable = tuple(item if item is not None and item.attempts else None for item in matched)
    pools: dict[tuple[Fraction, bool], list[int]] = defaultdict(list)
    for row, item in enumerate(usable):
        if item is not None:
            pools[(item.rate, category_of(item.data_source) == CODE)].append(row)
    levels, kept = [], []
    for rate in sorted({rate for rate, _ in pools} | set(ratios)):
        ratio = ratios.get(rate, 1.0)
        code_ratio = 1.0 if retain_code and rate != 0 else ratio
        offset = int(float(rate) * 1000)
        code = _draw(pools.get((rate, True), []), code_ratio, seed + offset, kept)
        other = _draw(pools.get((rate, False), []), ratio, seed + 1 + offset, kept)
        levels.append(Level(rate, code, other))
    return Selection(tuple(sorted(kept)), tuple(levels), usable)


def _draw(pool: list[int], ratio: float, seed: int, kept: list[int]) -> Draw:
    """floor(len(pool) x ratio) rows of `pool`, appended to `kept`: all, none, or drawn as the reference draws."""
    size = math.floor(len(pool) * ratio)
    if size >= len(pool) or size == 0:
        kept.extend(pool if size else [])
        return Draw(len(pool), ratio, size, None)
    chosen = np.random.RandomState(seed).choice(len(pool), size=size, replace=False)  # (size,) indices into pool
    kept.extend(pool[index] for index in chosen)
    return Draw(len(pool), ratio, size, seed)


# ---------------------------------------------------------------------------------------------
# Counts before and after


@dataclass(frozen=True)
class Count:
    """Prompts of one data source or category with statistics, and those kept."""

    name: str
    before: int
    after: int


def counts_by(selection: Selection, key) -> list[Count]:
    """Counts per `key(statistics)` over the rows with statistics, sorted by name."""
    kept = set(selection.kept_rows)
    before, after = Counter(), Counter()
    for row, item in enumerate(selection.matched):
        if item is not None:
            before[key(item)] += 1
            after[key(item)] += row in kept
    return [Count(name, before[name], after[name]) for name in sorted(before)]


def by_source(selection: Selection) -> list[Count]:
    return counts_by(selection, lambda item: str(item.data_source))


def by_category(selection: Selection) -> list[Count]:
    """Code, math, science and other, in that order (empty ones too), as the reference prints them."""
    found = {count.name: count for count in counts_by(selection, lambda item: category_of(item.data_source))}
    return [found.get(name, Count(name, 0, 0)) for name in CATEGORIES]
