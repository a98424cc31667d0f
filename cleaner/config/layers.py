"""Configs from layers of nested dicts: a run's is defaults < the saved run (on resume) < a TOML
file < flags; a phase command's is its flags alone (`build`).

`cleaner run --config run.toml` reads a file laid out like `RunConfig`: top-level `run_dir` and
`iterations`, then `[collect]`, `[collect.sandbox]`, `[purify]` and `[train]` tables whose keys are
the fields (settings.py); `--print-config` prints the resolved config as such a file, so
`cleaner run ... --print-config > run.toml` round-trips.

Design decisions:
- Layers merge key by key, so a layer says only what it changes.
- Values no layer sets are derived, to keep a run self-consistent: purify's SAAR settings follow
  collect's (purifying at the collect config keeps the purified rows on-policy); its backend,
  server and device are collect's (RunConfig: the run scores with the backend it collects with),
  and a layer that names others is an error; with purify's
  edit `mask`, collection uses the raw view (a masked row is the raw sequence, on-policy only if
  the agent loop saw it); train's response budget, seed and device follow collect's; the mini
  batch is a quarter of the iteration's trained rows (4 optimiser steps, the reference's 128 / 32;
  with down-sampling, of the rows it keeps)
  and the micro batch min(16, mini batch); the response budget is max(768, max_new_tokens).
- A file's key that is not a field, or a value of the wrong type, is an error naming the file,
  the table and the key. Integers are accepted where a float is expected (TOML writes `lr = 1`).
- TOML has no null: a None field is left out of the printed file (every such field defaults to
  None, so leaving it out means the same).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path

from cleaner.config.groups import SaarRollback
from cleaner.config.settings import SCORED_AS_COLLECTED, RunConfig
from cleaner.errors import CleanerError


class ConfigError(CleanerError, ValueError):
    """A config file or layer that cannot be turned into a RunConfig; the message says where."""


# ---------------------------------------------------------------------------------------------
# Dicts <-> configs


def merge(*layers: Mapping) -> dict:
    """Deep merge: later layers win key by key; nested tables merge."""
    merged: dict = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
                merged[key] = merge(merged[key], value)
            else:
                merged[key] = dict(value) if isinstance(value, Mapping) else value
    return merged


def _coerce(value: object, hint: object, where: str) -> object:
    """`value` as the field type `hint` (int -> float allowed), else ConfigError."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if (option is str or isinstance(option, type) and issubclass(option, enum.Enum)) and isinstance(value, str):
            return value  # an enum field's __post_init__ checks the value and names the choices
    names = " or ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{where}: expected {names}, got {value!r}")


def typed_layer(cls: type, data: object, where: str = "config") -> dict:
    """`data` checked against the (nested) config dataclass `cls`, before any value is used: a
    table whose keys are fields, nested configs as tables, every value of its field's type (ints
    become floats where a float is expected). ConfigError naming the table and key otherwise."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    return {name: typed_layer(hints[name], value, f"{where}.{name}") if dataclasses.is_dataclass(hints[name])
            else _coerce(value, hints[name], f"{where}.{name}") for name, value in data.items()}


def build(cls: type, values: Mapping, where: str | None = None,
          names: Mapping[tuple[str, ...], str] | None = None, path: tuple[str, ...] = ()) -> object:
    """An instance of the (nested) config dataclass `cls` from a layer whose values have their
    fields' types (`typed_layer`, or a command's parsed flags).

    A ValueError of a config becomes a ConfigError: `names` maps a field's path (("train", "lr"))
    to the flag its value was given as (`--lr`), and an error naming only such fields reads
    `invalid option: --lr must be > 0, ...`; any other is prefixed `where` (the file, or, with
    `where=None`, `invalid option` too: every value came from a flag)."""
    names = names or {}
    hints = typing.get_type_hints(cls)
    built = {name: build(hints[name], value, where and f"{where}.{name}", names, (*path, name))
             if dataclasses.is_dataclass(hints[name]) else value for name, value in values.items()}
    try:
        return cls(**built)
    except ValueError as error:
        fields = [field.name for field in dataclasses.fields(cls)]
        given = {name: names[(*path, name)] for name in fields if (*path, name) in names}
        message, renamed, others = name_fields(str(error), given, fields)
        prefix = "invalid option" if where is None or (renamed and not others) else where
        raise ConfigError(f"{prefix}: {message}") from error


def name_fields(message: str, names: Mapping[str, str], fields: typing.Iterable[str] = ()) -> tuple[str, bool, bool]:
    """`message` (a config's ValueError, which names fields) with each field of `names` written as
    its name there (n_prompts -> --prompts); quoted values are left alone. Also whether a field was
    renamed, and whether it names one of `fields` that is not in `names`."""
    words = sorted(set(names) | set(fields), key=len, reverse=True)
    if not words:
        return message, False, False
    found: set[str] = set()

    def rename(match: re.Match) -> str:
        if match.group(1) is None:
            return match.group(0)  # a quoted value
        found.add(match.group(1))
        return names.get(match.group(1), match.group(1))

    pattern = r"'[^']*'|\b(" + "|".join(re.escape(word) for word in words) + r")\b"
    renamed = re.sub(pattern, rename, message)
    return renamed, bool(found & set(names)), bool(found - set(names))


def to_toml(config: object) -> str:
    """The config as a TOML document: scalars first, then one table per nested config."""
    lines: list[str] = []
    _toml_table(config, [], lines)
    return "\n".join(lines).strip() + "\n"


def _toml_table(config: object, path: list[str], lines: list[str]) -> None:
    nested = []
    if path:
        lines += ["", f"[{'.'.join(path)}]"]
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            nested.append((f.name, value))
        elif value is not None:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, value in nested:
        _toml_table(value, [*path, name], lines)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string uses JSON's escapes


# ---------------------------------------------------------------------------------------------
# The run's layers

# `cleaner run`'s defaults beneath any config file: the tiny policy's learning rate.
RUN_BASE_LAYER = {"train": {"lr": 1e-4}}


def read_toml(path: Path) -> dict:
    """A TOML file as a dict; an unreadable or invalid file is a ConfigError naming it."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config file ({error.strerror})") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from error
    except UnicodeDecodeError as error:  # TOML is UTF-8 text; tomllib raises this before parsing
        raise ConfigError(f"{path}: not valid TOML: byte {error.start} is not UTF-8 (counting from 0; TOML files are UTF-8 "
                          "text; save it as UTF-8)") from error


# The defaults `_derived` fills in where no layer sets them, as the run's flags' help states them
# (config/flags.py); purify's SAAR settings and train's seed and device follow collect's through
# the one flag that sets both.
DERIVED = {
    ("collect", "max_response_tokens"): "max(768, --max-new-tokens)",
    ("train", "max_response_tokens"): "max(768, --max-new-tokens)",
    ("train", "mini_batch_size"): "a quarter of the iteration's rollouts (those down-sampling keeps)",
    ("train", "micro_batch_size"): "min(16, mini batch)",
}


def _derived(layer: Mapping) -> dict:
    """Values that follow from others, for the keys no layer set."""
    collect, train = layer.get("collect", {}), layer.get("train", {})
    defaults = RunConfig().collect
    n_prompts = collect.get("n_prompts", defaults.n_prompts)
    group_size = collect.get("group_size", defaults.group_size)
    max_new_tokens = collect.get("max_new_tokens", defaults.max_new_tokens)
    response = collect.get("max_response_tokens", max(768, max_new_tokens))
    trained = layer.get("purify", {}).get("down_sample_to") or group_size  # rows a group trains
    quarter = max(1, n_prompts * trained // 4)
    mini = train.get("mini_batch_size", max(quarter, train.get("micro_batch_size", 1)))
    masking = layer.get("purify", {}).get("edit") == "mask"
    return {
        "collect": {"max_response_tokens": response, **({"collect_view": "raw"} if masking else {})},
        "purify": {item.name: collect[item.name] for item in dataclasses.fields(SaarRollback) if item.name in collect},
        "train": {"max_response_tokens": response, "mini_batch_size": mini,
                  "micro_batch_size": min(16, mini),
                  **{key: collect[key] for key in ("seed", "device") if key in collect}},
    }


def resolve_run_config(*layers: Mapping, where: str = "config",
                       names: Mapping[tuple[str, ...], str] | None = None) -> RunConfig:
    """The RunConfig of the merged layers, derived values filled in where no layer set them.

    The layers are type-checked before anything is derived from them; `names` as in `build`."""
    merged = typed_layer(RunConfig, merge(*layers), where)
    config = build(RunConfig, merge(_derived(merged), merged), where, names)
    for name, value in merged.get("purify", {}).items():  # RunConfig made them collect's
        if name in SCORED_AS_COLLECTED and value != getattr(config.collect, name):
            raise ConfigError(f"{where}: purify's {name} must be collect's: a run scores with the backend it "
                              f"collects with, got {value!r} and {getattr(config.collect, name)!r}")
    return config


def differences(before: Mapping, after: Mapping, ignore: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """`key: before -> after` for every leaf that differs (nested keys joined with dots), but the
    keys of `ignore` (dotted paths)."""
    changed = []
    for key in sorted(set(before) | set(after)):
        if f"{prefix}{key}" in ignore:
            continue
        old, new = before.get(key), after.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changed += differences(old, new, ignore, prefix=f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changed
