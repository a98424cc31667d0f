"""The policy whose chat template an export renders with, and the tools its prompts showed
(docs/architecture.md §15).

Design decisions:
- An iteration's rows are checked against the tokenizer of the policy that collected it (the
  collect config's `model`), or of `--policy` when given (a checkpoint moved, or a warehouse
  without its configs). Only the tokenizer is loaded, never the weights.
- The tools are those the collection's template showed: none for the no-tool baseline, else the
  code interpreter first and the user's tools after it (their schemas, from their files, as
  `cleaner collect` loads them).
- A policy without a tokenizer, or whose tokenizer has no chat template, is refused: nothing could
  say what the conversations look like to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cleaner.engine.export.conversation import Template
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.loading import load_tokenizer_if_present
from cleaner.errors import JobError
from cleaner.tools import load_tools
from cleaner.tools.responses import TOOL_NAME, TOOL_SCHEMA


@dataclass(frozen=True)
class Policy:
    """What an iteration's rows are rendered with."""

    path: str
    template: Template
    chat: ChatFormat  # decodes spliced token ids, as the collection did
    tools: tuple[dict, ...]


def policy_for(path: str | Path | None, collect_config_json: str | None, iteration: int,
               cache: dict) -> Policy:
    """The policy of `iteration`: `path` if given, else its collect config's model."""
    config = json.loads(collect_config_json) if collect_config_json else {}
    model = path if path is not None else config.get("model")
    if model is None:
        raise JobError(f"iteration {iteration} has no saved collect config naming its policy; "
                       "pass --policy DIR (a model directory with its tokenizer)")
    tools = _tools(config)
    key = (str(model), json.dumps(tools, sort_keys=True))
    if key not in cache:
        cache[key] = _load(str(model), tools)
    return cache[key]


def _tools(config: dict) -> tuple[dict, ...]:
    if not config.get("multi_turn", True):
        return ()
    if not (config.get("tools") or config.get("tool")):
        return (TOOL_SCHEMA,)
    loaded = {tool.name: tool for tool in load_tools(config.get("tools"), config.get("tool"))}
    interpreter = loaded[TOOL_NAME].schema if TOOL_NAME in loaded else TOOL_SCHEMA
    return (interpreter, *(tool.schema for name, tool in loaded.items() if name != TOOL_NAME))


def _load(model: str, tools: tuple[dict, ...]) -> Policy:
    tokenizer = load_tokenizer_if_present(model)
    if tokenizer is None:
        raise JobError(f"policy {model}: no tokenizer there; pass --policy DIR with the collecting "
                       "policy's tokenizer and chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise JobError(f"policy {model}: its tokenizer has no chat template, so no conversation can be "
                       "checked against it; pass --policy DIR with the collecting policy's template")
    try:
        chat = ChatFormat(tokenizer, tools)
    except ValueError as error:  # the chat format's special tokens are not single tokens there
        raise JobError(f"policy {model}: {error}") from error
    return Policy(model, Template(tokenizer, tools), chat, tools)
