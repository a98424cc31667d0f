"""Settings groups: each setting declared once, its check beside it (docs/architecture.md §9).

A group is a frozen dataclass base whose fields are `setting`s, each declaring its own bound,
choices or enum (`_check_fields` checks them), and whose `_check_group` checks what relates them;
a config holds the groups it uses by inheriting them, so its fields stay flat (the flags, TOML
keys, stored JSON and ids are the fields' names; `CollectConfig(gamma=0.7)` builds as before).

Design decisions:
- Inheritance, not nesting: a nested group would rename every flag and key (`--saar-gamma`) and
  change every stored id. Group fields are keyword-only (no order of bases to depend on).
- `check_groups` runs each group class's own `_check_group` once, base groups first, whatever the
  diamond of bases: a field is checked once, where declared, with one message for every holder.
- SAAR's group comes in parts, as its holders use parts: collect the merge, the IS gate and p
  (SaarRollback); purify all (SaarSettings); eval the merge; a view (`RenderSettings`,
  engine/saar/walk.py, and `cleaner show`) the merge, the gate and the edit, not p or
  purify_when, which decide whether a rollout is purified, not how (SaarView). The rollouts'
  group, collect's and eval's (RolloutSettings), is in settings.py beside them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import StrEnum

from cleaner.records import enum_value

# The longest limit a `*_s` option takes: a day. A limit past it is no limit (a run would wait days on
# a hung call), and clocks and timestamps overflow far beyond it (`inf`, 1e10).
MAX_SECONDS = 86_400.0

# ---------------------------------------------------------------------------------------------
# Declaring and checking a field


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name} must be one of {choices}, got {value!r}")


def _set(config, **values) -> None:
    for name, value in values.items():
        object.__setattr__(config, name, value)  # a frozen dataclass's own __post_init__


def _enum_field(config: object, name: str, enum: type[StrEnum]) -> None:
    """Store field `name` of a frozen config as a member of `enum` (ValueError naming the choices)."""
    object.__setattr__(config, name, enum_value(enum, getattr(config, name), name))


def _holds(value: float, bound: str) -> bool:
    """Whether `value` holds `bound`, written as its error says it: `>= 1`, `> 0`, `<= 1`, `< 1`,
    `in [0, 1]`, `in (0, 1]`, `in [0, 1)`, `in (0, 1)`."""
    op, _, limits = bound.partition(" ")
    if op == "in":
        low, high = (float(limit) for limit in limits[1:-1].split(", "))
        return (low < value if limits[0] == "(" else low <= value) and (value < high if limits[-1] == ")"
                                                                        else value <= high)
    return {">=": value >= float(limits), ">": value > float(limits), "<=": value <= float(limits),
            "<": value < float(limits)}[op]


def _check_fields(config: object) -> None:
    """Every field's declared checks, before the config's own (a nested config checks its own): an
    enum field stored as its member (ValueError naming the choices), a string one of its `choices`,
    a number finite (`inf` and `nan` pass most comparisons, or none, and would be trained or waited
    on), a `*_s` number a duration in (0, MAX_SECONDS], and within its `check` bound. None passes
    only a field whose default is None."""
    for item in dataclasses.fields(config):  # type: ignore[arg-type]
        value, declared = getattr(config, item.name), item.metadata
        if value is None and item.default is None:
            continue  # an optional field left unset (None is no value to bound or choose)
        if "enum" in declared:
            _enum_field(config, item.name, declared["enum"])
        elif "choices" in declared:
            _check_choice(item.name, value, declared["choices"])
        if isinstance(value, bool) or not isinstance(value, int | float):
            _check("check" not in declared, f"{item.name} must be {declared.get('check')}, got {value!r}")
            continue
        _check(math.isfinite(value), f"{item.name} must be a finite number, got {value}")
        _check(not item.name.endswith("_s") or 0 < value <= MAX_SECONDS,
               f"{item.name} must be in (0, {MAX_SECONDS:,.0f}] seconds, got {value}")
        _check("check" not in declared or _holds(value, declared["check"]),
               f"{item.name} must be {declared.get('check')}, got {value}")


def setting(default=dataclasses.MISSING, *, help: str, identity: str = "always",
            check: str | None = None, choices: tuple[str, ...] | None = None,
            default_factory=dataclasses.MISSING):
    """A config field with its flag's help, its checks and how it counts toward its config's id.

    identity: `always`; `away-from-default`, a field stored configs predate (at its default, theirs
    keep their ids); `never`, how something runs, not what it computes (a schedule, a server's
    address). check: a bound its value holds, as the error says it (`>= 1`, `in (0, 1]`: `_holds`);
    choices: the strings it takes; either lets None through only where the default is None. A
    field whose default is an enum member takes that enum's values. `_check_fields` checks them
    all; what relates two fields is the config's own."""
    _check_choice("identity", identity, ("always", "away-from-default", "never"))
    metadata: dict = {"help": help, "identity": identity}
    if check is not None:
        _holds(0, check)  # a bound that does not parse fails where it is declared
        metadata["check"] = check
    if choices is not None:
        metadata["choices"] = choices
    if isinstance(default, StrEnum):
        metadata["enum"] = type(default)
    return field(default=default, default_factory=default_factory, metadata=metadata)


def redeclared(group: type, name: str, default: object):
    """Field `name` of `group` with another default, its help and identity as declared there."""
    return field(default=default, metadata=group.__dataclass_fields__[name].metadata)


def group_values(holder: object, group: type) -> dict:
    """{field: value} of `holder` for each field of `group` it has."""
    return {item.name: getattr(holder, item.name) for item in dataclasses.fields(group) if hasattr(holder, item.name)}


class Group:
    """Base of every settings group: `check_groups` runs each group's own checks once (a group alone
    runs them on construction; a config runs them from its own `__post_init__`)."""

    def __post_init__(self) -> None:
        _check_fields(self)
        self.check_groups()

    def check_groups(self) -> None:
        for cls in reversed(type(self).__mro__):
            own = vars(cls).get("_check_group")
            if own is not None:
                own(self)


# ---------------------------------------------------------------------------------------------
# The SAAR group (docs/architecture.md §4)


class SimilarityOn(StrEnum):
    """What SAAR compares to choose a shallow or a deep merge (docs/architecture.md §4)."""

    CODE = "code"  # the two calls' code arguments (ours; the default)
    CALL = "call"  # the decoded call tokens, as the reference does


class PurifyWhen(StrEnum):
    """Which rollouts SAAR may purify."""

    ALWAYS = "always"  # every rollout whose draw is below p (the paper)
    POSITIVE = "positive"  # only rollouts whose reward is above their group's mean (ours)


class Edit(StrEnum):
    """What a purify config does to the attempts SAAR takes out (docs/architecture.md §4)."""

    REPLACE = "replace"  # CLEANER: the row is SAAR's rendering, the failed attempts spliced out
    MASK = "mask"  # the row is the raw rendering; what replace drops is not trained (loss mask 0)


class IsMode(StrEnum):
    """How the IS gate aggregates a merge's per-token log-ratios (docs/architecture.md §4)."""

    SUM = "sum"  # IS = exp(sum): the gate as docs/architecture.md §4 defines it, and the reference's first code
    MEAN = "mean"  # IS = exp(mean): the per-token geometric mean of the reference's later code


@dataclass(frozen=True, kw_only=True)
class SaarMerge(Group):
    """How SAAR merges a failed attempt with its retry."""

    gamma: float = setting(0.5, check=">= 0", help="SAAR: shallow merge iff similarity >= gamma (gamma > 1: always "
        "deep)")
    similarity_on: SimilarityOn = setting(SimilarityOn.CODE, help="what SAAR compares")


@dataclass(frozen=True, kw_only=True)
class SaarGate(Group):
    """The IS gate over each merge (docs/architecture.md §4)."""

    rollback_is_threshold: float = setting(0.0, check=">= 0", help="tau: a merge whose IS < tau keeps its chain raw; 0 "
        "= off")
    rollback_is_mode: IsMode = setting(IsMode.SUM, help="the IS gate over the retry's tokens: sum (its definition) or "
        "mean (the reference's later code)")


@dataclass(frozen=True, kw_only=True)
class SaarEdit(Group):
    """What becomes of the attempts a merge takes out (docs/architecture.md §4)."""

    edit: Edit = setting(Edit.REPLACE, help="replace (SAAR's sequence) | mask (the raw one, what replace drops "
        "untrained)")


@dataclass(frozen=True, kw_only=True)
class SaarView(SaarEdit, SaarGate, SaarMerge):
    """How a purified rollout renders: what `RenderSettings` and `cleaner show` hold."""


@dataclass(frozen=True, kw_only=True)
class SaarRollback(SaarGate, SaarMerge):
    """SAAR during collection: the merge, the gate, and p."""

    rollback_prob: float = setting(1.0, check="in [0, 1]", help="p: SAAR applies to a rollout iff its stored draw u < "
        "p")


@dataclass(frozen=True, kw_only=True)
class SaarSettings(SaarEdit, SaarRollback):
    """Every SAAR setting: what a purify config holds."""

    purify_when: PurifyWhen = setting(PurifyWhen.ALWAYS, help="which rollouts SAAR may purify: all (the paper) or "
        "positive ones")
