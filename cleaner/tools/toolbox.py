"""Running the user's tools: each call routed by name, checked, and timed by its own clock
(docs/byo-task.md, docs/architecture.md §5).

Design decisions:
- User tools are the user's trusted code and run in this process, never on the collection's event
  loop: a synchronous call on a daemon thread of its own, at most `THREADS` at once; a coroutine on
  its tool's own event loop (a loop per tool, calls.py says why), so a tool that blocks its loop
  delays its own calls only, and is named in one warning line. Either way its timeout (`timeout_s`
  of the tool, else the sandbox's) measures its own run: a call waiting for a thread, or for its
  loop, has no clock running, so what a call stores never depends on how many rollouts are in flight.
- A call past its timeout is answered `timeout` at its deadline. A thread cannot be killed: it runs
  on as a daemon (it never holds up the exit), its slot goes to the next call, and past
  `MAX_HUNG` such calls still running the collection stops with one line (calls.py).
- Opening and closing are bounded (`OPEN_TIMEOUT_S`, `CLOSE_TIMEOUT_S` a tool): a tool whose
  `open` does not return is one line, one whose `close` does not return a warning.
- One reading of a fault for every tool (a cleaner `Tool`, a function, a verl tool): a failed call
  for SAAR is an argument error the call raises (`ARGUMENT_ERRORS`: what arguments a tool cannot
  use raise; its type is the row's error_type, `Type: message` the text the model sees), a
  `ToolResult(ok=False)`, or a call past its timeout. Any other exception is the tool's service's
  fault, never the model's: read as `ToolUnavailable`. `create` never sees the model's arguments:
  an argument error there is the row's or the tool's problem (one `ToolError` line stops the
  collection), any other exception the service's.
- An infrastructure fault (`ToolUnavailable`, `ToolResult(infra=True)`, a coroutine its blocked
  loop never started) is tried again `INFRA_TRIES` times in all, `INFRA_BACKOFF_S` apart and
  doubling; then it is `infra_error`, which purify keeps out of training (docs/architecture.md §7).
- A tool that returns something other than a str or a ToolResult is a bug in the tool, not the
  model's failure: `ToolError`, one `error:` line naming the tool, and the collection stops (parts
  committed before stay), as a reward function that returns a non-number does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cleaner.plugins import plain
from cleaner.records import ToolStatus
from cleaner.tools.base import (
    ARGUMENT_ERRORS,
    CallContext,
    Tool,
    ToolError,
    ToolResult,
    ToolUnavailable,
)
from cleaner.tools.calls import CoroutineCalls, Hung, ThreadCalls, Timed
from cleaner.tools.loading import check_names
from cleaner.tools.responses import TOOL_NAME, TOOL_SCHEMA, valid_text

logger = logging.getLogger(__name__)

THREADS = 32  # synchronous tool calls running at once; more wait, with no clock running
MAX_HUNG = 32  # calls still running past their timeouts before the collection stops
INFRA_TRIES = 3  # tries of a call whose tool reports its service down
INFRA_BACKOFF_S = 0.5  # before the second try; doubled before each later one
RELEASE_WAIT_S = 30.0  # at close, for the releases of stopped rollouts still running
OPEN_TIMEOUT_S = 300.0  # a tool's `open` (a verl tool's constructor may reach its service)
CLOSE_TIMEOUT_S = 30.0  # a tool's `close`


@dataclass(frozen=True)
class ToolOutcome:
    """One call's outcome, as the agent loop records it."""

    status: ToolStatus  # ok, error, timeout, infra_error
    error_type: str | None
    text: str
    exec_ms: float  # the call's own run (the last try's)
    verbatim: bool = False  # shown to the model as it is (a verl tool's own wording)
    reward: float | None = None  # the call's step reward, where the tool gives one (verl's)


class Toolbox:
    """The tools of a collection: their schemas for the chat template, their argument checks for
    the call parser, and their calls, each under its timeout."""

    def __init__(self, tools: Sequence[Tool] = (), timeout_s: float = 4.0, max_output_chars: int = 2048) -> None:
        check_names(tools)
        self.tools = {tool.name: tool for tool in tools}
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.hung = Hung(MAX_HUNG)  # calls past their timeouts still running, of every tool
        self.threads = ThreadCalls(THREADS, self.hung, "cleaner-tool")
        self.loops = {name: CoroutineCalls(f"tool {name!r}", self.hung) for name in self.tools}  # started on use
        self.control = CoroutineCalls("the toolbox's releases")  # where stopped rollouts' tools are released
        self.live: dict[str, set[str]] = {}  # rollout id -> the tools `create`d for it, to release at its end
        self.releasing: set[concurrent.futures.Future] = set()  # releases of stopped rollouts under way
        try:
            for tool in self._with("open"):  # before any model is loaded: a tool that cannot start is one line
                try:
                    self.loops[tool.name].submit(tool.open(), OPEN_TIMEOUT_S)
                except TimeoutError:
                    raise ToolError(f"tool {tool.name!r}: open() did not return within {OPEN_TIMEOUT_S:g} s") from None
        except BaseException:
            self._stop_loops()
            raise
        if TOOL_NAME in self.tools:
            logger.info("tool %s (%s) replaces the built-in code interpreter", TOOL_NAME, type(self.tools[TOOL_NAME]).__name__)

    def _with(self, hook: str) -> list[Tool]:
        """The tools that have their own `hook` (`open`, `create`, ...): the others need no call of it."""
        return [tool for tool in self.tools.values() if tool.has_own(hook)]

    @property
    def schemas(self) -> list[dict]:
        """Every tool's schema, the code interpreter's (built in, or the user's of its name) first."""
        interpreter = self.tools[TOOL_NAME].schema if TOOL_NAME in self.tools else TOOL_SCHEMA
        return [interpreter, *(tool.schema for name, tool in self.tools.items() if name != TOOL_NAME)]

    @property
    def parameters(self) -> dict[str, Mapping]:
        """{name: JSON schema of its arguments} of the user's tools (the parser checks calls with them)."""
        return {name: tool.parameters for name, tool in self.tools.items()}

    async def run(self, name: str, arguments: dict, context: CallContext | None = None) -> ToolOutcome:
        """Call tool `name` with `arguments` for a rollout (`context`); its exception, failure or
        timeout is a failed call, its service's fault is tried again and then `infra_error`."""
        tool, context = self.tools[name], context or CallContext()
        backoff = INFRA_BACKOFF_S
        for attempt in range(INFRA_TRIES):
            outcome = await self._run_once(tool, arguments, context)
            if outcome.status != ToolStatus.INFRA_ERROR or attempt == INFRA_TRIES - 1:
                return outcome
            logger.warning("tool %s reports its service down (try %d of %d): %s", name, attempt + 1,
                           INFRA_TRIES, outcome.text)
            await asyncio.sleep(backoff)
            backoff *= 2
        raise AssertionError("unreachable")

    async def _run_once(self, tool: Tool, arguments: dict, context: CallContext) -> ToolOutcome:
        timeout = self._timeout(tool)
        if context.rollout_id and tool.has_own("create") and tool.name not in self.live.get(context.rollout_id, ()):
            live = self.live.setdefault(context.rollout_id, set())
            live.add(tool.name)  # before it runs: a rollout stopped meanwhile still releases it
            created = await self._invoke(tool, tool.create, (context,), timeout)
            if created.timed_out or created.error is not None:  # the call is not made; the next one creates again
                live.discard(tool.name)
                return self._outcome(tool, timeout, created, creating=context)
        if tool.is_coroutine:
            timed = await self.loops[tool.name].run(lambda: tool.call_in(arguments, context), timeout)
        else:
            timed = await self.threads.run(tool.call_in, (arguments, context), timeout, f"tool {tool.name!r}")
        return self._outcome(tool, timeout, timed)

    def _timeout(self, tool: Tool) -> float:
        return tool.timeout_s if tool.timeout_s is not None else self.timeout_s

    async def _invoke(self, tool: Tool, method, args: tuple, timeout: float) -> Timed:
        """A tool's `create` or `release`, run where its calls run, under its timeout."""
        if inspect.iscoroutinefunction(method):
            return await self.loops[tool.name].run(lambda: method(*args), timeout)
        return await self.threads.run(method, args, timeout, f"tool {tool.name!r}")

    async def finish(self, rollout_id: str) -> dict[str, object]:
        """Release the tools a rollout created; {name: reward} of those whose `release` returned
        one (as verl passes `calc_reward`'s value on: a number, or what the tool gives). A release
        that raises or hangs is logged, never the rollout's outcome."""
        rewards = {}
        for name in sorted(self.live.pop(rollout_id, ())):
            tool = self.tools[name]
            done = await self._invoke(tool, tool.release, (rollout_id,), self._timeout(tool))
            if done.timed_out or done.error is not None:
                logger.warning("tool %s: releasing rollout %s failed: %s", name, rollout_id,
                               "timed out" if done.timed_out else repr(done.error))
            elif done.value is not None:
                rewards[name] = plain(done.value)  # as a reward worker process and JSON take it
        return rewards

    def abandon(self, rollout_id: str) -> None:
        """Release a rollout that ended without finishing (a fault, a stop), without waiting here;
        `close` waits for it."""
        if rollout_id in self.live:
            future = asyncio.run_coroutine_threadsafe(self.finish(rollout_id), self.control.loop())
            self.releasing.add(future)
            future.add_done_callback(self._released)

    def _released(self, future: concurrent.futures.Future) -> None:
        self.releasing.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.warning("releasing a stopped rollout's tools failed: %r", future.exception())

    def _outcome(self, tool: Tool, timeout: float, timed: Timed, creating: CallContext | None = None) -> ToolOutcome:
        """What a call (or a `create`, for the rollout `creating`) came to; a verl tool's text as it
        wrote it (verl cuts it only by --max-tool-response-chars), marked so."""
        error = timed.error
        if creating is not None and timed.timed_out:  # create never sees the model's arguments: its hang is the service's
            timed = dataclasses.replace(timed, timed_out=False,
                                        error=ToolUnavailable(f"create ran past its {timeout:g} s timeout"))
        elif isinstance(error, Exception) and not isinstance(error, ToolError | ToolUnavailable):
            timed = dataclasses.replace(timed, error=self._fault(tool.name, error, creating))
        if not tool.verbatim:
            return self._read(tool.name, timeout, timed, self._cut)
        return dataclasses.replace(self._read(tool.name, timeout, timed, valid_text), verbatim=True)

    @staticmethod
    def _fault(name: str, error: Exception, creating: CallContext | None) -> Exception:
        """Whose fault an exception is (module notes): an argument error of a call stays the call's;
        one of `create` is a ToolError; any other is the service's (ToolUnavailable)."""
        if not isinstance(error, ARGUMENT_ERRORS):  # LoopBlocked among them: its loop's, not the call's
            return ToolUnavailable(f"{type(error).__name__}: {error}")
        if creating is None:
            return error
        return ToolError(f"tool {name!r}: create raised {type(error).__name__}: {error} on rollout "
                         f"{creating.rollout_id}; create never sees the model's arguments, so this is the row's or "
                         f"the tool's problem (the row's extra_info.tools_kwargs.{name}.create_kwargs has "
                         f"{sorted(creating.create_kwargs(name))})")

    def _read(self, name: str, timeout: float, timed: Timed, cut: Callable[[str], str]) -> ToolOutcome:
        exec_ms = timed.seconds * 1000
        if timed.timed_out:
            logger.warning("tool %s ran past its %.1f s timeout", name, timeout)
            return ToolOutcome(ToolStatus.TIMEOUT, "TimeoutError", f"the call ran past its {timeout:g} s timeout", exec_ms)
        error = timed.error
        if isinstance(error, ToolError):  # the tool broke its protocol (a verl tool never opened)
            raise error
        if isinstance(error, ToolUnavailable):
            return ToolOutcome(ToolStatus.INFRA_ERROR, type(error).__name__, self._cut(f"the tool's service failed: {error}"),
                               exec_ms)
        if isinstance(error, Exception):  # an argument error: the model's to read and retry
            return ToolOutcome(ToolStatus.ERROR, type(error).__name__, self._cut(f"{type(error).__name__}: {error}"),
                               exec_ms)
        if error is not None:  # SystemExit, KeyboardInterrupt raised by the tool: a bug in it
            raise ToolError(f"tool {name!r} raised {type(error).__name__}; a tool returns a str or a "
                            "cleaner.tools.ToolResult, or raises an Exception for a failed call") from error
        result = timed.value
        if isinstance(result, str):
            return ToolOutcome(ToolStatus.OK, None, cut(result), exec_ms)
        if isinstance(result, ToolResult):
            if result.infra:
                return ToolOutcome(ToolStatus.INFRA_ERROR, valid_text(result.error_type or "ToolUnavailable"),
                                   cut(str(result.text)), exec_ms)
            error_type = None if result.ok else valid_text(result.error_type or "ToolError")
            return ToolOutcome(ToolStatus.OK if result.ok else ToolStatus.ERROR, error_type, cut(str(result.text)),
                               exec_ms, reward=result.reward)
        raise ToolError(f"tool {name!r} returned {type(result).__name__} ({result!r:.80}); a tool returns "
                        "a str or a cleaner.tools.ToolResult")

    def _cut(self, text: str) -> str:
        text = valid_text(text)
        if len(text) <= self.max_output_chars:
            return text
        return f"{text[:self.max_output_chars]}...[truncated {len(text) - self.max_output_chars} chars]"

    def close(self) -> None:
        """Close every tool, then stop the tools' loops; threads still running timed-out calls end on
        their own. Bounded: RELEASE_WAIT_S for stopped rollouts' releases, CLOSE_TIMEOUT_S a tool."""
        try:
            concurrent.futures.wait(list(self.releasing), timeout=RELEASE_WAIT_S)
            for tool in self._with("close"):
                try:
                    self.loops[tool.name].submit(tool.close(), CLOSE_TIMEOUT_S)
                except Exception as error:  # noqa: BLE001 - a tool's tear-down never masks how the job ended
                    logger.warning("tool %s: closing it failed: %r", tool.name, error)
        finally:
            self._stop_loops()

    def _stop_loops(self) -> None:
        for calls in [*self.loops.values(), self.control]:
            calls.close()


def canonical_arguments(arguments: Mapping) -> str:
    """A call's arguments as sorted JSON."""
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)
