"""verl tools as they are: a `verl.tools.base_tool.BaseTool` subclass named in a verl tool config,
run through the life verl gives its tools (docs/byo-task.md#verl-tools-as-they-are).

Design decisions:
- A verl tool is told by its class hierarchy (a base class `BaseTool` from a `verl.` module), so
  loading one needs no verl import here; the tool's own module imports verl, which the user installs.
- It is built once, on its own event loop in the toolbox (`open`), with the entry's `config` and its
  `tool_schema` as verl's `OpenAIFunctionToolSchema`: a tool that opens an aiohttp session in its
  constructor (the reference's code-judge tool does) binds it to the loop its calls run on.
- An instance per rollout, the life verl designs its tools for (`lifetime:
  rollout`, the default): `create(create_kwargs=...)` with the row's `extra_info.tools_kwargs[name]
  .create_kwargs` before the rollout's first call, `execute(instance_id, arguments)` for each call,
  and at the rollout's end, whatever ended it, `calc_reward(instance_id)`, the reward function's
  `extra_info["rollout_reward_scores"][name]` as it returned it, then `release(instance_id)`.
  `create` is called as verl's agent loop calls it (`create_kwargs=` the row's); a tool the
  rollout never calls is never created, and has no score. `lifetime: call` runs
  each call as verl's ToolAgentLoop, and so the reference, runs it: `create`, `execute`,
  `release`, and no `calc_reward`. The code-judge tool keeps no state between calls, so either
  gives it the same answers. `execute`'s reward is the call's step reward (`extra_info["tool_rewards"]`).
- `create` raising an argument error (base.py's `ARGUMENT_ERRORS`: KeyError, TypeError, ValueError,
  ...) is the row's or the tool's problem, never the model's (its arguments do not reach
  `create`): one line stops the collection; any other exception is its service's fault. The
  toolbox reads a cleaner tool's `create` by the same rule.
- The text reaches the model as the tool wrote it (`verbatim`: verl adds no wording), cut by
  --max-tool-response-chars as verl cuts it.
- Success or failure is read from the text as the reference reads its code judge's answers: empty,
  or holding the success marker (`config.success_marker`, default "Tool call success"), is a
  success; any other text is a failed call whose error type is the first of the reference's
  error patterns it holds, else `unknown_error`. `success_marker: null` makes every text a success.
- An exception from `execute`: KeyError, TypeError or AttributeError is a failed call with the
  reference's "tool call format is wrong" text, another argument error (ValueError, IndexError,
  ZeroDivisionError, ...) one with its "Tool call failure."; any other (the code judge's
  RuntimeError after its retries, a connection refused) is the service's fault: tried again, then
  `infra_error`, never trained, as any tool's (base.py). The reference trains those as the
  model's failures ("Tool call failure.").
- verl sets no timeout on a call; here `config.timeout_s`, default `TIMEOUT_S`.
- `close` awaits the tool's `cleanup()` where it has one (the code judge's closes its session).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping

from cleaner.tools.base import (
    ARGUMENT_ERRORS,
    CallContext,
    Tool,
    ToolError,
    ToolResult,
    ToolUnavailable,
)

SUCCESS_MARKER = "Tool call success"  # the reference's code judge's first line on a success
# The reference's rollback error patterns (recipe/cleaner/*.sh), in its order: a failed call's type.
ERROR_PATTERNS = ("ImportError", "ModuleNotFoundError", "SyntaxError", "IndexError", "IndentationError", "NameError",
                  "TypeError", "worker_timeout", "NotImplementedError", "ValueError", "ZeroDivisionError")
UNKNOWN_ERROR = "unknown_error"
FORMAT_ERRORS = (KeyError, TypeError, AttributeError)  # the reference's: arguments the tool could not read
FORMAT_TEXT = ("Tool call failure: tool call format is wrong, please make sure to generate correct json-format "
               "tool call arguments.")  # the reference's answer to them
FAILURE_TEXT = "Tool call failure."  # the reference's answer to any other exception; here another argument error's
TIMEOUT_S = 300.0
LIFETIMES = ("rollout", "call")
CLEANUP_S = 30.0


def is_verl_tool(found: object) -> bool:
    """A class deriving from verl's `BaseTool`."""
    return isinstance(found, type) and any(
        base.__name__ == "BaseTool" and base.__module__.startswith("verl.") for base in found.__mro__)


class VerlTool(Tool):
    """A verl BaseTool class, run per call as verl runs it (module notes)."""

    verbatim = True

    def __init__(self, cls: type, spec: str, config: Mapping | None, tool_schema: Mapping | None) -> None:
        if tool_schema is None:
            raise ToolError(f"tool {spec!r}: a verl tool takes its name and parameters from the entry's "
                            "`tool_schema` (an OpenAI function schema); the entry has none")
        config = dict(config or {})
        self.success_marker = config.get("success_marker", SUCCESS_MARKER)
        self.lifetime = config.get("lifetime", "rollout")
        if self.lifetime not in LIFETIMES:
            raise ToolError(f"tool {spec!r}: lifetime must be one of {', '.join(LIFETIMES)}, got {self.lifetime!r}")
        super().__init__(config, tool_schema)
        self.timeout_s = float(config.get("timeout_s", TIMEOUT_S))
        self.cls, self.spec, self.tool_schema = cls, spec, dict(tool_schema)
        self.instance = None
        self.instances: dict[str, str] = {}  # rollout id -> its instance id (lifetime: rollout)

    async def call(self, arguments: dict) -> ToolResult:
        return await self.call_in(arguments, CallContext())

    async def open(self) -> None:
        try:
            from verl.tools.schemas import OpenAIFunctionToolSchema  # the user's verl
        except ImportError as error:
            raise ToolError(f"tool {self.spec!r}: verl.tools.schemas is not importable ({error}); "
                            "see docs/byo-task.md#verl-tools-as-they-are") from error
        try:
            schema = OpenAIFunctionToolSchema.model_validate(self.tool_schema)
            self.instance = self.cls(config=self.config, tool_schema=schema)
        except Exception as error:  # noqa: BLE001 - the user's constructor, or pydantic on the schema
            raise ToolError(f"tool {self.spec!r}: creating it raised {type(error).__name__}: {error}") from error

    async def create(self, context: CallContext) -> None:
        if self.lifetime == "rollout":
            self.instances[context.rollout_id] = await self._create(context)

    async def _create(self, context: CallContext) -> str:
        if self.instance is None:
            raise ToolError(f"tool {self.spec!r} was called before it was opened")
        try:
            created = await self.instance.create(create_kwargs=context.create_kwargs(self.name))
        except ARGUMENT_ERRORS as error:
            raise ToolError(f"tool {self.name!r} ({self.spec}): create raised {type(error).__name__}: {error} on "
                            f"rollout {context.rollout_id}; it reads the row's extra_info.tools_kwargs."
                            f"{self.name}.create_kwargs, which has {sorted(context.create_kwargs(self.name))}") from error
        except (ToolError, asyncio.CancelledError):
            raise
        except Exception as error:  # noqa: BLE001 - the tool's service: retried, then infra_error
            raise ToolUnavailable(f"{type(error).__name__}: {error}") from error
        return created[0] if isinstance(created, tuple) else created

    async def call_in(self, arguments: dict, context: CallContext) -> ToolResult:
        per_call = self.lifetime == "call" or context.rollout_id not in self.instances
        instance_id = await self._create(context) if per_call else self.instances[context.rollout_id]
        try:
            answer = await self.instance.execute(instance_id, arguments)
        except ARGUMENT_ERRORS as error:
            text = FORMAT_TEXT if isinstance(error, FORMAT_ERRORS) else FAILURE_TEXT
            return ToolResult(text, ok=False, error_type=type(error).__name__)
        except (ToolError, ToolUnavailable, asyncio.CancelledError):
            raise
        except Exception as error:  # noqa: BLE001 - the tool's service, not the call: retried, then infra_error
            raise ToolUnavailable(f"{type(error).__name__}: {error}") from error
        finally:
            if per_call:
                await _quietly(self.instance.release(instance_id))
        response, reward = (answer[0], answer[1]) if isinstance(answer, tuple) else (answer, None)
        text = response if isinstance(response, str) else getattr(response, "text", None)
        text = "" if text is None else str(text)
        error_type = self.failure(text)
        try:
            reward = None if reward is None else float(reward)
        except (TypeError, ValueError):
            raise ToolError(f"tool {self.name!r} ({self.spec}): execute returned the step reward {reward!r:.80}; "
                            "verl's execute returns (ToolResponse, reward: float, metrics: dict)") from None
        return ToolResult(text, ok=error_type is None, error_type=error_type, reward=reward)

    def failure(self, text: str) -> str | None:
        """None for a success, else the failed call's type (module notes)."""
        if self.success_marker is None or not text or self.success_marker in text:
            return None
        return next((pattern for pattern in ERROR_PATTERNS if pattern in text), UNKNOWN_ERROR)

    async def release(self, rollout_id: str) -> object:
        instance_id = self.instances.pop(rollout_id, None)
        if instance_id is None:
            return None
        try:
            return await self.instance.calc_reward(instance_id)  # passed on as it is, as verl does
        finally:
            await _quietly(self.instance.release(instance_id))

    async def close(self) -> None:
        cleanup = getattr(self.instance, "cleanup", None)
        if cleanup is not None and inspect.iscoroutinefunction(cleanup):
            await asyncio.wait_for(_quietly(cleanup()), CLEANUP_S)


async def _quietly(awaitable) -> None:
    """A release or a clean-up: what it raises is the tool's own business, never the call's outcome."""
    try:
        await awaitable
    except Exception:  # noqa: BLE001, S110 - verl's loop logs and drops these too
        pass
