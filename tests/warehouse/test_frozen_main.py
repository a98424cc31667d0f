"""A warehouse written by main at a9d807d (before this round's options), frozen as a fixture: every
config it stores keeps its id, every view reads, and the commands take it as main left it; the
CLI's flags and defaults, and the recipes' resolved configs, are main's plus this round's new
options at their defaults.

The fixture (tests/fixtures/main-a9d807d/) was made on main with `cleaner run --prompts 2
--group-size 4 --iterations 2 --max-new-tokens 96`, an ablation of iteration 1 (gamma 0.5,1.5 x edit
replace,mask x tau 0,0.5), `cleaner purify --iteration 0 --negative-samples --purify-when positive`
and a `cleaner eval` with --saar and --no-saar; `ids.json` holds the ids main computed, `flags.json`
every command's options and defaults, `recipes/` each recipe's `--print-config`. Its configs name
main's checkout (/work/main): where a command must load the policy, the test points them at this
checkout's. (A config's id holds its absolute paths, so an evaluation is found again only from the
paths it was run with: its ids are checked, not a rerun.)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import CollectConfig, PurifyConfig
from cleaner.engine.eval.job import stored_evaluation
from cleaner.warehouse import Warehouse
from tests.factories import as_format_1

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "main-a9d807d"
MAIN_ROOT = "/work/main"  # where main's checkout was: its configs name files under it
ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

# This round's new options, each at its default (a flag main had keeps its name and default).
_SELECTION = {"--down-sample": "none", "--down-sample-to": None, "--roc-min-negatives": 2, "--roc-min-positives": 2,
              "--roc-error-ratio/--no-roc-error-ratio": True, "--roc-answer-format/--no-roc-answer-format": True}
_PURIFY = {**_SELECTION, "--void-turn-filter/--no-void-turn-filter": False, "--adv-estimator": "grpo",
           "--norm-adv-by-std/--no-norm-adv-by-std": True}
_TRAIN = {"--loss-mode": "vanilla", "--loss-agg-mode": None, "--loss-scale-factor": None, "--lora-rank": 0,
          "--lora-alpha": 16, "--lora-target-modules": "all-linear"}
NEW_OPTIONS = {
    "collect": {"--skip-settled-prompts": 0},
    "sql": {"--allow-write": None},
    "run": {"--skip-settled-prompts": 0, **_PURIFY, **_TRAIN, "--scorer-memory-gb": None},
    "purify": _PURIFY,
    "ablate": {**_SELECTION, "--void-turn-filter": "false", "--adv-estimator": "grpo", "--norm-adv-by-std": "true"},
    "train": _TRAIN,
    "demo": {"--lora-rank": 0, "--lr": None, "--model": None},
}
NEW_COMMANDS = {"curate", "warehouse"}
# This round's new fields, at their defaults, in each table of a resolved run config (None: left out)
NEW_FIELDS = {"collect": {"skip_settled_prompts": 0},
              "purify": {"down_sample": "none", "roc_min_negatives": 2, "roc_min_positives": 2,
                         "roc_error_ratio": True, "roc_answer_format": True, "void_turn_filter": False,
                         "adv_estimator": "grpo", "norm_adv_by_std": True},
              "train": {"loss_mode": "vanilla", "lora_rank": 0, "lora_alpha": 16, "lora_target_modules": "all-linear"}}
# ... and purify's backend and device, which follow collect's in a run (its server too, left out as None)
SCORED_AS_COLLECTED = ("backend", "device")


@pytest.fixture(scope="module")
def ids() -> dict:
    return json.loads((FIXTURE / "ids.json").read_text())


@pytest.fixture
def warehouse(tmp_path) -> Path:
    """A copy of the fixture whose configs name this checkout's files instead of main's."""
    copy = tmp_path / "warehouse"
    shutil.copytree(FIXTURE / "warehouse", copy)
    for path in (copy / "configs").glob("*.json"):
        path.write_text(path.read_text().replace(MAIN_ROOT, str(ROOT)))
    return copy


# ----------------------------------------------------------------------------------------------
# Ids


def test_every_stored_config_keeps_the_id_main_gave_it(ids):
    configs = FIXTURE / "warehouse" / "configs"
    for kind in ("collect", "eval"):
        for name, expected in ids[kind].items():
            config = CollectConfig.from_json((configs / f"{name}.json").read_text())
            assert config.config_id == expected["config_id"], name
    for name, expected in ids["purify"].items():
        assert PurifyConfig(**json.loads((configs / f"{name}.json").read_text())).config_id == expected, name


def test_an_evaluation_stored_under_the_id_an_earlier_version_gave_it_is_found_by_its_config(ids, tmp_path):
    """Before main, an evaluation's id hashed every field (`legacy_config_id` in ids.json): one stored
    so, its config and its eval_runs row under that id, in a warehouse of format 1, is found."""
    stored = Warehouse(FIXTURE / "warehouse", read_only=True)
    for name, expected in ids["eval"].items():
        earlier = Warehouse(tmp_path / name)
        earlier.write_eval_run(dataclasses.replace(stored.read_eval_run(expected["config_id"]),
                                                   eval_id=expected["legacy_config_id"]))
        earlier.save_eval_config(expected["legacy_config_id"], stored.eval_config(expected["config_id"]))
        config = CollectConfig.from_json(stored.eval_config(expected["config_id"]))
        assert stored_evaluation(earlier, config) is None  # format 2: an id is its config's own
        as_format_1(earlier.root)
        assert stored_evaluation(Warehouse(earlier.root), config) == expected["legacy_config_id"], name
        assert stored_evaluation(stored, config) == expected["config_id"], name


def test_every_view_reads_and_holds_the_rows_and_ids_main_wrote(ids):
    connection = Warehouse(FIXTURE / "warehouse", read_only=True).connect()
    stored = ids["stored"]
    for table, count in stored["counts"].items():
        assert connection.sql(f"SELECT count(*) FROM {table}").fetchall()[0][0] == count, table
    assert sorted(r[0] for r in connection.sql("SELECT DISTINCT collect_config_id FROM rollouts").fetchall()) == \
        stored["rollouts.collect_config_id"]
    params = connection.sql("SELECT config_id, params_json FROM purify_configs").fetchall()
    assert sorted(PurifyConfig(**json.loads(text)).config_id for _, text in params) == \
        sorted(config_id for config_id, _ in params) == stored["purify_configs.config_id"]
    connection.close()


# ----------------------------------------------------------------------------------------------
# Commands on it


def test_purify_finds_mains_rows_under_the_default_config_and_recomputes_nothing(warehouse):
    result = runner.invoke(app, ["purify", "-w", str(warehouse), "--iteration", "1"])
    assert result.exit_code == 0, result.output
    assert "already stored, not recomputed: a8bf93c6f605" in result.output


@pytest.mark.parametrize("command", [["report", "--out", "{tmp}/report"], ["show", "it1-toy-", "--no-tokenizer"],
                                     ["sql", "SELECT count(*) AS n FROM attempts"]])
def test_the_readers_read_it(warehouse, tmp_path, command):
    if command[0] == "show":  # a rollout of iteration 1
        rollout = Warehouse(warehouse).read_rollouts(1)[0].rollout_id
        command = ["show", rollout, "--no-tokenizer"]
    args = [part.replace("{tmp}", str(tmp_path)) for part in command]
    result = runner.invoke(app, [args[0], "-w", str(warehouse), *args[1:]])
    assert result.exit_code == 0, result.output


# ----------------------------------------------------------------------------------------------
# Flags and recipes


def _flags() -> dict:
    """{command: {option spelling: default}} of the current CLI, as flags.json was written."""
    def walk(group, prefix):
        out = {}
        for name, command in sorted(group.commands.items()):
            if hasattr(command, "commands"):
                out.update(walk(command, [*prefix, name]))
                continue
            out[" ".join([*prefix, name])] = {
                ("/".join(p.opts + p.secondary_opts) if p.param_type_name == "option" else f"<{p.name}>"):
                (json.loads(json.dumps(p.default, default=str)) if p.param_type_name == "option" else None)
                for p in command.params}
        return out

    return walk(typer.main.get_command(app), [])


def test_every_flag_main_had_keeps_its_name_and_default_and_the_new_ones_are_this_rounds():
    main, now = json.loads((FIXTURE / "flags.json").read_text().replace(MAIN_ROOT, str(ROOT))), _flags()
    assert set(now) - set(main) == NEW_COMMANDS
    for command, options in main.items():
        added = {name: default for name, default in now[command].items() if name not in options}
        assert added == NEW_OPTIONS.get(command, {}), command
        assert {name: now[command][name] for name in options} == options, command


@pytest.mark.parametrize("recipe", ["default", "qwen3_4b_cleaner", "qwen3_4b", "qwen3_4b_notool", "qwen2_7b_cleaner"])
def test_each_recipe_resolves_as_on_main_with_this_rounds_fields_at_their_defaults(recipe):
    args = ["run", "--print-config"] + ([] if recipe == "default" else ["--config", str(ROOT / "recipes" / f"{recipe}.toml")])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    main = tomllib.loads((FIXTURE / "recipes" / f"{recipe}.toml").read_text().replace(MAIN_ROOT, str(ROOT)))
    now = tomllib.loads(result.output)
    for name in SCORED_AS_COLLECTED:
        assert now["purify"].pop(name) == now["collect"][name], name
    for table, fields in NEW_FIELDS.items():
        for name, default in fields.items():
            assert now[table].pop(name) == default, (table, name)
    assert now == main
