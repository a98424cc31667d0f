"""The recipes (recipes/*.toml) against their table in docs/recipes.md: every field the table
names resolves, in each recipe, to the table's value; every setting a recipe file makes is in the
table; and, given the reference's checkout (CLEANER_REFERENCE=path to Open-CLEANER), every flag of
each script is in the table with the script's own value."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleaner.cli import app

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("qwen3_4b_cleaner", "qwen3_4b", "qwen3_4b_notool", "qwen2_7b_cleaner")  # the table's order
NOT_CARRIED = "—"
COMMAND_LINE = "command line"


def _tables() -> list[list[list[str]]]:
    """The rows (cells, backticks kept) of every table of docs/recipes.md whose header has a
    `cleaner field` column, header and rule dropped."""
    tables, current = [], None
    for line in (ROOT / "docs" / "recipes.md").read_text().splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if current is None:
            current = [] if "cleaner field" in cells else None
            if current is not None:
                tables.append(current)
            continue
        if set(cells[0]) <= set("- "):
            continue
        current.append(cells)
    return tables


def _per_recipe(cell: str) -> list[str]:
    """A cell's four values: one for all, or `a / b / c / d` in RECIPES' order."""
    values = cell.split(" / ")
    assert len(values) in (1, len(RECIPES)), f"{cell!r}: one value or {len(RECIPES)}"
    return values * len(RECIPES) if len(values) == 1 else values


def _value(text: str) -> object:
    """A cleaner cell's value: a TOML literal, or `none` for a field left unset."""
    return None if text == "none" else tomllib.loads(f"v = {text}")["v"]


def _resolved(recipe: str) -> dict:
    result = CliRunner().invoke(app, ["run", "--config", str(ROOT / "recipes" / f"{recipe}.toml"), "--print-config"])
    assert result.exit_code == 0, result.output
    return tomllib.loads(result.output)


def _lookup(config: dict, field: str) -> object:
    node = config
    for key in field.split("."):
        if key not in node:
            return None  # TOML has no null: an unset field is left out
        node = node[key]
    return node


def _fields() -> list[tuple[str, str]]:
    """(field, cleaner cell) of every row that names a field."""
    rows = [row for table in _tables() for row in table]
    return [(row[2].strip("`"), row[3]) for row in rows if row[2] != NOT_CARRIED]


def test_every_field_of_the_table_resolves_to_its_value_in_each_recipe():
    checked = 0
    for index, recipe in enumerate(RECIPES):
        config = _resolved(recipe)
        for field, cell in _fields():
            if cell == COMMAND_LINE:
                continue
            expected = _value(_per_recipe(cell)[index])
            assert _lookup(config, field) == expected, f"{recipe}: {field}"
            checked += 1
    assert checked >= 40 * len(RECIPES)


def test_every_setting_a_recipe_makes_is_in_the_table():
    documented = {field for field, _ in _fields()}
    for recipe in RECIPES:
        data = tomllib.loads((ROOT / "recipes" / f"{recipe}.toml").read_text())
        made = {key for key, value in data.items() if not isinstance(value, dict)}
        for table, values in data.items():
            if isinstance(values, dict):
                made |= {f"{table}.{key}" for key in values}
        assert made - documented == set(), recipe


def test_the_paper_setting_prints_as_the_table_says():
    """Spot checks a reader sees in `--print-config`, against the script's numbers by hand."""
    cleaner, baseline = _resolved("qwen3_4b_cleaner"), _resolved("qwen3_4b")
    assert cleaner["collect"]["n_prompts"] * cleaner["collect"]["group_size"] == 128 * 16
    assert cleaner["train"]["mini_batch_size"] == 32 * 16
    assert cleaner["train"]["warmup_steps"] == 20 * (128 * 16 // 512)
    assert cleaner["train"]["max_tokens_per_micro_batch"] == 2560 + 20480
    assert cleaner["purify"]["gamma"] == 0.5 and cleaner["purify"]["rollback_prob"] == 1.0  # follow collect's
    assert baseline["purify"]["rollback_prob"] == 0.0 and baseline["train"]["rollout_is"] == "sequence"
    assert "rollout_is" not in cleaner["train"]


# ---------------------------------------------------------------------------------------------
# The scripts themselves (the reference's checkout)


def script_flags(path: Path) -> dict[str, str]:
    """The `key=value` arguments of a reference training script, its shell variables expanded
    (`$x`, `${x}`, `$(( ... ))`), quotes dropped, Hydra's `+` dropped, up to its first comment."""
    env: dict[str, str] = {}

    def expand(text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda match: env.get(match.group(1), ""), text)

    flags: dict[str, str] = {}
    lines = iter(path.read_text().splitlines())
    for line in lines:
        text = line.strip()
        if text.startswith("python3 "):
            break
        assignment = re.match(r"^(?:export\s+)?(\w+)=(.*)$", text)
        if assignment:
            name, value = assignment.groups()
            value = re.sub(r"\s+#.*$", "", value).strip()
            arithmetic = re.fullmatch(r"\$\(\((.*)\)\)", value)
            if arithmetic:
                expression = re.sub(r"[A-Za-z_]\w*", lambda match: env.get(match.group(0), match.group(0)),
                                    expand(arithmetic.group(1)))
                value = str(eval(expression, {"__builtins__": {}}))  # the script's own integer arithmetic
            env[name] = _unquoted(expand(value))
    for line in lines:
        text = line.strip()
        if not text or text.startswith("#"):
            break  # the command ends at its first comment line
        key, _, value = text.rstrip("\\").strip().partition("=")
        flags[key.lstrip("+")] = _unquoted(expand(value))
    return flags


def _unquoted(value: str) -> str:
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


REFERENCE = os.environ.get("CLEANER_REFERENCE")
PLACEHOLDERS = {"data.train_files": "the data", "data.val_files": "AIME 2025, 2024",
                "actor_rollout_ref.model.path": "the model"}  # the user's paths, not a setting


@pytest.mark.skipif(REFERENCE is None, reason="CLEANER_REFERENCE (an Open-CLEANER checkout) not set")
def test_every_flag_of_every_script_is_in_the_table_with_its_value():
    scripts = {recipe: script_flags(Path(REFERENCE) / "recipe" / "cleaner" / f"{recipe}.sh") for recipe in RECIPES}
    (flag_table, *_) = _tables()
    rows = {row[0].strip("`"): row[1] for row in flag_table}
    flags = {flag for flags in scripts.values() for flag in flags}
    assert flags - rows.keys() == set(), "flags the table lacks"
    assert rows.keys() - flags == set(), "rows of no script's flag"
    for flag, cell in rows.items():
        if flag in PLACEHOLDERS:
            assert cell == PLACEHOLDERS[flag]
            continue
        assert _per_recipe(cell) == [scripts[recipe].get(flag, "–") for recipe in RECIPES], flag
