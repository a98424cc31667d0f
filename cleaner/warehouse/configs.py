"""The warehouse's JSON files (docs/architecture.md §3): resolved configs in `<root>/configs/`, read
whole and never queried, and the plan a collection records (what the readers' gate counts an
iteration's rollouts against, warehouse/gate.py).

A file that does not parse is a WarehouseError naming it, one line, never a traceback: a truncated
copy or an edit is the user's to restore.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from cleaner.errors import write_error
from cleaner.warehouse.format import migrated
from cleaner.warehouse.parts import WarehouseError


@dataclass(frozen=True)
class CollectPlan:
    """What a collection of an iteration set out to store: a group of each prompt."""

    prompt_ids: tuple[str, ...]
    group_size: int
    next_row: int | None = None  # skip_settled_prompts: the dataset row the next iteration's walk starts at
    skipped: tuple[tuple[str, int], ...] = ()  # skip_settled_prompts: (prompt, the iteration it settled at) passed over


class ConfigFiles:
    """The JSON files of the warehouse at `root` (a part of `Warehouse`, which checks writes)."""

    root: Path

    def check_writable(self) -> None:
        raise NotImplementedError

    def format_version(self) -> int:
        raise NotImplementedError

    def save_eval_config(self, eval_id: str, config_json: str) -> Path:
        return self.save_config(f"eval-{eval_id}", config_json)

    def eval_config(self, eval_id: str) -> str | None:
        return self.load_config(f"eval-{eval_id}")

    def eval_config_ids(self) -> list[str]:
        """The evaluations whose config is stored (file names only)."""
        return sorted(path.stem.removeprefix("eval-") for path in (self.root / "configs").glob("eval-*.json"))

    def save_config(self, name: str, config_json: str) -> Path:
        """Write `<root>/configs/<name>.json` atomically (temp file + rename)."""
        self.check_writable()
        directory = self.root / "configs"
        path = directory / f"{name}.json"
        temporary = directory / f".{name}.json.{os.getpid()}.{uuid.uuid4().hex}.tmp"  # shards save at once
        try:
            directory.mkdir(parents=True, exist_ok=True)
            temporary.write_text(config_json)
            os.replace(temporary, path)
        except OSError as error:  # a full disk: one line naming the file
            temporary.unlink(missing_ok=True)
            raise write_error(path, error) from error
        return path

    def load_config(self, name: str) -> str | None:
        """The text of `<root>/configs/<name>.json` (None if absent) in this version's shape (format.py);
        WarehouseError naming the file if it is not one JSON value (a truncated copy, an edit)."""
        path = self.root / "configs" / f"{name}.json"
        try:
            text = path.read_text()
            json.loads(text)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:  # a JSONDecodeError, or bytes that are not UTF-8
            raise WarehouseError(f"{path}: not a config cleaner wrote ({str(error).splitlines()[0]}); it is "
                                 "truncated or was edited: restore it from a copy of the warehouse") from error
        return migrated(name, text, self.format_version())

    def save_collect_config(self, iteration: int, config_json: str) -> Path:
        """The resolved config an iteration was collected with (its `model` is the collecting policy)."""
        return self.save_config(f"collect-iteration={iteration}", config_json)

    def collect_config(self, iteration: int) -> str | None:
        return self.load_config(f"collect-iteration={iteration}")


    def save_plan(self, iteration: int, plan: CollectPlan) -> None:
        """Record what the iteration's collection plans (every shard's, so each shard writes the same)."""
        extra = {} if plan.next_row is None else {"next_row": plan.next_row, "skipped": [list(s) for s in plan.skipped]}
        self.save_config(_plan_name(iteration), json.dumps({"prompt_ids": list(plan.prompt_ids),
                                                            "group_size": plan.group_size, **extra}))

    def plan(self, iteration: int) -> CollectPlan | None:
        """The iteration's recorded plan; None if an older cleaner collected it."""
        text = self.load_config(_plan_name(iteration))
        if text is None:
            return None
        try:
            found = json.loads(text)
            skipped = tuple((str(prompt), int(settled)) for prompt, settled in found.get("skipped", ()))
            next_row = found.get("next_row")
            return CollectPlan(tuple(str(p) for p in found["prompt_ids"]), int(found["group_size"]),
                               None if next_row is None else int(next_row), skipped)
        except (TypeError, KeyError, ValueError) as error:
            raise WarehouseError(f"{self.root}/configs/{_plan_name(iteration)}.json: not the plan cleaner writes "
                                 f"({error}): restore it from a copy of the warehouse") from error


    def planned_iterations(self) -> list[int]:
        """The iterations whose collection recorded its plan (file names only)."""
        return sorted(int(path.stem.split("=", 1)[1]) for path in (self.root / "configs").glob(f"{_plan_name('*')}.json"))


def _plan_name(iteration: int | str) -> str:
    return f"collect-plan-iteration={iteration}"
