"""Prompts and the response budget against the model's context (docs/architecture.md §5).

A model attends over a fixed number of positions (its config's `max_position_embeddings`,
`Backend.context_length`). A rollout's context is its prompt plus at most `max_response_tokens`
(the budget is measured on what the model sees), so the agent loop checks every prompt before it
generates anything:
- collect and run (`strict`): a prompt longer than `context - max_response_tokens` is an error
  naming the dataset file, the row and the prompt id; with `truncate_prompts` it keeps its LAST
  tokens instead, as verl's `truncation='left'` (the setting verl recipes use when they truncate):
  the end of the problem, its answer format and the generation prompt `<|im_start|>assistant`
  survive, the system prompt and the start of the problem go. A warning counts the prompts cut.
- eval: the budget is the reference's (20,480 tokens) whatever the model, so a budget the context
  cannot give is a warning, not an error, and generations stop at the context's end (the loop
  never asks for a token past it). A prompt that fills the whole context is still an error.
A backend that does not know its context length (None) is not checked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cleaner.config import CollectConfig
from cleaner.engine.collect.tasks import Task
from cleaner.errors import CleanerError

logger = logging.getLogger(__name__)


class ContextError(CleanerError):
    """A prompt, or the response budget, that the model's context cannot hold."""


def fit_prompts(tasks: Sequence[Task], prompts: Sequence[list[int]], config: CollectConfig,
                context_length: int | None, *, strict: bool = True) -> list[list[int]]:
    """Each task's prompt token ids as the model will see them (`prompts[i]` is `tasks[i]`'s)."""
    if context_length is None or not prompts:
        return list(prompts)
    if not strict:
        return _check_lenient(tasks, prompts, config, context_length)
    room = context_length - config.max_response_tokens  # the longest prompt that fits
    if room < 1:
        raise ContextError(
            f"max_response_tokens {config.max_response_tokens:,} leaves no room for a prompt in model "
            f"{config.model}'s context of {context_length:,} tokens; lower --max-response-tokens")
    over = [index for index, prompt in enumerate(prompts) if len(prompt) > room]
    if not over:
        return list(prompts)
    first = over[0]
    if not config.truncate_prompts:
        raise ContextError(
            f"{_where(tasks[first], config)}: the prompt is {len(prompts[first]):,} tokens; with "
            f"max_response_tokens {config.max_response_tokens:,} it needs "
            f"{len(prompts[first]) + config.max_response_tokens:,} positions, but model {config.model} has "
            f"{context_length:,} ({len(over)} of {len(prompts)} prompts do not fit): shorten them, lower "
            f"--max-response-tokens, or pass --truncate-prompts to keep each prompt's last {room:,} tokens")
    logger.warning("--truncate-prompts: %d of %d prompts kept only their last %d tokens (the longest had "
                   "%d), so that each fits model %s's context of %d tokens with the response budget of %d",
                   len(over), len(prompts), room, max(len(prompts[i]) for i in over), config.model,
                   context_length, config.max_response_tokens)
    return [prompt[-room:] if len(prompt) > room else list(prompt) for prompt in prompts]


def _check_lenient(tasks: Sequence[Task], prompts: Sequence[list[int]], config: CollectConfig,
                   context_length: int) -> list[list[int]]:
    full = [index for index, prompt in enumerate(prompts) if len(prompt) >= context_length]
    if full:
        first = full[0]
        raise ContextError(
            f"{_where(tasks[first], config)}: the prompt is {len(prompts[first]):,} tokens, and model "
            f"{config.model} has {context_length:,} positions: no room to generate "
            f"({len(full)} of {len(prompts)} prompts)")
    short = [prompt for prompt in prompts if len(prompt) + config.max_response_tokens > context_length]
    if short:
        logger.warning("the response budget of %d tokens exceeds what model %s's context of %d tokens leaves "
                       "after %d of %d prompts (the longest is %d tokens): their generations stop at the "
                       "context's end", config.max_response_tokens, config.model, context_length,
                       len(short), len(prompts), max(len(prompt) for prompt in short))
    return list(prompts)


def _where(task: Task, config: CollectConfig) -> str:
    """The dataset row a task came from, as an error names it."""
    if task.source_row is None or config.data is None:
        return f"prompt {task.prompt_id}"
    return f"{config.data}: row {task.source_row} (prompt {task.prompt_id})"
