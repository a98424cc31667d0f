"""Tools beside the Python code interpreter: the protocol a user's tool follows, loading tools from
`--tools PATH.yaml` and `--tool PATH.py:NAME`, and running their calls (docs/byo-task.md).

A tool is a name, a JSON schema of its arguments (shown to the model through the chat template)
and a call that returns text, ok or not:

    from cleaner.tools import Tool, ToolResult

    class Convert(Tool):
        name = "convert_units"
        description = "Convert a quantity from one unit to another."
        parameters = {"type": "object", "properties": {...}, "required": [...]}

        def call(self, arguments: dict) -> ToolResult | str:
            ...  # a str is a success; ToolResult(text, ok=False) or an exception is a failed call

A plain function with type hints and a Google-style docstring is a tool too (its schema is
transformers' `get_json_schema` of it, as transformers' chat templates read functions), called with
the arguments as keywords. `call` may be a coroutine function (awaited on the collection's loop).

Design decisions:
- The code interpreter (`code_interpreter`, chat.py) stays built in, first in the list the template
  shows; a user tool may not take its name, nor two tools one name.
- The YAML layout is verl's tool config: `tools:` a list of `class_name` (a `PATH.py:Class`, read
  from the YAML file's folder, or a dotted `module.Class`), `config` (a mapping passed to the class
  as `config=`) and `tool_schema` (an OpenAI function schema, passed as `tool_schema=`; it
  overrides the class's own name, description and parameters). A function may stand in for a class
  (no config).
- A failed call of any tool is a failed call for SAAR: an exception raised by the tool (its type
  is the row's error_type, `Type: message` the text the model sees), a `ToolResult(ok=False)`, or
  a call running past its timeout (`timeout_s` of the tool, else the sandbox's). Arguments that do
  not match the tool's schema (jsonschema) are a format error, as an unreadable call is, and the
  tool is not called.
- User tools are the user's trusted code and run in this process: a synchronous call on a thread of
  the toolbox's pool, so the other rollouts go on meanwhile. A thread cannot be killed: a call
  past its timeout is answered `timeout` at once and its thread finishes on its own (a warning says
  so); the pool has `THREADS` threads, so a few such calls never block the others.
- A tool that returns something other than a str or a ToolResult is a bug in the tool, not the
  model's failure: `ToolError`, one `error:` line naming the tool, and the collection stops (parts
  committed before stay), as a reward function that returns a non-number does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cleaner.engine.model.chat import TOOL_NAME, TOOL_SCHEMA, valid_text
from cleaner.plugins import PluginError, load_object

logger = logging.getLogger(__name__)

THREADS = 32  # threads running synchronous tool calls at once


class ToolError(PluginError):
    """A tool that cannot be loaded or that broke its protocol; the message names it."""


@dataclass(frozen=True)
class ToolResult:
    """What a call returns: the text the model sees, and whether the call succeeded."""

    text: str
    ok: bool = True
    error_type: str | None = None  # a failed call's kind, stored as the row's error_type (default "ToolError")


class Tool:
    """A tool: subclass it, set `name`, `description` and `parameters`, and write `call`."""

    name: str = ""
    description: str = ""
    parameters: Mapping = {"type": "object", "properties": {}}  # JSON schema of the arguments
    timeout_s: float | None = None  # per call; None: the sandbox's timeout (--sandbox-timeout-s)

    def __init__(self, config: Mapping | None = None, tool_schema: Mapping | None = None) -> None:
        self.config = dict(config or {})
        if tool_schema is not None:  # verl's layout: the schema in the YAML names and describes the tool
            function = tool_schema.get("function", tool_schema)
            self.name = function.get("name", self.name)
            self.description = function.get("description", self.description)
            self.parameters = function.get("parameters", self.parameters)
        if "timeout_s" in self.config:
            self.timeout_s = float(self.config["timeout_s"])

    @property
    def schema(self) -> dict:
        """The OpenAI function schema the chat template shows the model."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}

    def call(self, arguments: dict) -> ToolResult | str:
        raise NotImplementedError(f"tool {self.name!r} has no call()")


class FunctionTool(Tool):
    """A plain function as a tool: its schema from its signature and docstring."""

    def __init__(self, function, spec: str) -> None:
        from transformers.utils import get_json_schema  # the templates' own reading of a function

        try:
            schema = get_json_schema(function)
        except Exception as error:  # noqa: BLE001 - transformers raises its own types for a bad docstring
            raise ToolError(f"tool {spec!r}: cannot read a schema from {function.__name__}'s signature and "
                            f"docstring ({error}); give every argument a type hint and a line under "
                            "'Args:', or write a Tool class") from error
        super().__init__(tool_schema=schema)
        self.function = function

    def call(self, arguments: dict):
        return self.function(**arguments)


# ---------------------------------------------------------------------------------------------
# Loading


def load_tools(tools_yaml: str | None, tool_specs: str | None) -> list[Tool]:
    """The user's tools: those of a verl tool config, then those named `PATH.py:NAME` (comma-separated).
    Every problem is one ToolError line, raised before any model is loaded."""
    tools = _from_yaml(Path(tools_yaml)) if tools_yaml else []
    for spec in (tool_specs or "").split(","):
        if spec.strip():
            tools.append(_make(load_object(spec.strip(), "tool"), spec.strip(), None, None))
    _check_names(tools)
    return tools


def _from_yaml(path: Path) -> list[Tool]:
    import yaml  # on first use: most collections read no tool config

    where = f"tool config {path}"
    try:
        document = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ToolError(f"{where}: no such file") from None
    except (OSError, yaml.YAMLError) as error:
        raise ToolError(f"{where}: not readable YAML ({error})") from error
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolError(f"{where}: expected a `tools:` list of {{class_name, config, tool_schema}} (verl's layout)")
    tools = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolError(f"{where}: tools[{index}] needs a `class_name` (PATH.py:Class or module.Class)")
        config, schema = entry.get("config") or {}, entry.get("tool_schema")
        if not isinstance(config, dict) or (schema is not None and not isinstance(schema, dict)):
            raise ToolError(f"{where}: tools[{index}]: `config` and `tool_schema` must be mappings")
        spec = entry["class_name"]
        tools.append(_make(load_object(spec, "tool", base=path.parent), spec, config, schema))
    return tools


def _make(found: object, spec: str, config: dict | None, schema: dict | None) -> Tool:
    """A Tool from what a spec names: a Tool class (instantiated), a Tool, or a function."""
    try:
        if isinstance(found, type) and issubclass(found, Tool):
            tool = found(config=config, tool_schema=schema)
        elif isinstance(found, Tool):
            tool = found
        elif callable(found) and not isinstance(found, type):
            tool = FunctionTool(found, spec)
            if schema is not None:
                tool = _with_schema(tool, schema)
        else:
            raise ToolError(f"tool {spec!r}: expected a Tool subclass, a Tool or a function, got {type(found).__name__}")
    except ToolError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's constructor
        raise ToolError(f"tool {spec!r}: creating it raised {type(error).__name__}: {error}") from error
    if not isinstance(tool.name, str) or not tool.name.isidentifier():
        raise ToolError(f"tool {spec!r}: its name must be an identifier, got {tool.name!r}")
    _check_schema(tool, spec)
    return tool


def _with_schema(tool: FunctionTool, schema: dict) -> FunctionTool:
    function = schema.get("function", schema)
    tool.name = function.get("name", tool.name)
    tool.description = function.get("description", tool.description)
    tool.parameters = function.get("parameters", tool.parameters)
    return tool


def _check_schema(tool: Tool, spec: str) -> None:
    import jsonschema  # on first use, as chat.py's call check: most collections have no user tool

    try:
        jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
    except jsonschema.SchemaError as error:
        raise ToolError(f"tool {spec!r}: its parameters are not a valid JSON schema ({error.message})") from error
    if tool.parameters.get("type") != "object":
        raise ToolError(f"tool {spec!r}: its parameters must be a JSON schema of type object (the call's arguments)")


def _check_names(tools: Sequence[Tool]) -> None:
    seen = {TOOL_NAME}
    for tool in tools:
        if tool.name in seen:
            clash = "the built-in code interpreter's" if tool.name == TOOL_NAME else "another tool's"
            raise ToolError(f"tool {tool.name!r}: the name is {clash}; give each tool its own")
        seen.add(tool.name)


# ---------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class ToolOutcome:
    """One call's outcome, as the agent loop records it."""

    status: str  # a ToolStatus value: ok, error, timeout
    error_type: str | None
    text: str
    exec_ms: float


class Toolbox:
    """The tools of a collection: their schemas for the chat template, their argument checks for
    the call parser, and their calls, each under its timeout."""

    def __init__(self, tools: Sequence[Tool] = (), timeout_s: float = 4.0, max_output_chars: int = 2048) -> None:
        _check_names(tools)
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self._executor: ThreadPoolExecutor | None = None

    @property
    def schemas(self) -> list[dict]:
        """Every tool's schema, the code interpreter's first."""
        return [TOOL_SCHEMA, *(tool.schema for tool in self.tools.values())]

    @property
    def parameters(self) -> dict[str, Mapping]:
        """{name: JSON schema of its arguments} of the user's tools (the parser checks calls with them)."""
        return {name: tool.parameters for name, tool in self.tools.items()}

    async def run(self, name: str, arguments: dict) -> ToolOutcome:
        """Call tool `name` with `arguments`; its exception, failure or timeout is a failed call."""
        tool = self.tools[name]
        timeout = tool.timeout_s if tool.timeout_s is not None else self.timeout_s
        started = time.monotonic()
        try:
            if inspect.iscoroutinefunction(tool.call):
                result = await asyncio.wait_for(tool.call(arguments), timeout)
            else:
                loop = asyncio.get_running_loop()
                future = loop.run_in_executor(self._pool(), tool.call, arguments)
                result = await asyncio.wait_for(future, timeout)
        except TimeoutError as error:
            if time.monotonic() - started < timeout:  # the tool's own TimeoutError: a failed call like any
                return ToolOutcome("error", type(error).__name__, self._cut(f"{type(error).__name__}: {error}"),
                                   _ms(started))
            if not inspect.iscoroutinefunction(tool.call):
                logger.warning("tool %s ran past its %.1f s timeout; its thread finishes on its own", name, timeout)
            return ToolOutcome("timeout", "TimeoutError", f"the call ran past its {timeout:g} s timeout",
                               _ms(started))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the tool's failure, the model's to read and retry
            return ToolOutcome("error", type(error).__name__, self._cut(f"{type(error).__name__}: {error}"),
                               _ms(started))
        if isinstance(result, str):
            return ToolOutcome("ok", None, self._cut(result), _ms(started))
        if isinstance(result, ToolResult):
            error_type = None if result.ok else valid_text(result.error_type or "ToolError")
            return ToolOutcome("ok" if result.ok else "error", error_type, self._cut(str(result.text)), _ms(started))
        raise ToolError(f"tool {name!r} returned {type(result).__name__} ({result!r:.80}); a tool returns "
                        "a str or a cleaner.tools.ToolResult")

    def _cut(self, text: str) -> str:
        text = valid_text(text)
        if len(text) <= self.max_output_chars:
            return text
        return f"{text[:self.max_output_chars]}...[truncated {len(text) - self.max_output_chars} chars]"

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="cleaner-tool")
        return self._executor

    def close(self) -> None:
        """Stop taking calls; a thread still running a timed-out call finishes on its own."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _ms(started: float) -> float:
    return (time.monotonic() - started) * 1000


def canonical_arguments(arguments: Mapping) -> str:
    """A call's arguments as the warehouse stores them (its `tool_code`, what SAAR's similarity
    compares for a tool other than the code interpreter): JSON with sorted keys."""
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)
