"""The agent loop of `cleaner collect`: one rollout from prompt to reward (docs/architecture.md §5).

A rollout is a small state machine, as verl's ToolAgentLoop is: it renders its context, generates
its next turn, runs the turn's tool call, records both and decides what comes next (stop, retry,
next step), awaiting only its own requests (`run_rollout`). Which rollouts run at once, and when
finished ones are committed, is schedule.py's business; nothing a rollout records depends on it.
Each rollout's record is a list of raw `Segment`s (prompt, assistant, tool, ...) in generation
order; nothing is ever dropped, so any (gamma, p) can be replayed later.

Design decisions:
- Context = `render(segments so far, view).token_ids`, the SAME renderer purify uses. With the IS
  gate (rollback_is_threshold > 0) the rollout's own task scores each new retry under the context
  without the error before the next turn, so purifying at the collect config renders the same
  contexts. With the purified collect view a retry sees merged(a_0..a_{i-1}) + t_{i-1}, as in the
  reference agent loop; with the raw view (or a rollout whose draw u >= p) it is the plain
  concatenation. `collect_view` on the Rollout records which one was actually applied.
- step/attempt: a generation after a failed call is the next attempt of the same step, up to
  K = max_retries retries; after attempt K fails the next generation opens a new step. A tool
  segment carries the step/attempt of the call it answers.
- Turn accounting as the reference's: rolling back restores its turn counter, so retries do not
  use up `max_turns`. `max_turns` bounds the STEPS (each tool-call step and the answer count one,
  however many attempts a step takes) and K bounds the retries per step. A retry is generated as
  one more turn before the counter is rolled back, so it needs room for one more step: a call that
  fails at step max_turns - 1 ends the rollout (`max_turns`), as in the reference. The same rule holds in
  the raw view, so both views get the same budget (the reference, with rollback off for a sample,
  counts every generation; we keep one rule so that p only changes what SAAR renders).
- When a step's retries run out after two or more retries, the last error text carries the
  reference's note ("This approach has been attempted N times ...", N = retries made). It is part
  of the stored tool segment, so a replay renders exactly what the model saw.
- Seeds: every sampling seed and the rollback draw u are hashes of (seed, iteration, prompt_id,
  sample_index[, turn]), so a rollout does not depend on which rollouts ran beside it, in what
  order they finished, or which part it was committed in: a resumed run (skip_rollout_ids)
  reproduces exactly the rollouts it had not yet written. u is a multiple of 2^-24 so it survives
  the float32 warehouse column exactly.
- Response budget: measured on the CONTEXT the model sees (rendered length minus prompt length), as
  the reference measures its (rolled-back) response. Each request asks for at most its own
  rollout's limit; a generation longer than it (a lock-step turn asks for the largest limit of its
  batch) is cut to it (a prefix of a sample is a sample of the shorter request) and marked LENGTH.
  No generation runs past the model's context: prompts are checked against it first (context.py),
  and a limit never exceeds what the context has left.
- max_turns: as in the reference, a call opening the last allowed step is not executed; a retry
  is always executed (the reference regenerates it with its termination checks off).
- A LENGTH finish without a call ends the rollout (`max_tokens`); an unclosed call is a format error.
- Tools: a call names the built-in code interpreter (run in the sandbox) or one of the user's
  tools (cleaner/tools/, run by the toolbox under its timeout, with the row's verl `tools_kwargs`;
  one named `code_interpreter` takes the built-in's place); an unknown name, or arguments the
  tool's schema refuses, is a `format_error`. Whatever the tool, a failed call opens a retry, and
  SAAR compares calls by their `tool_code` (a user tool's: its arguments as sorted JSON).
- Faults: a backend exception (after the backend's own retries) ends that rollout unfinished
  (`InfraFault`): it is not stored, so `--resume` collects it again, and no other rollout is
  touched (schedule.py counts such faults and stops the collection when they are the rule). A
  sandbox exception is retried once, and a call that still raises gets `infra_error`, as a user
  tool's service that stays down does (docs/architecture.md §7: never trained on).
- Model text never ends a collection: a call that cannot be read (any JSON, any depth, any size,
  code that is not valid text) is a `format_error` row, since `parse_tool_call` never raises. Text
  columns hold valid UTF-8: assistant text is decoded from token ids (a byte-level tokenizer writes
  invalid bytes as U+FFFD; the ids stay the record), and the two texts that are not, the parsed
  code and the sandbox's output, are checked (`chat.parse_tool_call`) or made valid (`_from_result`)
  where they enter the trajectory.
- Reward: the built-in grader on the text of the last assistant segment, or the user's reward
  function (`--reward-fn`, grading/reward_file.py) on verl's arguments: the rendered context after
  the prompt, as the rollout's view renders it, decoded without special tokens. Either runs off the
  loop under `--reward-timeout-s` (grading/runner.py); one that raises, returns no reward or runs
  past its timeout stops the collection (one error line).
No disk I/O here: schedule.py hands finished rollouts to the caller, which stores them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from cleaner.config import CollectConfig
from cleaner.engine.collect.context import fit_prompts
from cleaner.engine.grading.reward_file import verl_extra_info
from cleaner.engine.model.base import LENGTH, Generation, SamplingParams
from cleaner.engine.model.chat import ChatFormat, ToolCall, parse_tool_call
from cleaner.engine.saar.gate import ScoreCache
from cleaner.engine.saar.walk import Rendered, RenderSettings, render, view_for
from cleaner.records import (
    CollectView,
    FinishReason,
    Rollout,
    Segment,
    SegmentKind,
    ToolStatus,
)
from cleaner.tools.base import CallContext
from cleaner.tools.responses import (
    format_tool_response,
    format_tool_text,
    truncated,
    valid_text,
)

if TYPE_CHECKING:
    from cleaner.engine.collect.tasks import Task
    from cleaner.engine.grading.runner import Rewards
    from cleaner.sandbox import ExecResult
    from cleaner.tools import Toolbox, ToolOutcome

logger = logging.getLogger(__name__)

# The reference's note on the last error of a step whose retries ran out (tool_agent_loop.py,
# `_handle_max_retry_exceeded`), shown when at least NOTE_MIN_RETRIES retries were made.
RETRIES_EXHAUSTED_NOTE = (
    "\n\nNote: This approach has been attempted {retries} times with the same type of error. "
    "Consider trying a different algorithm, method, or approach to solve this problem."
)
NOTE_MIN_RETRIES = 2


@dataclass(frozen=True)
class CollectedBatch:
    """Complete rollouts and all their segments: the unit the warehouse writes atomically."""

    rollouts: list[Rollout]
    segments: list[Segment]


# ---------------------------------------------------------------------------------------------
# Deterministic seeds


def _hash64(*parts: object) -> int:
    digest = hashlib.sha256(json.dumps([str(part) for part in parts]).encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rollout_key(iteration: int, prompt_id: str, sample_index: int) -> tuple[str, str]:
    """(rollout_id, group_id) of one sample."""
    group_id = f"it{iteration}-{prompt_id}"
    return f"{group_id}-s{sample_index}", group_id


def turn_seed(base_seed: int, iteration: int, prompt_id: str, sample_index: int, turn: int) -> int:
    """Sampling seed of one generation (turn = 0, 1, ... within the rollout)."""
    return _hash64("turn", base_seed, iteration, prompt_id, sample_index, turn) % 2**31


def rollback_draw(base_seed: int, iteration: int, prompt_id: str, sample_index: int) -> float:
    """u in [0, 1), a multiple of 2^-24 (exact in float32)."""
    return (_hash64("rollback", base_seed, iteration, prompt_id, sample_index) >> 40) / 2**24


# ---------------------------------------------------------------------------------------------
# Per-rollout state (mutable while the rollout runs)


class Phase(StrEnum):
    """Where a rollout is on its way (what the progress bar counts)."""

    PENDING = "pending"  # rendering its context (and scoring its IS gate)
    GENERATING = "generating"  # waiting for its turn from the backend
    TOOL = "tool"  # waiting for its call's outcome
    DONE = "done"


@dataclass
class RolloutState:
    """One rollout's record and counters while it runs."""

    task: Task
    iteration: int
    sample_index: int
    rollout_id: str
    group_id: str
    draw: float
    view: RenderSettings
    segments: list[Segment] = field(default_factory=list)
    step: int = 0  # of the next generation
    attempt: int = 0  # of the next generation
    turns: int = 0  # generations so far (indexes the sampling seeds)
    steps: int = 0  # steps opened so far: generations at attempt 0 (bounded by max_turns)
    finish_reason: FinishReason | None = None
    phase: Phase = Phase.PENDING
    index: int = 0  # its place in the plan (parts keep plan order)
    tool_rewards: list[float] = field(default_factory=list)  # the tools' step rewards, in call order
    tool_scores: dict[str, object] = field(default_factory=dict)  # {tool: its reward for the rollout, at release}

    def add(self, kind: SegmentKind, token_ids: Sequence[int], text: str, **fields) -> Segment:
        segment = Segment(
            rollout_id=self.rollout_id, iteration=self.iteration, seq=len(self.segments), kind=kind,
            token_ids=tuple(int(t) for t in token_ids), text=text, **fields,
        )
        self.segments.append(segment)
        return segment


@dataclass(frozen=True)
class _Outcome:
    """What one tool call produced, whoever produced it (sandbox, parser, or a fault)."""

    status: ToolStatus
    error_type: str | None
    exec_ms: float | None
    response: str


@dataclass(frozen=True)
class Plan:
    """The rollouts a collection will generate: how many, and each one's state, made as it starts."""

    total: int  # rollouts to generate
    states: Iterator[RolloutState]  # in plan order (prompt by prompt, sample by sample), lazily


def plan_rollouts(tasks: Sequence[Task], config: CollectConfig, chat: ChatFormat, skip_rollout_ids: frozenset[str],
                  rollout_prefix: str, context_length: int | None, strict_context: bool) -> Plan:
    """Every rollout still to generate, each state (with its prompt segment) made only when the
    schedule takes it, so memory holds the rollouts in flight, not every planned one; prompts are
    checked against the context first (context.py)."""
    prompts = [chat.prompt_ids(task.messages) for task in tasks]  # the same for every sample of a group
    prompts = fit_prompts(tasks, prompts, config, context_length, strict=strict_context)

    def key(task: Task, sample_index: int) -> tuple[str, str]:
        rollout_id, group_id = rollout_key(config.iteration, task.prompt_id, sample_index)
        return rollout_prefix + rollout_id, rollout_prefix + group_id

    def states() -> Iterator[RolloutState]:
        index = 0
        for task, prompt_ids in zip(tasks, prompts, strict=True):
            prompt_text = chat.decode(prompt_ids)
            for sample_index in range(config.group_size):
                rollout_id, group_id = key(task, sample_index)
                if rollout_id in skip_rollout_ids:
                    continue
                draw = rollback_draw(config.seed, config.iteration, task.prompt_id, sample_index)
                view = view_for(draw, config.collect_view == CollectView.PURIFIED, config)
                state = RolloutState(task, config.iteration, sample_index, rollout_id, group_id, draw, view,
                                     index=index)
                state.add(SegmentKind.PROMPT, prompt_ids, prompt_text, step=None, attempt=None, logprobs=None)
                index += 1
                yield state

    skipped = sum(key(task, sample)[0] in skip_rollout_ids for task in tasks for sample in range(config.group_size)) \
        if skip_rollout_ids else 0
    return Plan(len(tasks) * config.group_size - skipped, states())


# ---------------------------------------------------------------------------------------------
# One rollout, turn after turn


class InfraFault(Exception):  # noqa: N818 - names what happened to the rollout
    """A rollout's request failed outside the policy (a backend fault, after the backend's own
    retries): the rollout has no end, is not stored, and `--resume` collects it again."""

    def __init__(self, rollout_id: str, error: BaseException) -> None:
        super().__init__(f"rollout {rollout_id}: {type(error).__name__}: {error}")
        self.rollout_id, self.error = rollout_id, error


class Requests(Protocol):
    """What a rollout awaits: its generations and scores from the backend, its calls' runs from the
    sandbox (schedule.py gives each rollout one: straight through, or held for a lock step)."""

    async def generate(self, state: RolloutState, context: list[int], params: SamplingParams,
                       seed: int) -> Generation: ...

    async def score(self, state: RolloutState, sequences: Sequence[Sequence[int]],
                    starts: Sequence[int]) -> list[list[float]]: ...

    async def run_code(self, code: str) -> ExecResult: ...

    async def run_tool(self, name: str, arguments: dict, context: CallContext) -> ToolOutcome: ...

    async def finish_tools(self, state: RolloutState) -> dict[str, object]:
        """Release the rollout's tools: {tool: its reward for the rollout} (the toolbox's `finish`)."""

    def abandon_tools(self, state: RolloutState) -> None:
        """Release the tools of a rollout that ended without finishing, without waiting."""

    def leave(self, state: RolloutState) -> None:
        """The rollout needs no more turns (a lock step stops waiting for it)."""


@dataclass(frozen=True)
class CollectionSetup:
    """What every rollout of a collection shares: its config, format, context and rewards."""

    config: CollectConfig
    chat: ChatFormat
    context_length: int | None  # the model's, or None if unknown
    rewards: Rewards  # the built-in grader's or the user's reward function, computed off the loop
    policy_version: str
    on_context: Callable[[str, list[int]], None] | None = None  # sees every context before it is generated on
    toolbox: Toolbox | None = None  # the user's tools beside the code interpreter; None: none

    @property
    def tool_parameters(self) -> dict:
        """{name: JSON schema of its arguments} of the user's tools (the call parser's check)."""
        return {} if self.toolbox is None else self.toolbox.parameters


async def run_rollout(state: RolloutState, setup: CollectionSetup, requests: Requests) -> Rollout:
    """Generate one rollout to its end, turn after turn: render, generate, record, run the call,
    record its outcome, decide. Returns its row; its segments are on `state`."""
    try:
        return await _run(state, setup, requests)
    except BaseException:  # a fault, a stop: the rollout's tools are released all the same
        requests.abandon_tools(state)
        raise


async def _run(state: RolloutState, setup: CollectionSetup, requests: Requests) -> Rollout:
    cache = ScoreCache()  # the IS gate's scores of this rollout's retries
    while state.finish_reason is None:
        state.phase = Phase.PENDING
        rendered = await _render_context(state, setup, requests, cache)
        limit = _turn_limit(rendered, setup)
        if limit <= 0:
            state.finish_reason = FinishReason.MAX_TOKENS
            break
        context = list(rendered.token_ids)
        if setup.on_context is not None:
            setup.on_context(state.rollout_id, context)
        state.phase = Phase.GENERATING
        generation = await _generate(state, context, limit, setup, requests)
        call = _record_generation(state, generation, setup)
        if call is None:
            break  # answered, out of tokens, or the last step's call, which is not run
        state.phase = Phase.TOOL
        outcome = await _execute(call, state, setup, requests)
        _record_tool(state, call, outcome, setup.config, setup.chat)
    state.phase = Phase.DONE
    requests.leave(state)
    state.tool_scores = await requests.finish_tools(state)
    return await _finish(state, setup, requests, cache)


async def _render_context(state: RolloutState, setup: CollectionSetup, requests: Requests,
                          cache: ScoreCache) -> Rendered:
    """The rollout's context. An IS-gated view needs the old policy's log-probs of a retry under the
    context without the error: they are scored (this rollout's requests, in one call) and the
    context rendered again. InfraFault if the backend failed."""
    while True:
        rendered = render(state.segments, state.view, setup.chat.decode, oracle=cache)
        if not rendered.provisional:
            return rendered
        try:
            await cache.fill_async(lambda sequences, starts: requests.score(state, sequences, starts))
        except Exception as error:  # a backend fault ends this rollout unfinished, never the collection
            raise InfraFault(state.rollout_id, error) from error


def _turn_limit(rendered: Rendered, setup: CollectionSetup) -> int:
    """Tokens the next turn may take: the response budget left, within the context."""
    remaining = setup.config.max_response_tokens - (len(rendered.token_ids) - rendered.prompt_len)
    if setup.context_length is not None:  # binds only where the budget exceeds it (eval)
        remaining = min(remaining, setup.context_length - len(rendered.token_ids))
    return min(setup.config.max_new_tokens, remaining)


async def _generate(state: RolloutState, context: list[int], limit: int, setup: CollectionSetup,
                    requests: Requests) -> Generation:
    """The rollout's next turn; InfraFault if the backend failed."""
    config = setup.config
    params = SamplingParams(max_new_tokens=limit, stop_token_ids=tuple(setup.chat.stop_token_ids),
                            temperature=config.temperature, top_p=config.top_p)
    seed = turn_seed(config.seed, config.iteration, state.task.prompt_id, state.sample_index, state.turns)
    try:
        generation = await requests.generate(state, context, params, seed)
    except Exception as error:  # a backend fault ends this rollout unfinished, never the collection
        raise InfraFault(state.rollout_id, error) from error
    return cut_generation(generation, limit)


def cut_generation(generation: Generation, limit: int) -> Generation:
    if len(generation.token_ids) <= limit:
        return generation
    return Generation(generation.token_ids[:limit], generation.logprobs[:limit], LENGTH)


# ---------------------------------------------------------------------------------------------
# Recording a turn


@dataclass(frozen=True)
class _PendingCall:
    segment: Segment  # the assistant segment that made the call
    parsed: ToolCall  # code, or why it does not parse


def _record_generation(state: RolloutState, generation: Generation, setup: CollectionSetup) -> _PendingCall | None:
    """Append the assistant segment; return its call if it is to be executed."""
    config, chat = setup.config, setup.chat
    text = chat.decode(generation.token_ids)
    call_start = chat.call_start(generation.token_ids) if chat.tools else None  # no tool: one generation
    parsed = parse_tool_call(text, setup.tool_parameters) if call_start is not None else None
    segment = state.add(
        SegmentKind.ASSISTANT, generation.token_ids, text, step=state.step, attempt=state.attempt,
        logprobs=tuple(float(x) for x in generation.logprobs), call_start=call_start,
        tool_code=parsed.code if parsed is not None else None,
        tool_name=parsed.name if parsed is not None else None,
    )
    state.turns += 1
    state.steps += state.attempt == 0
    if parsed is None:
        state.finish_reason = FinishReason.MAX_TOKENS if generation.finish_reason == LENGTH else FinishReason.ANSWER
        return None
    if state.attempt == 0 and state.steps >= config.max_turns:
        state.finish_reason = FinishReason.MAX_TURNS  # the reference does not run the last step's call
        return None
    return _PendingCall(segment, parsed)


def _record_tool(state: RolloutState, call: _PendingCall, outcome: _Outcome, config: CollectConfig,
                 chat: ChatFormat) -> None:
    """Append the tool segment and move (step, attempt) on for the next generation."""
    step, attempt = call.segment.step, call.segment.attempt
    response = truncated(outcome.response, config.max_tool_response_chars)
    if outcome.status != ToolStatus.OK and attempt >= config.max_retries and attempt >= NOTE_MIN_RETRIES:
        response += RETRIES_EXHAUSTED_NOTE.format(retries=attempt)
    token_ids = chat.tool_response_ids(response)
    state.add(
        SegmentKind.TOOL, token_ids, chat.decode(token_ids), step=step, attempt=attempt, logprobs=None,
        tool_code=call.parsed.code, tool_status=outcome.status, error_type=outcome.error_type,
        exec_ms=outcome.exec_ms, tool_name=call.parsed.name,
    )
    if outcome.status != ToolStatus.OK and attempt < config.max_retries:
        if state.steps + 1 >= config.max_turns:  # as the reference: no room for the retry's turn
            state.finish_reason = FinishReason.MAX_TURNS
        state.step, state.attempt = step, attempt + 1  # a retry of the same step
    else:
        state.step, state.attempt = step + 1, 0


# ---------------------------------------------------------------------------------------------
# Tool execution


async def _execute(call: _PendingCall, state: RolloutState, setup: CollectionSetup, requests: Requests) -> _Outcome:
    """What the call produced: a format error without running it, the sandbox's outcome (the code
    interpreter) or the toolbox's (a user tool, whose own failures are failed calls; a tool that
    breaks the protocol raises ToolError, which stops the collection)."""
    if call.parsed.code is None:
        response = format_tool_response(False, "", call.parsed.error or "", ToolStatus.FORMAT_ERROR)
        return _Outcome(ToolStatus.FORMAT_ERROR, "FormatError", None, response)
    if call.parsed.name in setup.tool_parameters:  # the user's (one named code_interpreter replaces ours)
        extra = state.task.extra_info
        tools_kwargs = extra.get("tools_kwargs") if isinstance(extra, dict) else None  # verl's, per row
        context = CallContext(state.rollout_id, tools_kwargs or {})
        done = await requests.run_tool(call.parsed.name, call.parsed.arguments, context)
        if done.reward is not None:
            state.tool_rewards.append(done.reward)
        status = ToolStatus(done.status)
        response = done.text if done.verbatim else format_tool_text(
            status == ToolStatus.OK, done.text, None if status == ToolStatus.OK else status)
        return _Outcome(status, done.error_type, float(done.exec_ms), response)
    error: Exception | None = None
    for attempt in range(2):  # the sandbox retries its own faults; one more try for a raise
        try:
            return _from_result(await requests.run_code(call.parsed.code))
        except Exception as raised:  # an infrastructure fault, a row value for this call only
            error = raised
            logger.warning("sandbox failed on a call (try %d of 2): %r", attempt + 1, raised)
    reason = f"the sandbox failed ({type(error).__name__}); this is not an error in your code"
    response = format_tool_response(False, "", reason, ToolStatus.INFRA_ERROR)
    return _Outcome(ToolStatus.INFRA_ERROR, type(error).__name__, None, response)


def _from_result(result) -> _Outcome:
    """The sandbox reports what happened; the text the model sees is worded here.

    Every text of a trajectory that is not decoded from token ids enters through here or through
    the call parser, so this is where the tool's output is made valid text (`valid_text`): the code
    decides what it prints, and may forge the sandbox's result (an error type or message holding a
    lone surrogate), which neither the tokenizer nor the warehouse could store.
    """
    status = ToolStatus(result.status)  # the sandbox's statuses are a subset of the tool's
    exec_ms = None if result.exec_ms is None else float(result.exec_ms)
    response = format_tool_response(status == ToolStatus.OK, valid_text(result.stdout),
                                    valid_text(result.stderr), None if status == ToolStatus.OK else status)
    error_type = None if result.error_type is None else valid_text(result.error_type)
    return _Outcome(status, error_type, exec_ms, response)


# ---------------------------------------------------------------------------------------------
# Finishing a rollout


async def _finish(state: RolloutState, setup: CollectionSetup, requests: Requests, cache: ScoreCache) -> Rollout:
    config = setup.config
    assistants = [segment for segment in state.segments if segment.kind == SegmentKind.ASSISTANT]
    tools = [segment for segment in state.segments if segment.kind == SegmentKind.TOOL]
    reward, correct, answer, details = 0.0, False, None, None
    if assistants:
        if setup.rewards.reward_file is not None:
            result = await _reward_from_file(state, setup, requests, cache)
        else:
            result = await setup.rewards.grade(state.rollout_id, assistants[-1].text, state.task.graded_truth,
                                               state.task.data_source)
        reward, correct, answer, details = float(result.reward), bool(result.correct), result.answer, getattr(result, "details", None)
    return Rollout(
        rollout_id=state.rollout_id, iteration=state.iteration, group_id=state.group_id,
        prompt_id=state.task.prompt_id, sample_index=state.sample_index,
        policy_version=str(setup.policy_version), data_source=state.task.data_source,
        ground_truth=state.task.ground_truth, answer=answer, reward=reward, correct=correct,
        finish_reason=state.finish_reason, rollback_draw=state.draw,
        collect_view=CollectView.PURIFIED if state.view.purified else CollectView.RAW,
        collect_config_id=config.config_id, n_assistant_segments=len(assistants),
        n_tool_calls=len(tools), n_failed_calls=sum(segment.failed for segment in tools),
        reward_details=details,
    )


async def _reward_from_file(state: RolloutState, setup: CollectionSetup, requests: Requests, cache: ScoreCache):
    """The user's reward function on verl's arguments (grading/reward_file.py): the response as the
    rollout's view renders it, after the prompt, without special tokens (the IS gate that rendering
    needs may score first: InfraFault if the backend fails it)."""
    rendered = await _render_context(state, setup, requests, cache)
    solution = setup.chat.decode_response(rendered.token_ids[rendered.prompt_len:])
    turns = sum(segment.kind != SegmentKind.PROMPT for segment in state.segments) + 1
    return await setup.rewards.verl(state.rollout_id, state.task.data_source, solution, state.task.raw_truth,
                                    verl_extra_info(state.task.extra_info, turns, state.tool_scores,
                                                                    state.tool_rewards))
