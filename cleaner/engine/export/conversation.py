"""A trajectory as chat messages, and the check that the policy's chat template gives its tokens back
(docs/architecture.md §15).

Design decisions:
- A trajectory is a prompt, then turns: an assistant turn (a generation, or SAAR's merge of
  several) and a tool turn (the chat format's tool response, `model/chat.py`). Messages are built
  from the turns' text, never re-tokenised: the stored token ids stay the record, and `exact`
  says whether the template renders the messages back to them.
- An assistant turn is `content` plus, when it made a call, `tool_calls` in the Hugging Face /
  TRL shape (`{"type": "function", "function": {"name", "arguments"}}`, arguments a JSON object).
  The template writes `<tool_call>` blocks and the end of the turn itself, so `content` is the
  text before the call (less the newline the template puts back) and an answer's `<|im_end|>` is
  dropped. A call that is not JSON (a format error) stays in `content` as written: the template
  renders it verbatim, and the tool message that follows carries the error the model saw.
- A tool turn is a `tool` message whose content is the response between `<tool_response>` tags.
- The prompt's messages (system, user) are not stored, only their rendering. They are recovered
  by inverting the template: it renders probe conversations of each shape (user; system + user;
  ...) with sentinels for the contents, the stored prompt text is matched against the literal
  text between them, and a candidate is kept only if no content holds `<|im_start|>` (a shorter
  shape would otherwise swallow a few-shot prompt whole: one user message holding the exchanges'
  markup, which the template renders back to the same text) and the template renders it back. A
  prompt that no shape gives back (cut by `--truncate-prompts`, or a template that rewrites its
  messages) becomes one user message holding the rendered prompt, and the row is not exact.
- Exact: the template's rendering of the messages (with the tools, no generation prompt),
  tokenised, equals the stored token ids, except that after a final `<|im_end|>` the template may
  add whitespace the model never generated (its turn separator). It fails where a generation does
  not round-trip through its text: a turn cut by the token budget (the template closes it), token
  ids that are not the tokenizer's own encoding of their text, text the template rewrites (Qwen3
  drops an empty `<think></think>` from earlier turns), a call whose JSON the template would
  spell differently (spacing, escapes), a prompt not recovered.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from cleaner.engine.model.chat import (
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    tool_response_text,
)

ASSISTANT, TOOL, USER, SYSTEM = "assistant", "tool", "user", "system"
# The prompt shapes tried, in order: a dataset row's messages are a user message, optionally after a
# system message, optionally after earlier user/assistant exchanges (few-shot prompts).
PROMPT_SHAPES = ((USER,), (SYSTEM, USER), (USER, ASSISTANT, USER), (SYSTEM, USER, ASSISTANT, USER))
_SENTINEL = "\x00cleaner-export-{}\x00"
_RESPONSE_HEAD, _RESPONSE_TAIL = tool_response_text("\x00").split("\x00")


@dataclass(frozen=True)
class Turn:
    """One turn after the prompt: a generation (or SAAR's merged turn), or a tool response."""

    assistant: bool
    text: str  # decoded with the special tokens


def assistant_message(text: str) -> dict:
    """The message of a generated turn: content, and its call as `tool_calls`."""
    body = text.removesuffix(IM_END)
    start = body.find(TOOL_CALL_OPEN)
    call = _call_of(body[start + len(TOOL_CALL_OPEN):-len(TOOL_CALL_CLOSE)]) \
        if start >= 0 and body.endswith(TOOL_CALL_CLOSE) else None
    if call is None:
        return {"role": ASSISTANT, "content": body}
    before = body[:start]
    return {"role": ASSISTANT, "content": before.removesuffix("\n"), "tool_calls": [call]}


def _call_of(inside: str) -> dict | None:
    """{"type": "function", "function": {name, arguments}} of the text between the call tags, or
    None if it is not a JSON object naming a tool, with an object of arguments."""
    try:  # read as the collection read it (model/chat.py's parse_tool_call), so the call is the one that ran
        payload = json.loads(inside)
        name, arguments = payload.get("name"), payload.get("arguments")
        if isinstance(arguments, str):  # some models double-encode the arguments
            arguments = json.loads(arguments)
    except (ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_message(text: str) -> dict:
    """The message of a tool turn: the response between the `<tool_response>` tags (a text not in
    the chat format's shape is kept whole, and the row will not be exact)."""
    fits = text.startswith(_RESPONSE_HEAD) and text.endswith(_RESPONSE_TAIL) \
        and len(text) >= len(_RESPONSE_HEAD) + len(_RESPONSE_TAIL)
    return {"role": TOOL, "content": text[len(_RESPONSE_HEAD):len(text) - len(_RESPONSE_TAIL)] if fits else text}


def turn_messages(turns: Sequence[Turn]) -> list[dict]:
    return [assistant_message(turn.text) if turn.assistant else tool_message(turn.text) for turn in turns]


# ---------------------------------------------------------------------------------------------
# The policy's template


class Template:
    """The policy's chat template over the collection's tools: prompts recovered, exactness checked."""

    def __init__(self, tokenizer, tools: Sequence[dict]) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        self._probes = [(shape, self._probe(shape)) for shape in PROMPT_SHAPES]
        self.prompt_messages = lru_cache(maxsize=1024)(self._prompt_messages)  # a group shares its prompt

    def render(self, messages: Sequence[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _probe(self, shape: tuple[str, ...]) -> list[str] | None:
        """The literal text around each message's content in a rendering of `shape`, or None if
        the template does not show each sentinel exactly once, in order."""
        sentinels = [_SENTINEL.format(index) for index in range(len(shape))]
        try:
            text = self.render([{"role": role, "content": s} for role, s in zip(shape, sentinels, strict=True)],
                               generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template may refuse a shape (a system message, say)
            return None
        pieces = []
        for sentinel in sentinels:
            if text.count(sentinel) != 1:
                return None
            piece, text = text.split(sentinel)
            pieces.append(piece)
        return [*pieces, text]

    def _prompt_messages(self, prompt_text: str) -> tuple[tuple[tuple[str, str], ...], bool]:
        """((role, content), ...) of the prompt, and whether the template gives it back exactly."""
        for shape, pieces in self._probes:
            if pieces is None:
                continue
            pattern = "".join(re.escape(piece) + "(.*?)" for piece in pieces[:-1]) + re.escape(pieces[-1])
            match = re.fullmatch(pattern, prompt_text, re.DOTALL)
            if match is None:
                continue
            if any(IM_START in content for content in match.groups()):  # a message opens inside a content
                continue
            messages = tuple(zip(shape, match.groups(), strict=True))
            if self.render(as_dicts(messages), generation_prompt=True) == prompt_text:
                return messages, True
        return ((USER, prompt_text),), False

    def exact(self, messages: Sequence[dict], token_ids: Sequence[int]) -> bool:
        """Whether the template's rendering of `messages`, tokenised, is `token_ids` (module docstring)."""
        awaiting = bool(messages) and messages[-1]["role"] == TOOL  # the tool's turn ends opening the next
        try:
            rendered = self.tokenizer.encode(self.render(messages, awaiting), add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a template that cannot render the conversation: not exact
            return False
        stored = list(token_ids)
        if rendered[:len(stored)] != stored:
            return False
        tail = rendered[len(stored):]
        return not tail or (bool(stored) and stored[-1] == self.im_end_id
                            and not self.tokenizer.decode(tail).strip())


def as_dicts(messages: Sequence[tuple[str, str]]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in messages]
