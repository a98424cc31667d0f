"""The chat and tool-call format, as token ids.

Matches the Qwen/Hermes convention used by the reference (Open-CLEANER's tool agent loop):
- the prompt is the tokenizer's chat template over the messages with the `code_interpreter` tool
  and the generation prompt (`<|im_start|>assistant\\n`);
- an assistant generation ends at `</tool_call>` (a call) or `<|im_end|>` (a final answer);
- a tool call is `<tool_call>\\n{"name": "code_interpreter", "arguments": {"code": "..."}}\\n</tool_call>`;
- the tool response segment closes the assistant turn and opens the next one:
  `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n`.
  Its tokens carry loss_mask 0, so the policy is never trained on them.

Broken JSON inside a call is repaired with `json_repair`, as the reference does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import json_repair

TOOL_NAME = "code_interpreter"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run Python code and return its printed output. Use print() to see values.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class ToolCall:
    code: str | None  # the code argument; None if the call could not be parsed
    error: str | None  # why it could not be parsed (shown to the model as a format error)


def format_call(code: str) -> str:
    """The text of a well-formed call (used by the synthetic corpus and by tests)."""
    payload = json.dumps({"name": TOOL_NAME, "arguments": {"code": code}}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def format_tool_response(success: bool, stdout: str, stderr: str, reason: str | None = None) -> str:
    """The tool's answer, as the reference's code_interpreter words it.

    Success: `Tool call success`, then `stdout: ...` / `stderr: ...` for the non-empty streams.
    Failure: `Tool call failure`, `reason: <reason>`, then the non-empty streams.
    """
    parts = ["Tool call success"] if success else ["Tool call failure", f"reason: {reason or 'error'}"]
    if stdout:
        parts.append(f"stdout: {stdout}")
    if stderr:
        parts.append(f"stderr: {stderr}")
    return "\n".join(parts)


def tool_response_text(response: str) -> str:
    """The text of a tool segment answering a call with `response`."""
    return (
        f"{IM_END}\n{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{response}\n{TOOL_RESPONSE_CLOSE}"
        f"{IM_END}\n{IM_START}assistant\n"
    )


def parse_tool_call(text: str) -> ToolCall | None:
    """Parse the first call in an assistant segment's text; None if it contains no call."""
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return None
    body = text[start + len(TOOL_CALL_OPEN):]
    end = body.find(TOOL_CALL_CLOSE)
    if end < 0:
        return ToolCall(None, f"the call is not closed with {TOOL_CALL_CLOSE}")
    body = body[:end].strip()
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        payload = json_repair.loads(body)
    if not isinstance(payload, dict):
        return ToolCall(None, "the call is not a JSON object")
    if payload.get("name") != TOOL_NAME:
        return ToolCall(None, f"unknown tool {payload.get('name')!r}; the only tool is {TOOL_NAME}")
    arguments = payload.get("arguments")
    if isinstance(arguments, str):  # some models double-encode the arguments
        arguments = json_repair.loads(arguments)
    if not isinstance(arguments, dict) or not isinstance(arguments.get("code"), str):
        return ToolCall(None, 'the call needs "arguments": {"code": "..."}')
    return ToolCall(arguments["code"], None)


class ChatFormat:
    """Token-level view of the format for one tokenizer (any PreTrainedTokenizer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
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

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Chat template over the messages, with the tool schema and the generation prompt."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=True
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
