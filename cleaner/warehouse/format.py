"""The warehouse's format version, and the steps that read what an earlier version stored
(docs/architecture.md §9).

Design decisions:
- The version is recorded in the identity file (`ownership.py`) when the warehouse is first claimed:
  `FORMAT_VERSION` if no part is there yet, else 1 (an older cleaner wrote its parts). A warehouse
  without the record, or whose record predates it, is version 1: everything main wrote up to a9d807d.
  The version says what its oldest data is, so it never rises by a write: only a step that
  rewrites the data could raise it.
- Reading goes through one step per version (`MIGRATIONS[N]` takes version N's shape to N+1's),
  over a stored config's JSON by its name under configs/; a step leaves data already in the next
  version's shape as it is, so version 1's step also reads what main wrote without the record.
- Ids are not migrated: every config keeps the id it was stored under (settings.py's `setting`
  decides which fields count). The one id an earlier version computed otherwise, an evaluation's
  (version 1 before it hashed every field, scheduling included), is found through its stored
  config: eval's `stored_evaluation` looks for one only in a version-1 warehouse.
"""

from __future__ import annotations

import json
from collections.abc import Callable

FORMAT_VERSION = 2


def _train_table(table: dict) -> dict:
    """Train's `truncated_is` with its `is_cap` was the token level of rollout correction."""
    table = dict(table)
    truncated, cap = table.pop("truncated_is", None), table.pop("is_cap", None)
    if truncated:
        table.setdefault("rollout_is", "token")
        table.setdefault("rollout_is_threshold", cap if cap is not None else 2.0)
    return table


def _from_1(name: str, saved: object) -> object:
    """Version 1 -> 2: the train tables of a run's config and of each iteration's training."""
    if name.startswith("train-") and isinstance(saved, dict):
        return _train_table(saved)
    if name == "run" and isinstance(saved, dict) and isinstance(saved.get("train"), dict):
        return {**saved, "train": _train_table(saved["train"])}
    return saved


MIGRATIONS: dict[int, Callable[[str, object], object]] = {1: _from_1}


def migrated(name: str, text: str, version: int) -> str:
    """The text of config `name` stored by a warehouse of `version`, in this version's shape."""
    if version >= FORMAT_VERSION:
        return text
    original = saved = json.loads(text)
    for step in range(version, FORMAT_VERSION):
        saved = MIGRATIONS[step](name, saved)
    return text if saved == original else json.dumps(saved, sort_keys=True)
