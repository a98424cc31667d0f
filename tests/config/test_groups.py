"""The settings groups (config/groups.py): each SAAR setting is declared once, in its group; a
field's declared check and a group's own check run once per config and say the same thing whichever
config holds them; eval's
collect config takes every setting the two share from the groups."""

from __future__ import annotations

import ast
import collections
import dataclasses
from pathlib import Path

import pytest

from cleaner.config import CollectConfig, EvalConfig, PurifyConfig, RolloutSettings
from cleaner.config.groups import SaarEdit, SaarGate, SaarMerge, SaarRollback, SaarSettings
from cleaner.engine.saar.walk import RenderSettings

PACKAGE = Path(__file__).resolve().parents[2] / "cleaner"
SAAR_FIELDS = [item.name for item in dataclasses.fields(SaarSettings)]
DATASET = (("toy", "toy.parquet"),)  # eval's config checks no file
GROUPS = (SaarMerge, SaarGate, SaarEdit, SaarRollback, SaarSettings, RolloutSettings)


def _declarations(*folders: str) -> dict[str, list[tuple[str, ast.expr | None]]]:
    """{field name: [(class, its value) for each class under the folders that declares it]}."""
    declared = collections.defaultdict(list)
    for folder in folders:
        for path in sorted((PACKAGE / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    for statement in node.body:
                        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                            declared[statement.target.id].append((node.name, statement.value))
    return declared


def test_each_saar_setting_is_declared_once_in_its_group():
    declared = _declarations("config", "engine/saar")
    assert {"gamma", "rollback_prob", "edit", "purify_when"} <= set(SAAR_FIELDS)  # the scan found the group
    for name in SAAR_FIELDS:
        assert len(declared[name]) == 1, (name, [cls for cls, _ in declared[name]])
        assert declared[name][0][0].startswith("Saar"), (name, declared[name][0][0])


def test_a_rollout_setting_is_declared_in_its_group_and_only_redeclared_with_another_default():
    declared = _declarations("config")
    for item in dataclasses.fields(RolloutSettings):
        holders = [cls for cls, _ in declared[item.name]]
        assert holders.count("RolloutSettings") == 1, (item.name, holders)
        for cls, value in declared[item.name]:  # in its holders, eval's defaults: `redeclared(...)`, no second help
            if cls in ("CollectConfig", "EvalConfig"):
                assert isinstance(value, ast.Call) and getattr(value.func, "id", None) == "redeclared", (item.name, cls)
    fields = {item.name: item for item in dataclasses.fields(EvalConfig)}
    group = {item.name: item for item in dataclasses.fields(RolloutSettings)}
    assert {name: fields[name].default for name in ("top_p", "max_turns", "max_new_tokens", "max_response_tokens")} \
        == {"top_p": 0.6, "max_turns": 16, "max_new_tokens": 20480, "max_response_tokens": 20480}
    assert all(fields[name].metadata == group[name].metadata for name in group)  # help and identity kept


HOLDERS = {
    "collect": lambda **saar: CollectConfig(**saar),
    "purify": lambda **saar: PurifyConfig(**saar),
    "eval": lambda **saar: EvalConfig(datasets=DATASET, **saar),
    "view": lambda **saar: RenderSettings(True, **saar),
}


@pytest.mark.parametrize("holder", sorted(HOLDERS))
@pytest.mark.parametrize(("saar", "message"), [({"gamma": -1.0}, "gamma must be >= 0, got -1.0"),
                                               ({"similarity_on": "codes"},
                                                "similarity_on must be one of ['code', 'call'], got 'codes'")])
def test_a_group_check_says_the_same_for_every_holder(holder, saar, message):
    with pytest.raises(ValueError) as error:
        HOLDERS[holder](**saar)
    assert str(error.value) == message


@pytest.mark.parametrize(("holder", "expected"), [("collect", {"CollectConfig": 1}), ("purify", {"PurifyConfig": 1}),
                                                  ("eval", {"EvalConfig": 1, "CollectConfig": 1}),
                                                  ("view", {"RenderSettings": 1})])
def test_the_declared_checks_and_each_group_check_run_once_per_config(monkeypatch, holder, expected):
    """SaarSettings reaches SaarMerge by two paths; the fields' declared checks (`_check_fields`)
    and each group's own check still run once per config (eval's builds one collect config, which
    runs its own)."""
    from cleaner.config import groups, settings

    runs: collections.Counter = collections.Counter()
    fields = groups._check_fields

    def counted_fields(config) -> None:
        runs[type(config).__name__, "fields"] += 1
        fields(config)

    def counting(group: type):
        check = vars(group)["_check_group"]

        def counted(self) -> None:
            runs[type(self).__name__, group.__name__] += 1
            check(self)
        return counted

    for module in (groups, settings):
        monkeypatch.setattr(module, "_check_fields", counted_fields)
    for group in GROUPS:
        if "_check_group" in vars(group):
            monkeypatch.setattr(group, "_check_group", counting(group))
    HOLDERS[holder](gamma=0.7)
    assert set(runs.values()) == {1}
    assert collections.Counter(name for name, check in runs if check == "fields") == expected
    holds_rollouts = holder in ("collect", "eval")
    assert collections.Counter(name for name, check in runs if check == "RolloutSettings") == (
        {"CollectConfig": 1} | ({"EvalConfig": 1} if holder == "eval" else {}) if holds_rollouts else {})


def test_a_bound_is_checked_as_declared_and_its_error_says_it():
    """`setting(check=...)`: each form of bound, at its edges, and None passes; a bound that does
    not parse fails where it is declared."""
    from cleaner.config.groups import _holds, setting

    cases = {">= 1": [(1, True), (0.999, False)], "> 0": [(1e-9, True), (0, False)], "<= 1": [(1, True), (1.5, False)],
             "< 1": [(0.999, True), (1, False)], "in [0, 1]": [(0, True), (1, True), (-0.1, False), (1.1, False)],
             "in (0, 1]": [(0, False), (1, True)], "in [0, 1)": [(0, True), (1, False)],
             "in (0, 1)": [(0, False), (0.5, True), (1, False)]}
    for bound, values in cases.items():
        for value, holds in values:
            assert _holds(value, bound) is holds, (bound, value)
    with pytest.raises((ValueError, KeyError, IndexError)):
        setting(1, check="at least 1", help="x")
    assert CollectConfig(max_tool_response_chars=None).max_tool_response_chars is None  # None is no value to bound
    for values, message in (({"max_turns": None}, "max_turns must be >= 1, got None"),  # not optional: refused
                            ({"max_turns": "3"}, "max_turns must be >= 1, got '3'"),
                            ({"backend": None}, "backend must be one of ('torch', 'sglang'), got None")):
        with pytest.raises(ValueError) as refused:
            CollectConfig(**values)
        assert str(refused.value) == message
    with pytest.raises(ValueError) as error:
        CollectConfig(max_tool_response_chars=1)
    assert str(error.value) == "max_tool_response_chars must be >= 2, got 1"


def test_evals_collect_config_takes_every_setting_the_two_share():
    values = {"gamma": 0.7, "similarity_on": "call", "temperature": 0.6, "top_p": 0.9, "max_turns": 3,
              "max_new_tokens": 64, "max_response_tokens": 128, "seed": 5, "multi_turn": False,
              "schedule": "lockstep", "max_tool_response_chars": 40, "test_timeout_s": 2.0}
    evaluation = EvalConfig(datasets=DATASET, **values)
    collect = evaluation.collect_config(evaluation.models[0], "toy.parquet", True, 3)
    for group in (RolloutSettings, SaarMerge):
        for item in dataclasses.fields(group):
            assert getattr(collect, item.name) == getattr(evaluation, item.name), item.name
    assert {name: getattr(collect, name) for name in values} == values
