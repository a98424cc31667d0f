"""The agent loop of `cleaner collect` (docs/architecture.md §5).

Every rollout of a batch advances in lock step: one `backend.generate` call per turn for all active
rollouts, then one `sandbox.run_many` call for all the tool calls of that turn. Each rollout's record
is a list of raw `Segment`s (prompt, assistant, tool, ...) in generation order; nothing is ever
dropped, so any (gamma, p) can be replayed later.

Design decisions:
- Context = `render(segments so far, view).token_ids`, the SAME renderer purify uses. With the IS
  gate (rollback_is_threshold > 0) the backend scores each new retry under the context without the
  error before the next turn, so purifying at the collect config renders the same contexts. With the
  purified collect view a retry sees merged(a_0..a_{i-1}) + t_{i-1}, as in the reference agent loop;
  with the raw view (or a rollout whose draw u >= p) it is the plain concatenation. `collect_view`
  on the Rollout records which one was actually applied.
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
  sample_index[, turn]), so a rollout does not depend on which batch it landed in: a resumed run
  (skip_rollout_ids) reproduces exactly the rollouts it had not yet written. u is a multiple of
  2^-24 so it survives the float32 warehouse column exactly.
- Response budget: measured on the CONTEXT the model sees (rendered length minus prompt length), as
  the reference measures its (rolled-back) response. One generate call per turn carries the largest
  per-rollout limit; a generation is then cut to its own limit (a prefix of a sample is a sample of
  the shorter request) and marked LENGTH. No generation runs past the model's context: prompts are
  checked against it first (context.py), and a limit never exceeds what the context has left.
- max_turns: as in the reference, a call opening the last allowed step is not executed; a retry
  is always executed (the reference regenerates it with its termination checks off).
- A LENGTH finish without a call ends the rollout (`max_tokens`); an unclosed call is a format error.
- Faults: a backend exception ends the affected rollouts with finish_reason `error` (reward 0); a
  sandbox exception is retried call by call, and a call that still raises gets `infra_error`.
- Model text never ends a collection: a call that cannot be read (any JSON, any depth, any size,
  code that is not valid text) is a `format_error` row, since `parse_tool_call` never raises. Text
  columns hold valid UTF-8: assistant text is decoded from token ids (a byte-level tokenizer writes
  invalid bytes as U+FFFD; the ids stay the record), and the two texts that are not, the parsed
  code and the sandbox's output, are checked (`chat.parse_tool_call`) or made valid (`_from_result`)
  where they enter the trajectory.
- Reward: `reward_fn(text of the last assistant segment, ground_truth, data_source)`.
No disk I/O here: the caller (warehouse writer) stores each yielded batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from cleaner.config import CollectConfig
from cleaner.engine.collect.context import fit_prompts
from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.model.base import LENGTH, Generation, SamplingParams
from cleaner.engine.model.chat import (
    ChatFormat,
    ToolCall,
    format_tool_response,
    parse_tool_call,
    valid_text,
)
from cleaner.engine.saar.gate import ScoreCache
from cleaner.engine.saar.walk import Rendered, View, render, view_for
from cleaner.records import (
    CollectView,
    FinishReason,
    Rollout,
    Segment,
    SegmentKind,
    ToolStatus,
)

if TYPE_CHECKING:
    from cleaner.engine.collect.tasks import Task

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
# Per-rollout state (private, mutable while the batch runs)


@dataclass
class _State:
    task: Task
    iteration: int
    sample_index: int
    rollout_id: str
    group_id: str
    draw: float
    view: View
    segments: list[Segment] = field(default_factory=list)
    step: int = 0  # of the next generation
    attempt: int = 0  # of the next generation
    turns: int = 0  # generations so far (indexes the sampling seeds)
    steps: int = 0  # steps opened so far: generations at attempt 0 (bounded by max_turns)
    finish_reason: FinishReason | None = None

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


def _plan(tasks: Sequence[Task], config: CollectConfig, chat: ChatFormat, skip_rollout_ids: frozenset[str],
          rollout_prefix: str, context_length: int | None, strict_context: bool) -> list[_State]:
    prompts = [chat.prompt_ids(task.messages) for task in tasks]  # the same for every sample of a group
    prompts = fit_prompts(tasks, prompts, config, context_length, strict=strict_context)
    states = []
    for task, prompt_ids in zip(tasks, prompts, strict=True):
        for sample_index in range(config.group_size):
            rollout_id, group_id = rollout_key(config.iteration, task.prompt_id, sample_index)
            rollout_id, group_id = rollout_prefix + rollout_id, rollout_prefix + group_id
            if rollout_id in skip_rollout_ids:
                continue
            draw = rollback_draw(config.seed, config.iteration, task.prompt_id, sample_index)
            view = view_for(draw, config.collect_view == CollectView.PURIFIED, config.gamma,
                            config.rollback_prob, config.similarity_on, config.rollback_is_threshold,
                            config.rollback_is_mode)
            state = _State(task, config.iteration, sample_index, rollout_id, group_id, draw, view)
            state.add(SegmentKind.PROMPT, prompt_ids, chat.decode(prompt_ids), step=None, attempt=None,
                      logprobs=None)
            states.append(state)
    return states


# ---------------------------------------------------------------------------------------------
# The collection


def collect(
    tasks: Sequence[Task],
    config: CollectConfig,
    backend,
    sandbox,
    chat: ChatFormat,
    *,
    reward_fn: Callable = compute_reward,
    skip_rollout_ids: frozenset[str] = frozenset(),
    on_context: Callable[[str, list[int]], None] | None = None,
    progress: bool = True,
    rollout_prefix: str = "",
    strict_context: bool = True,
) -> Iterator[CollectedBatch]:
    """Run config.group_size rollouts per task; yield batches of config.batch_rollouts complete ones.

    `rollout_prefix` is put before every rollout and group id (an evaluation's id keeps its rollouts
    apart from every other's); seeds do not depend on it. Before anything is generated, every prompt
    is checked against the backend's context length (`context.fit_prompts`): with `strict_context`
    (collect, run) a prompt that leaves less than the response budget is a ContextError (or is
    truncated, with `config.truncate_prompts`); without it (eval) that is a warning, and
    generations stop at the context's end.
    """
    states = _plan(tasks, config, chat, skip_rollout_ids, rollout_prefix, backend.context_length, strict_context)
    logger.info("collecting %d rollouts (%d skipped as already stored)", len(states),
                len(tasks) * config.group_size - len(states))
    with tqdm(total=len(states), desc="collect", unit="rollout", disable=not progress) as bar:
        for start in range(0, len(states), config.batch_rollouts):
            batch = states[start:start + config.batch_rollouts]
            _run_batch(batch, config, backend, sandbox, chat, on_context)
            rollouts = [_finish(state, config, backend, reward_fn) for state in batch]
            segments = [segment for state in batch for segment in state.segments]
            bar.update(len(batch))
            yield CollectedBatch(rollouts, segments)


def _run_batch(states: list[_State], config: CollectConfig, backend, sandbox, chat: ChatFormat,
               on_context: Callable[[str, list[int]], None] | None) -> None:
    active, cache, context_length = list(states), ScoreCache(), backend.context_length
    while active:
        renderings = _render_contexts(active, backend, chat, cache)
        if renderings is None:
            for state in active:
                state.finish_reason = FinishReason.ERROR
            return
        contexts, limits = [], []
        for state, rendered in zip(active, renderings, strict=True):
            remaining = config.max_response_tokens - (len(rendered.token_ids) - rendered.prompt_len)
            if context_length is not None:  # binds only where the budget exceeds it (eval)
                remaining = min(remaining, context_length - len(rendered.token_ids))
            if remaining <= 0:
                state.finish_reason = FinishReason.MAX_TOKENS
                continue
            contexts.append(list(rendered.token_ids))
            limits.append(min(config.max_new_tokens, remaining))
        active = [state for state in active if state.finish_reason is None]
        if not active:
            return
        if on_context is not None:
            for state, context in zip(active, contexts, strict=True):
                on_context(state.rollout_id, context)
        generations = _generate(active, contexts, limits, config, backend, chat)
        if generations is None:
            for state in active:
                state.finish_reason = FinishReason.ERROR
            return
        calls = [_record_generation(s, g, config, chat) for s, g in zip(active, generations, strict=True)]
        pending = [(state, call) for state, call in zip(active, calls, strict=True) if call is not None]
        outcomes = _execute([call for _, call in pending], sandbox)
        for (state, call), outcome in zip(pending, outcomes, strict=True):
            _record_tool(state, call, outcome, config, chat)
        active = [state for state in active if state.finish_reason is None]


def _render_contexts(states: list[_State], backend, chat: ChatFormat, cache: ScoreCache) -> list[Rendered] | None:
    """Each rollout's context. An IS-gated view needs the old policy's log-probs of a retry under the
    context without the error: the backend scores every pending request of the turn in one call
    and the contexts are rendered again. None if the backend failed."""
    while True:
        renderings = [render(state.segments, state.view, chat.decode, oracle=cache) for state in states]
        if not any(rendered.provisional for rendered in renderings):
            return renderings
        try:
            cache.fill(backend.score)
        except Exception:  # a model fault ends these rollouts, never the whole collection
            logger.exception("backend failed scoring the IS gate of %d rollouts; they end with 'error'",
                             len(states))
            return None


def _generate(states: list[_State], contexts: list[list[int]], limits: list[int],
              config: CollectConfig, backend, chat: ChatFormat) -> list[Generation] | None:
    """One generate call for the turn; None if the backend failed."""
    params = SamplingParams(max_new_tokens=max(limits), stop_token_ids=tuple(chat.stop_token_ids),
                            temperature=config.temperature, top_p=config.top_p)
    seeds = [turn_seed(config.seed, config.iteration, s.task.prompt_id, s.sample_index, s.turns)
             for s in states]
    try:
        generations = list(backend.generate(contexts, params, seeds))
        if len(generations) != len(contexts):
            raise RuntimeError(f"backend returned {len(generations)} generations for {len(contexts)} prompts")
    except Exception:  # a model fault ends these rollouts, never the whole collection
        logger.exception("backend failed on a turn of %d rollouts; they end with 'error'", len(states))
        return None
    return [_cut(generation, limit) for generation, limit in zip(generations, limits, strict=True)]


def _cut(generation: Generation, limit: int) -> Generation:
    if len(generation.token_ids) <= limit:
        return generation
    return Generation(generation.token_ids[:limit], generation.logprobs[:limit], LENGTH)


# ---------------------------------------------------------------------------------------------
# Recording a turn


@dataclass(frozen=True)
class _Call:
    segment: Segment  # the assistant segment that made the call
    parsed: ToolCall  # code, or why it does not parse


def _record_generation(state: _State, generation: Generation, config: CollectConfig,
                       chat: ChatFormat) -> _Call | None:
    """Append the assistant segment; return its call if it is to be executed."""
    text = chat.decode(generation.token_ids)
    call_start = chat.call_start(generation.token_ids)
    parsed = parse_tool_call(text) if call_start is not None else None
    segment = state.add(
        SegmentKind.ASSISTANT, generation.token_ids, text, step=state.step, attempt=state.attempt,
        logprobs=tuple(float(x) for x in generation.logprobs), call_start=call_start,
        tool_code=parsed.code if parsed is not None else None,
    )
    state.turns += 1
    state.steps += state.attempt == 0
    if parsed is None:
        state.finish_reason = FinishReason.MAX_TOKENS if generation.finish_reason == LENGTH else FinishReason.ANSWER
        return None
    if state.attempt == 0 and state.steps >= config.max_turns:
        state.finish_reason = FinishReason.MAX_TURNS  # the reference does not run the last step's call
        return None
    return _Call(segment, parsed)


def _record_tool(state: _State, call: _Call, outcome: _Outcome, config: CollectConfig,
                 chat: ChatFormat) -> None:
    """Append the tool segment and move (step, attempt) on for the next generation."""
    step, attempt = call.segment.step, call.segment.attempt
    response = outcome.response
    if outcome.status != ToolStatus.OK and attempt >= config.max_retries and attempt >= NOTE_MIN_RETRIES:
        response += RETRIES_EXHAUSTED_NOTE.format(retries=attempt)
    token_ids = chat.tool_response_ids(response)
    state.add(
        SegmentKind.TOOL, token_ids, chat.decode(token_ids), step=step, attempt=attempt, logprobs=None,
        tool_code=call.parsed.code, tool_status=outcome.status, error_type=outcome.error_type,
        exec_ms=outcome.exec_ms,
    )
    if outcome.status != ToolStatus.OK and attempt < config.max_retries:
        if state.steps + 1 >= config.max_turns:  # as the reference: no room for the retry's turn
            state.finish_reason = FinishReason.MAX_TURNS
        state.step, state.attempt = step, attempt + 1  # a retry of the same step
    else:
        state.step, state.attempt = step + 1, 0


# ---------------------------------------------------------------------------------------------
# Tool execution


def _execute(calls: list[_Call], sandbox) -> list[_Outcome]:
    """Outcomes aligned with calls: one run_many for every well-formed call of the turn."""
    outcomes: list[_Outcome | None] = [None] * len(calls)
    runnable = []
    for index, call in enumerate(calls):
        if call.parsed.code is None:
            response = format_tool_response(False, "", call.parsed.error or "", ToolStatus.FORMAT_ERROR)
            outcomes[index] = _Outcome(ToolStatus.FORMAT_ERROR, "FormatError", None, response)
        else:
            runnable.append(index)
    results = _run_codes([calls[index].parsed.code for index in runnable], sandbox)
    for index, outcome in zip(runnable, results, strict=True):
        outcomes[index] = outcome
    return [outcome for outcome in outcomes if outcome is not None]


def _run_codes(codes: list[str], sandbox) -> list[_Outcome]:
    if not codes:
        return []
    try:
        results = list(sandbox.run_many(codes))
        if len(results) != len(codes):
            raise RuntimeError(f"sandbox returned {len(results)} results for {len(codes)} codes")
        return [_from_result(result) for result in results]
    except Exception:  # find the call at fault: run them one by one
        logger.exception("sandbox failed on a batch of %d calls; retrying them one by one", len(codes))
    return [_run_one(code, sandbox) for code in codes]


def _run_one(code: str, sandbox) -> _Outcome:
    try:
        (result,) = sandbox.run_many([code])
        return _from_result(result)
    except Exception as error:  # an infrastructure fault, a row value for this call only
        logger.warning("sandbox failed on one call: %r", error)
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


def _finish(state: _State, config: CollectConfig, backend, reward_fn: Callable) -> Rollout:
    assistants = [segment for segment in state.segments if segment.kind == SegmentKind.ASSISTANT]
    tools = [segment for segment in state.segments if segment.kind == SegmentKind.TOOL]
    reward, correct, answer = 0.0, False, None
    if state.finish_reason != FinishReason.ERROR and assistants:
        result = reward_fn(assistants[-1].text, state.task.ground_truth, state.task.data_source)
        reward, correct, answer = float(result.reward), bool(result.correct), result.answer
    return Rollout(
        rollout_id=state.rollout_id, iteration=state.iteration, group_id=state.group_id,
        prompt_id=state.task.prompt_id, sample_index=state.sample_index,
        policy_version=str(backend.policy_version), data_source=state.task.data_source,
        ground_truth=state.task.ground_truth, answer=answer, reward=reward, correct=correct,
        finish_reason=state.finish_reason or FinishReason.ERROR, rollback_draw=state.draw,
        collect_view=CollectView.PURIFIED if state.view.purified else CollectView.RAW,
        collect_config_id=config.config_id, n_assistant_segments=len(assistants),
        n_tool_calls=len(tools), n_failed_calls=sum(segment.failed for segment in tools),
    )
