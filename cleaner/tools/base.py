"""What a tool is: the protocol a user's tool follows (docs/byo-task.md).

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
the arguments as keywords. `call` (or the function) may be a coroutine function.

A tool may keep state per rollout, as verl's tools keep it per trajectory: `create(context)` is
called before a rollout's first call of it (`context` holds the rollout's id and its row's verl
`tools_kwargs`), `call_in(arguments, context)` for each call, and `release(rollout_id)` once the
rollout ends, whatever ended it; what `release` returns (a number) is the tool's reward for the
rollout, which the reward function reads as verl's `extra_info["rollout_reward_scores"][name]`.
A verl tool (a `verl.tools.base_tool.BaseTool` subclass in a verl tool config) is run through the
same life: `create`, `execute`, `calc_reward` and `release` (verl.py).

Three outcomes, and only the first two are the model's; every kind of tool is read by this one rule:
- a success: a str, or `ToolResult(text)`;
- a failed call (SAAR retries it and may purify it): an argument error the call raises
  (`ARGUMENT_ERRORS`: what code raises on arguments it cannot use, `ValueError`, `KeyError`,
  `IndexError`, `TypeError`, `AttributeError`, `ZeroDivisionError`, ...), or
  `ToolResult(text, ok=False)`;
- an infrastructure fault, the tool's service and not the call: any other exception (a
  `RuntimeError`, a refused connection, the tool's own `TimeoutError`), `raise
  ToolUnavailable(...)`, or `ToolResult(text, infra=True)`. The call is tried again (`Toolbox`); if
  the service stays down it is stored as `infra_error`, as the code interpreter's sandbox faults
  are, and the rollout is never trained on (docs/architecture.md §7).
`create` never sees the model's arguments: an argument error there is the row's or the tool's
problem (one line stops the collection), any other exception its service's fault.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field

from cleaner.plugins import PluginError

# What code raises on arguments it cannot use: a call's failure, the model's (module notes).
ARGUMENT_ERRORS = (LookupError, TypeError, AttributeError, ValueError, ArithmeticError)


class ToolError(PluginError):
    """A tool that cannot be loaded or that broke its protocol; the message names it."""


class ToolUnavailable(Exception):  # noqa: N818 - what a tool raises, named for what it says
    """Raised by a tool whose service is down: an infrastructure fault, never the model's failure."""


@dataclass(frozen=True)
class ToolResult:
    """What a call returns: the text the model sees, and whether the call succeeded."""

    text: str
    ok: bool = True
    error_type: str | None = None  # a failed call's kind, stored as the row's error_type (default "ToolError")
    infra: bool = False  # the tool's service failed, not the call: retried, then stored as infra_error
    reward: float | None = None  # a step reward (verl's `execute` returns one): the reward function's
    #                              extra_info["rollout_reward_scores"][name] lists them


@dataclass(frozen=True)
class CallContext:
    """Whose call it is: the rollout, and its dataset row's `extra_info["tools_kwargs"]` (verl's
    per-row tool arguments: `{name: {"create_kwargs": {...}}}`)."""

    rollout_id: str = ""
    tools_kwargs: Mapping = field(default_factory=dict)

    def create_kwargs(self, name: str) -> dict:
        """The row's `create_kwargs` for tool `name` ({} without)."""
        entry = self.tools_kwargs.get(name) if isinstance(self.tools_kwargs, Mapping) else None
        kwargs = entry.get("create_kwargs") if isinstance(entry, Mapping) else None
        return dict(kwargs) if isinstance(kwargs, Mapping) else {}


class Tool:
    """A tool: subclass it, set `name`, `description` and `parameters`, and write `call`."""

    name: str = ""
    description: str = ""
    parameters: Mapping = {"type": "object", "properties": {}}  # JSON schema of the arguments
    timeout_s: float | None = None  # per call; None: the sandbox's timeout (--sandbox-timeout-s)
    verbatim: bool = False  # its text reaches the model as it is (verl's tools word their own answers)

    def __init__(self, config: Mapping | None = None, tool_schema: Mapping | None = None) -> None:
        self.config = dict(config or {})
        if tool_schema is not None:  # verl's layout: the schema in the YAML names and describes the tool
            self.set_schema(tool_schema)
        if "timeout_s" in self.config:
            self.timeout_s = float(self.config["timeout_s"])

    def set_schema(self, tool_schema: Mapping) -> None:
        """Take the name, description and parameters of an OpenAI function schema."""
        function = tool_schema.get("function", tool_schema)
        self.name = function.get("name", self.name)
        self.description = function.get("description", self.description)
        self.parameters = function.get("parameters", self.parameters)

    @property
    def schema(self) -> dict:
        """The OpenAI function schema the chat template shows the model."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}

    @property
    def is_coroutine(self) -> bool:
        """Its call is a coroutine function (run on the tool's own loop, not a thread): `call_in`
        where the tool writes its own, else `call`."""
        return inspect.iscoroutinefunction(self.call_in if self.has_own("call_in") else self.call)

    def has_own(self, hook: str) -> bool:
        """Its class writes its own `hook` (`call_in`, `create`, `open`, ...), not Tool's default."""
        return getattr(type(self), hook) is not getattr(Tool, hook)

    def call(self, arguments: dict) -> ToolResult | str:
        raise NotImplementedError(f"tool {self.name!r} has no call()")

    def call_in(self, arguments: dict, context: CallContext):
        """The call made by a rollout (`context`); a plain tool's is `call(arguments)`."""
        return self.call(arguments)

    def create(self, context: CallContext) -> None:
        """Before a rollout's first call of this tool (may be `async def`). An argument error is the
        row's problem (one line stops the collection); any other exception a service fault, tried
        again and then `infra_error`; the next call creates again."""

    def release(self, rollout_id: str) -> float | None:
        """Once the rollout has ended, if `create` ran for it (may be `async def`): its state goes,
        and what it returns (a number, as verl's `calc_reward`) is the tool's reward for the rollout."""
        return None

    async def open(self) -> None:
        """Set up on the tool's own event loop, once, before any call (verl tools are built here)."""

    async def close(self) -> None:
        """Tear down on the tool's own event loop, once, after the last call."""


class FunctionTool(Tool):
    """A plain function (or coroutine function) as a tool: its schema from its signature and docstring."""

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

    @property
    def is_coroutine(self) -> bool:
        return inspect.iscoroutinefunction(self.function)

    def call(self, arguments: dict):
        return self.function(**arguments)
