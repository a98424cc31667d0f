"""Which flags a command takes: one per config field, named after it, with the field's default and
the help its `setting` declares (docs/architecture.md §9), so each is written once, in the dataclass.

`--field-name` sets a field; a nested config's fields carry its name (`--sandbox-workers`). What a
command does otherwise is `RENAMED` and `COMMANDS` below. `cleaner run` takes its collect, purify
and train tables' flags unprefixed, and a flag of two tables sets both (`--gamma`: collect's and
purify's, so the run purifies at its collect config). cli/options.py makes these flags typer
options; `flag_layer` turns their values into a config layer, which config/layers.py builds (a
phase command) or merges over the run's other layers.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cleaner.config.bootstrap import BootstrapOptions
from cleaner.config.groups import SaarView
from cleaner.config.layers import DERIVED, RUN_BASE_LAYER
from cleaner.config.settings import (
    CollectConfig,
    CurateConfig,
    EvalConfig,
    PurifyConfig,
    RunConfig,
    TrainConfig,
)

RENAMED = {"n_prompts": "prompts"}  # field -> its flag's name, on every command
SECTIONS = ("collect", "purify", "train")  # RunConfig's tables: `run` takes their flags unprefixed


def option_of(name: str) -> str:
    """The command-line spelling of a field or parameter name: n_prompts -> --n-prompts."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the config fields it sets."""

    name: str  # the parameter's Python name; the flag is `option`
    paths: tuple[tuple[str, ...], ...]  # the fields it sets, e.g. (("collect", "gamma"), ("purify", "gamma"))
    hint: object  # the field's type
    default: object  # the field's default (run's: RUN_BASE_LAYER's value where it has one)
    help: str  # the field's help
    derived: str | None = None  # what the default follows when the flag is not given (no fixed default)

    @property
    def option(self) -> str:
        return option_of(self.name)

    @property
    def sections(self) -> tuple[str, ...]:
        """The RunConfig tables it sets (run's flags), in order."""
        return tuple(dict.fromkeys(path[0] for path in self.paths if len(path) > 1 and path[0] in SECTIONS))


@dataclass(frozen=True)
class CommandFlags:
    """What a command does with its config's fields besides taking one flag each."""

    config: type  # the config whose fields are the command's flags
    fixed: tuple[str, ...] = ()  # fields (dotted paths) the command sets itself: no flag
    grid: Mapping[str, str] = field(default_factory=dict)  # field -> default list: comma-separated values, one config each
    derived: Mapping[str, str] = field(default_factory=dict)  # field (dotted) -> what its default follows
    files: tuple[str, ...] = ()  # fields naming an existing file, which the parser checks
    directories: tuple[str, ...] = ()  # fields naming an existing directory, which the parser checks


# Ablate's default grid: the paper's gamma and p, around their defaults.
ABLATE_GRID = {"gamma": "0.3,0.5,0.7", "rollback_prob": "0.7,1.0", "similarity_on": "code",
               "purify_when": "always", "edit": "replace", "rollback_is_threshold": "0", "down_sample": "none",
               "void_turn_filter": "false", "adv_estimator": "grpo", "norm_adv_by_std": "true"}

COMMANDS = {
    "collect": CommandFlags(CollectConfig, files=("data", "tools")),
    "purify": CommandFlags(PurifyConfig),
    "ablate": CommandFlags(PurifyConfig, grid=ABLATE_GRID),
    "train": CommandFlags(TrainConfig, files=("deepspeed_config",)),
    # eval repeats --model and --dataset, and --saar / --no-saar choose the settings
    "eval": CommandFlags(EvalConfig, fixed=("models", "datasets", "saar"), files=("tools",),
                         derived={"max_new_tokens": "--max-response-tokens"}),
    # curate takes --iteration N[,M] and --eval ID[,ID] as comma-separated lists
    "curate": CommandFlags(CurateConfig, fixed=("iterations", "evals")),
    # show renders a rollout purified: the merge and the edit, the IS gate off
    "show": CommandFlags(SaarView, fixed=("rollback_is_threshold", "rollback_is_mode")),
    # a run collects iteration after iteration
    "run": CommandFlags(RunConfig, fixed=("collect.iteration",),
                        derived={".".join(path): text for path, text in DERIVED.items()}),
    "bootstrap": CommandFlags(BootstrapOptions, directories=("init_from",)),
}


# ---------------------------------------------------------------------------------------------
# Fields -> flags


def field_help(cls: type) -> dict[str, str]:
    """{field: its help} of a config dataclass (`setting(..., help=...)`); TypeError naming the
    first field without one (a config field's help is its flag's)."""
    missing = [item.name for item in dataclasses.fields(cls) if not item.metadata.get("help")]
    if missing:
        raise TypeError(f"{cls.__name__}.{missing[0]} has no help; declare it with setting(..., help=...)")
    return {item.name: item.metadata["help"] for item in dataclasses.fields(cls)}


def _fields(cls: type, path: tuple[str, ...] = (), prefix: str = "") -> Iterator[Flag]:
    """One flag per leaf field of `cls`; a nested config's flags are prefixed with its name
    (RunConfig's tables are not)."""
    hints, helps = typing.get_type_hints(cls), field_help(cls)
    for f in dataclasses.fields(cls):
        key = (*path, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], key, prefix if f.name in SECTIONS else f"{prefix}{f.name}_")
        else:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield Flag(prefix + RENAMED.get(f.name, f.name), (key,), hints[f.name], default, helps[f.name])


@functools.cache
def command_flags(command: str) -> tuple[Flag, ...]:
    """The config flags of `command` (a key of COMMANDS), in field order. On `run`, the flags a
    field of several tables shares become one, which sets them all."""
    spec = COMMANDS[command]
    merged: dict[str, Flag] = {}
    for flag in _fields(spec.config):
        if ".".join(flag.paths[0]) in spec.fixed:
            continue
        first = merged.setdefault(flag.name, flag)
        if first is not flag:
            if (first.hint, first.default) != (flag.hint, flag.default):
                raise TypeError(f"{flag.option} sets {first.paths[0]} and {flag.paths[0]}, whose types or "
                                f"defaults differ: {first.default!r} and {flag.default!r}")
            merged[flag.name] = dataclasses.replace(first, paths=first.paths + flag.paths)
    return tuple(_for_command(flag, spec, command) for flag in merged.values())


def _for_command(flag: Flag, spec: CommandFlags, command: str) -> Flag:
    """The flag with its default on `command`: what it follows, or run's own (RUN_BASE_LAYER)."""
    dotted = [".".join(path) for path in flag.paths]
    if all(path in spec.derived for path in dotted):
        return dataclasses.replace(flag, default=None, derived=spec.derived[dotted[0]])
    base = RUN_BASE_LAYER if command == "run" else None
    for key in flag.paths[0]:
        base = base.get(key) if isinstance(base, Mapping) else None
    return flag if base is None else dataclasses.replace(flag, default=base)


# ---------------------------------------------------------------------------------------------
# Flag values -> a config layer

@functools.cache
def flag_paths(command: str) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Each flag of `command` (its Python name) -> the config fields it sets."""
    return {flag.name: flag.paths for flag in command_flags(command)}


RUN_FLAGS = flag_paths("run")  # `--gamma` -> (("collect", "gamma"), ("purify", "gamma")), ...


def flag_layer(flags: Mapping[str, object], command: str = "run") -> dict:
    """The config layer of some of `command`'s flags ({python name: value}): every field each sets."""
    layer: dict = {}
    for name, value in flags.items():
        for path in flag_paths(command)[name]:
            table = layer
            for key in path[:-1]:
                table = table.setdefault(key, {})
            table[path[-1]] = str(value) if isinstance(value, Path) else value
    return layer


def flag_names(flags: Iterable[str], command: str = "run") -> dict[tuple[str, ...], str]:
    """{field path: `--flag`} of some of `command`'s flags (their Python names)."""
    return {path: option_of(name) for name in flags for path in flag_paths(command)[name]}


def command_line(flags: Mapping[str, object], command: str = "run") -> str:
    """The `cleaner <command>` command line that gives these flags (the benches print theirs)."""
    words = ["cleaner", command]
    for name, value in flags.items():
        option = option_of(name)
        if isinstance(value, bool):
            words.append(option if value else "--no-" + option[2:])
        else:
            words += [option, str(value)]
    return " ".join(words)
