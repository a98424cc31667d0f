"""Loading the user's own code: a reward function or a tool named `PATH.py:NAME` (docs/byo-task.md).

`load_object("reward.py:compute_score", "reward function")` imports the file as a module of its
own, as verl's `custom_reward_function.path` does, and returns the attribute; the file's folder
goes on `sys.path`, so it imports its neighbours as it would run as a script. A dotted module works
too (`my_pkg.rewards:compute_score`, or `my_pkg.rewards.compute_score`, verl's tool `class_name`
spelling): importable as it is, or from the folder that holds its top package, looked for in the
current directory, then in the tool config's folder and those above it (`recipe.cleaner.
code_judge_tool.PythonTool` from the reference's checkout, as verl finds it from its working
directory). Every way it can fail, a missing file, a file that does not import (a syntax error,
an import it needs, an exception at import time) or a missing name, is one `PluginError` line
naming the spec and what to fix, raised before any model is loaded; a missing `verl` says how to
install it.

A config stores the user's files and specs absolute (`resolved_path`, `resolved_spec`), so a
warehouse's configs name the same files wherever it is read from.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from cleaner.errors import JobError


class PluginError(JobError):
    """The user's file or object cannot be loaded; the message names it and why."""


def plain(value: object) -> object:
    """numpy scalars and arrays (what the user's code returns, what pandas-written files hold) as
    Python values, inside dicts (keys as text), lists and tuples too: JSON and pickling take them."""
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays, torch tensors
        return value.tolist()
    return value


def split_spec(spec: str, default_name: str | None = None, what: str = "object") -> tuple[str, str]:
    """(file or module, attribute) of `PATH.py:NAME`, `PATH.py` (with `default_name`),
    `module:NAME` or `module.NAME`."""
    where, colon, name = spec.rpartition(":")
    if not colon or "/" in name or name.endswith(".py"):  # no name given (a Windows drive never reaches here)
        where, name = spec, ""
    if not name:
        if where.endswith(".py") and default_name:
            return where, default_name
        module, dot, name = where.rpartition(".")
        if where.endswith(".py") or not dot:
            raise PluginError(f"{what} {spec!r}: expected PATH.py:NAME (the file and the name of the object in it)")
        return module, name
    return where, name


def load_object(spec: str, what: str, default_name: str | None = None, base: Path | None = None) -> object:
    """The object `spec` names (a file's or an importable module's attribute). A relative file path
    is read from `base` (the current directory if None)."""
    where, name = split_spec(spec, default_name, what)
    if where.endswith(".py") or "/" in where:
        module = _import_file(Path(where) if base is None else base / where, spec, what)
    else:
        _find_package_root(where.partition(".")[0], base)
        try:
            module = importlib.import_module(where)
        except Exception as error:  # noqa: BLE001 - whatever importing the user's module raises
            raise PluginError(f"{what} {spec!r}: cannot import module {where!r} "
                              f"({type(error).__name__}: {error}){_verl_hint(error)}") from error
    if not hasattr(module, name):
        names = sorted(key for key in vars(module) if not key.startswith("_"))
        raise PluginError(f"{what} {spec!r}: {where} has no {name!r}; it defines {', '.join(names[:12]) or 'nothing'}")
    return getattr(module, name)


VERL_HINT = ("; it is a verl tool or reward and verl is not installed: see "
             "docs/byo-task.md#verl-tools-as-they-are")


def _verl_hint(error: BaseException) -> str:
    return VERL_HINT if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "verl" else ""


def _find_package_root(top: str, base: Path | None) -> None:
    """Put the folder that holds package `top` on `sys.path` if `top` is not importable as it is:
    the current directory, then `base` and the folders above it."""
    if importlib.util.find_spec(top) is not None:
        return
    places = [Path.cwd()]
    if base is not None:
        base = base.expanduser().resolve()
        places += [base, *base.parents]
    for place in places:
        if (place / top).is_dir() or (place / f"{top}.py").is_file():
            sys.path.insert(0, str(place))
            importlib.invalidate_caches()
            return


def _on_path(folder: Path) -> None:
    """The user's file imports its neighbours, as it would run as a script."""
    if str(folder) not in sys.path:
        sys.path.append(str(folder))


def _import_file(path: Path, spec: str, what: str):
    """The file as a module of its own: one module per file and content, however many specs name it
    (a file edited since is imported again, as a new process would)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"{what} {spec!r}: no such file {path}")
    digest = hashlib.sha256(str(path).encode() + b"\0" + path.read_bytes()).hexdigest()[:16]
    module_name = f"cleaner_user_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"{what} {spec!r}: {path} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    _on_path(path.parent)
    try:
        module_spec.loader.exec_module(module)
    except BaseException as error:  # a SyntaxError, a missing import, an exit at import time
        del sys.modules[module_name]
        if isinstance(error, KeyboardInterrupt):
            raise
        where = f" (line {error.lineno})" if isinstance(error, SyntaxError) and error.lineno else ""
        raise PluginError(f"{what} {spec!r}: importing {path} failed{where}: "
                          f"{type(error).__name__}: {error}{_verl_hint(error)}") from error
    return module


# ---------------------------------------------------------------------------------------------
# The user's files as a config names them: absolute, so a stored config names the same files anywhere


def local_path(value: str) -> bool:
    """Whether a model, dataset or file argument names a local path (a hub id such as
    Qwen/Qwen3-4B does not): one that exists, or is spelt as a path."""
    return Path(value).expanduser().exists() or value.startswith((os.sep, "./", "../", "~"))


def resolved_path(value: str | None, always: bool = True) -> str | None:
    """A path made absolute (from the working directory, `~` expanded): a config stored in a
    warehouse names the same files wherever it is read from. Without `always`, only a local one
    (a model argument may be a hub id)."""
    if value is None or not (always or local_path(value)):
        return value
    return os.path.abspath(os.path.expanduser(value))


def resolved_spec(spec: str | None, default_name: str | None = None) -> str | None:
    """A `PATH.py[:NAME]` spec with its file made absolute and its name written out (so equivalent
    spellings are one spec); a module's spec, or one that does not parse, as it is."""
    if spec is None:
        return None
    try:
        where, name = split_spec(spec, default_name)
    except PluginError:
        return spec  # its loader says what is wrong with it
    if not (where.endswith(".py") or "/" in where):
        return spec
    return f"{os.path.abspath(os.path.expanduser(where))}:{name}"


def resolved_specs(specs: str | None) -> str | None:
    """Comma-separated `PATH.py:NAME` specs (`--tool`), each resolved."""
    if specs is None:
        return None
    return ",".join(resolved_spec(part.strip()) for part in specs.split(",") if part.strip())
