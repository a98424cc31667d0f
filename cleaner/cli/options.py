"""The config flags as typer options: the one place a config field becomes a command-line option
(docs/architecture.md §9).

Which flags a command takes (one per field: its name, default and help) is `config/flags.py`'s.
`@config_flags("collect")` puts one keyword parameter per flag where the command's `flags`
parameter stands (typer reads the generated `__signature__`) and calls the command with their
values as `Flags`, which build the config through `config/layers.py`'s `build`, the same road a
run's layers take. A bool field is `--name/--no-name`; an enum stays a string whose choices the
metavar shows (its config names the choices when a value is wrong, exit code 1); a field naming a
file or a directory is a path the parser checks; ablate's grid axes are comma-separated strings; a field whose
default follows another flag is optional, its help saying which.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from cleaner.cli.common import fail
from cleaner.config.flags import (
    COMMANDS,
    CommandFlags,
    Flag,
    command_flags,
    flag_layer,
    flag_names,
    option_of,
)
from cleaner.config.layers import ConfigError, build, merge
from cleaner.config.settings import SCORED_AS_COLLECTED

CONTEXT = "flags_context"  # the typer context the generated signature adds, to tell given flags from defaults
PANELS = {"collect": "Collect", "purify": "Purify", "train": "Train"}  # run's help: a section per table


@dataclass(frozen=True)
class Flags:
    """The values of a command's config flags."""

    command: str  # a key of config/flags.py's COMMANDS
    values: Mapping[str, object]  # {flag's Python name: value}
    given: frozenset[str]  # the flags the command line gave (the others hold their defaults)

    def __getitem__(self, name: str) -> object:
        return self.values[name]

    @property
    def flags(self) -> tuple[Flag, ...]:
        return command_flags(self.command)

    def build(self, cls: type, names: Mapping[str, str] | None = None, **fixed: object):
        """The config `cls` from the flags, and the top-level fields in `fixed` the command sets
        itself (named `names[field]` in an error, else `--field`); an invalid value exits with one
        error line naming its flag."""
        given_as = flag_names(self.values, self.command)
        given_as |= {(name,): (names or {}).get(name, option_of(name)) for name in fixed}
        try:
            return build(cls, merge(flag_layer(self.values, self.command), fixed), None, given_as)
        except ConfigError as error:
            raise fail(str(error)) from error

    def given_values(self) -> dict[str, object]:
        """{name: value} of the flags the command line gave (`run` layers them over its file)."""
        return {name: value for name, value in self.values.items() if name in self.given}


def config_flags(command: str) -> Callable[[Callable], Callable]:
    """Decorator: the command takes `command`'s config flags in place of its `flags` parameter,
    and is called with their values as `flags`."""
    flags, spec = command_flags(command), COMMANDS[command]

    def decorate(func: Callable) -> Callable:
        signature = inspect.signature(func, eval_str=True)
        parameters = []
        for parameter in signature.parameters.values():
            if parameter.name == "flags":
                parameters += [_parameter(flag, spec) for flag in flags]
            else:  # keyword-only, so typer's order is the signature's wherever the flags stand
                parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        parameters.append(inspect.Parameter(CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

        @functools.wraps(func)
        def with_flags(**values: object):
            context = values.pop(CONTEXT)
            given = frozenset(flag.name for flag in flags if _given(context, flag.name))
            return func(flags=Flags(command, {flag.name: values.pop(flag.name) for flag in flags}, given), **values)

        with_flags.__signature__ = signature.replace(parameters=parameters)
        with_flags.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_flags

    return decorate


def _given(context: typer.Context, name: str) -> bool:
    """Whether the command line (or the environment) gave parameter `name`."""
    source = context.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")  # by name: typer vendors click


def _parameter(flag: Flag, spec: CommandFlags) -> inspect.Parameter:
    """The typer option of one flag, as a keyword parameter."""
    field = ".".join(flag.paths[0])
    hint, default, text, options = flag.hint, flag.default, flag.help, {}
    if isinstance(hint, type) and issubclass(hint, Enum):
        hint, default = str, default.value
        options["metavar"] = "<" + "|".join(member.value for member in flag.hint) + ">"
    if field in spec.grid:
        hint, default, text = str, spec.grid[field], f"{text}; comma-separated, a config each"
        options.pop("metavar", None)
    if field in spec.files or field in spec.directories:
        kind = "dir_okay" if field in spec.files else "file_okay"
        hint, options = Path | None, {**options, "exists": True, kind: False}
    notes = [" and ".join(flag.sections)] if len(flag.sections) > 1 else []  # run: sets each table's
    if flag.derived is not None:
        hint, options["show_default"] = hint | None, False
        notes.append(f"default: {flag.derived}")
    if notes:
        text += f" ({'; '.join(notes)})"
    option = typer.Option(help=text, rich_help_panel=_panel(flag), **options)
    return inspect.Parameter(flag.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[hint, option])


def _panel(flag: Flag) -> str | None:
    """The section of run's help: the table the flag sets; purify's if it sets purify's too (the
    SAAR settings), but not for where purify scores, which follows collect's; none for flags of
    collect and train alike (seed, device)."""
    sections = tuple(section for section in flag.sections
                     if section != "purify" or flag.name not in SCORED_AS_COLLECTED)
    if "purify" in sections:
        return PANELS["purify"]
    return PANELS[sections[0]] if len(sections) == 1 else None
