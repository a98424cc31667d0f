"""Loading the user's tools: `--tools PATH.yaml` (verl's tool config) and `--tool PATH.py:NAME`
(docs/byo-task.md).

Design decisions:
- The code interpreter (`code_interpreter`, responses.py) is built in, first in the list the template
  shows. A user tool of that name takes its place (the reference's code-judge tool is one: its
  config names it `code_interpreter`); no two user tools may share a name.
- The YAML layout is verl's tool config: `tools:` a list of `class_name` (a `PATH.py:Class`, read
  from the YAML file's folder, or a dotted `module.Class`), `config` (a mapping passed to the class
  as `config=`) and `tool_schema` (an OpenAI function schema, passed as `tool_schema=`; it
  overrides the class's own name, description and parameters). A function may stand in for a class
  (no config). A verl `BaseTool` class is run as verl runs it (verl.py).
- Every problem is one ToolError line, raised before any model is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cleaner.plugins import load_object
from cleaner.tools.base import FunctionTool, Tool, ToolError
from cleaner.tools.verl import VerlTool, is_verl_tool


def load_tools(tools_yaml: str | None, tool_specs: str | None) -> list[Tool]:
    """The user's tools: those of a verl tool config, then those named `PATH.py:NAME` (comma-separated)."""
    tools = _from_yaml(Path(tools_yaml)) if tools_yaml else []
    for spec in (tool_specs or "").split(","):
        if spec.strip():
            tools.append(_make(load_object(spec.strip(), "tool"), spec.strip(), None, None))
    check_names(tools)
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
        if is_verl_tool(found):
            tool = VerlTool(found, spec, config, schema)
        elif isinstance(found, type) and issubclass(found, Tool):
            tool = found(config=config, tool_schema=schema)
        elif isinstance(found, Tool):
            tool = found
        elif callable(found) and not isinstance(found, type):
            tool = FunctionTool(found, spec)
            if schema is not None:
                tool.set_schema(schema)
        else:
            raise ToolError(f"tool {spec!r}: expected a cleaner Tool subclass, a verl BaseTool subclass, a Tool or a "
                            f"function, got {type(found).__name__} {getattr(found, '__name__', '')}".rstrip())
    except ToolError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's constructor
        raise ToolError(f"tool {spec!r}: creating it raised {type(error).__name__}: {error}") from error
    if not isinstance(tool.name, str) or not tool.name.isidentifier():
        raise ToolError(f"tool {spec!r}: its name must be an identifier, got {tool.name!r}")
    _check_schema(tool, spec)
    return tool


def _check_schema(tool: Tool, spec: str) -> None:
    import jsonschema  # on first use, as chat.py's call check: most collections have no user tool

    try:
        jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
    except jsonschema.SchemaError as error:
        raise ToolError(f"tool {spec!r}: its parameters are not a valid JSON schema ({error.message})") from error
    if tool.parameters.get("type") != "object":
        raise ToolError(f"tool {spec!r}: its parameters must be a JSON schema of type object (the call's arguments)")


def check_names(tools: Sequence[Tool]) -> None:
    """No two user tools share a name (one named `code_interpreter` replaces the built-in one)."""
    seen = set()
    for tool in tools:
        if tool.name in seen:
            raise ToolError(f"tool {tool.name!r}: the name is another tool's; give each tool its own")
        seen.add(tool.name)
