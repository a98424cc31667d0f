"""The chat and tool-call format, as token ids.

Matches the Qwen/Hermes convention used by the reference (Open-CLEANER's tool agent loop):
- the prompt is the tokenizer's chat template over the messages with the tools (the built-in
  `code_interpreter` first, then the user's: cleaner/tools) and the generation prompt
  (`<|im_start|>assistant\\n`);
- an assistant generation ends at `</tool_call>` (a call) or `<|im_end|>` (a final answer);
- a tool call is `<tool_call>\\n{"name": "code_interpreter", "arguments": {"code": "..."}}\\n</tool_call>`,
  or a user tool's name and arguments, which must match its JSON schema (jsonschema);
- the tool response segment closes the assistant turn and opens the next one:
  `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`.
  Its tokens carry loss_mask 0, so the policy is never trained on them.

Broken JSON inside a call is repaired with `json_repair`, as the reference does.

Model text never raises here (docs/architecture.md §5): a call that cannot be read is a
`ToolCall` with the reason, which the agent loop records as a `format_error` row and shows the
model. A call `json` reads is taken whatever its size. Otherwise it is repaired, within a bound: a
small model early in RL writes thousands of unclosed brackets, and `json_repair` (pure Python)
takes time that grows with the text's length times its bracket depth (tens of seconds for a run
of 100,000 `{`), so a call is repaired only if that product is at most MAX_REPAIR_WORK. Brackets
are counted inside strings too: the repair may decide that a string never ended and parse what
follows it. Code that is not valid Unicode text (an escaped lone surrogate such as `"\\udcff"`)
is a format error as well: neither Python, a tokenizer nor a Parquet column can hold it.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import json_repair

from cleaner.tools.responses import TOOL_NAME, TOOL_SCHEMA, valid_text

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Characters x bracket depth of the largest call repaired: 50,000 characters at a call's depth of 2.
MAX_REPAIR_WORK = 100_000

_PREVIEW = reprlib.Repr()  # a value quoted in a format error: shallow and short
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother = 2, 80, 80


@dataclass(frozen=True)
class ToolCall:
    code: str | None  # the code argument (another tool's: its arguments as JSON); None if the call could not be parsed
    error: str | None  # why it could not be parsed (shown to the model as a format error)
    name: str | None = None  # the tool the call names, when it names one (an unknown name too)
    arguments: dict | None = None  # the parsed arguments of a call that can be run


def format_call(code: str) -> str:
    """The text of a well-formed call (used by the synthetic corpus and by tests)."""
    return format_tool_call(TOOL_NAME, {"code": code})


def format_tool_call(name: str, arguments: Mapping) -> str:
    """The text of a well-formed call of any tool."""
    payload = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def tool_response_text(response: str) -> str:
    """The text of a tool segment answering a call with `response`."""
    return (
        f"{IM_END}\n{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{response}\n{TOOL_RESPONSE_CLOSE}"
        f"{IM_END}\n{IM_START}assistant\n"
    )


def parse_tool_call(text: str, tools: Mapping[str, Mapping] | None = None) -> ToolCall | None:
    """Parse the first call in an assistant segment's text; None if it contains no call.

    `tools` maps each user tool's name to the JSON schema of its arguments (cleaner/tools/); the
    code interpreter is always there, built in unless a user tool takes its name. Never raises: whatever the text, a call that cannot be read,
    names no known tool or has arguments its tool's schema refuses is a ToolCall with its reason.
    """
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return None
    body = text[start + len(TOOL_CALL_OPEN):]
    end = body.find(TOOL_CALL_CLOSE)
    if end < 0:
        return ToolCall(None, f"the call is not closed with {TOOL_CALL_CLOSE}")
    payload, error = _load_json(body[:end].strip(), "the call")
    if error is not None:
        return ToolCall(None, error)
    if not isinstance(payload, dict):
        return ToolCall(None, "the call is not a JSON object")
    tools = tools or {}
    name = payload.get("name")
    known = isinstance(name, str) and (name == TOOL_NAME or name in tools)
    named = valid_text(name) if isinstance(name, str) else None
    if not known:
        names = list(dict.fromkeys([TOOL_NAME, *tools]))
        choices = f"the tools are {', '.join(names)}" if len(names) > 1 else f"the only tool is {TOOL_NAME}"
        return ToolCall(None, f"unknown tool {_preview(name)}; {choices}", named)
    arguments = payload.get("arguments")
    if isinstance(arguments, str):  # some models double-encode the arguments
        arguments, error = _load_json(arguments, "the arguments string")
        if error is not None:
            return ToolCall(None, error, name)
    if name in tools:
        return _user_call(name, arguments, tools[name])
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return ToolCall(None, 'the call needs "arguments": {"code": "..."}', name)
    code = arguments["code"]
    error = _text_error(code)
    return ToolCall(None, error, name) if error is not None else ToolCall(code, None, name, {"code": code})


def _user_call(name: str, arguments: object, schema: Mapping) -> ToolCall:
    """A call of a user tool: arguments that are an object its schema accepts, as valid text."""
    import jsonschema  # on first use: only a user tool's call is checked against a schema

    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCall(None, f'the call needs "arguments" as a JSON object, got {_preview(arguments)}', name)
    text = json.dumps(arguments, sort_keys=True, ensure_ascii=False)
    error = _text_error(text)
    if error is not None:
        return ToolCall(None, error.replace("the code", "the arguments"), name)
    problem = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(arguments))
    if problem is not None:
        where = "".join(f"[{part!r}]" for part in problem.absolute_path)
        return ToolCall(None, f"the arguments do not fit {name}'s parameters: {_preview(problem.message)}"
                              + (f" (at arguments{where})" if where else ""), name)
    return ToolCall(text, None, name, arguments)


def _load_json(text: str, what: str) -> tuple[object, str | None]:
    """(value, None), or (None, why `what` cannot be read): strict JSON first, then a bounded repair."""
    try:
        return json.loads(text), None
    except (ValueError, RecursionError):  # JSONDecodeError, a number of too many digits, deep nesting
        pass
    depth = bracket_depth(text)
    if len(text) * max(depth, 1) > MAX_REPAIR_WORK:
        return None, (f"{what} is not valid JSON, and too big to repair ({len(text):,} characters, "
                      f"brackets nested {depth:,} deep)")
    try:
        return json_repair.loads(text), None
    except Exception as error:  # noqa: BLE001 - whatever the repair raises on model text is a format error
        return None, f"{what} is not valid JSON ({type(error).__name__})"


def bracket_depth(text: str) -> int:
    """The most brackets (`[`, `{`, `(`) open at once, strings or not."""
    depth = deepest = 0
    for char in text:
        if char in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]})" and depth:
            depth -= 1
    return deepest


def _text_error(code: str) -> str | None:
    """Why `code` is not valid Unicode text (a lone surrogate from an escape), or None."""
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as error:
        return (f"the code is not valid text: character {error.start} is the lone surrogate "
                f"{code[error.start]!r}, which UTF-8 cannot encode")
    return None


def _preview(value: object) -> str:
    """`value` quoted for a message to the model: escaped, cut, and shallow (`reprlib`), so that
    neither a long string nor a deep list is quoted whole."""
    return _PREVIEW.repr(value)


class ChatFormat:
    """Token-level view of the format for one tokenizer (any PreTrainedTokenizer)."""

    def __init__(self, tokenizer, tools: Sequence[dict] = (TOOL_SCHEMA,)) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)  # the schemas the template shows (the code interpreter's first)
        self.tool_call_close_id = self._single_token(TOOL_CALL_CLOSE)
        self.im_end_id = self._single_token(IM_END)
        self.stop_token_ids = (self.tool_call_close_id, self.im_end_id)

    def _single_token(self, text: str) -> int:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"tokenizer must have {text!r} as one special token, got ids {ids}")
        return ids[0]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def decode_response(self, token_ids: Sequence[int]) -> str:
        """Text as verl's reward managers decode a response: without the special tokens."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Chat template over the messages, with the tool schema and the generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def tool_response_ids(self, response: str) -> list[int]:
        return self.encode(tool_response_text(response))

    def call_start(self, token_ids: Sequence[int]) -> int | None:
        """Index of the first token whose decoded prefix contains `<tool_call>`; None if none."""
        text = self.decode(token_ids)
        if TOOL_CALL_OPEN not in text:
            return None
        lo, hi = 0, len(token_ids) - 1  # binary search: containment is monotone in the prefix
        while lo < hi:
            mid = (lo + hi) // 2
            if TOOL_CALL_OPEN in self.decode(token_ids[: mid + 1]):
                hi = mid
            else:
                lo = mid + 1
        return lo
