"""The code interpreter, the one tool every collection has, and what any tool's answer becomes as
the text the model reads (docs/architecture.md §5).

The code interpreter's code runs in the sandbox (cleaner/sandbox); its name and schema are what the
chat template shows first, and its answers are worded as the reference's: `Tool call success`, or
`Tool call failure` and a reason, then the output. A user's tool (toolbox.py) is worded the same
way, so SAAR and the model see one shape of answer whatever the tool.

Design decisions:
- Tools live below the engine: the chat format (engine/model/chat.py) imports the interpreter's
  name and schema from here, never the other way round.
- `truncated` is verl's `max_tool_response_length` with its default side, middle: a longer answer
  keeps its first and last halves around `...(truncated)...`, character for character as verl's
  tool agent loop writes it, so a recipe moved from verl shows the model what verl showed it. A
  failure is told from the whole answer, before it is cut, as verl does.
"""

from __future__ import annotations

TOOL_NAME = "code_interpreter"

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

TRUNCATED = "...(truncated)..."  # verl's marker for a response cut in the middle


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


def format_tool_text(success: bool, text: str, reason: str | None = None) -> str:
    """A user tool's answer, worded as the code interpreter's: `Tool call success` then the text,
    or `Tool call failure`, `reason: <reason>`, then the text."""
    parts = ["Tool call success"] if success else ["Tool call failure", f"reason: {reason or 'error'}"]
    return "\n".join([*parts, text] if text else parts)


def truncated(response: str, limit: int | None) -> str:
    """`response` cut as verl cuts a tool response longer than `limit` characters (its middle
    side): the first and last `limit // 2` characters around `...(truncated)...`; None: whole."""
    if limit is None or len(response) <= limit:
        return response
    half = limit // 2
    return response[:half] + TRUNCATED + response[-half:]


def valid_text(text: str) -> str:
    """`text` with each lone surrogate written as its escape (`\\udcff`), as Python writes one to
    a `backslashreplace` stream such as the sandbox's stdout: a tokenizer and a Parquet string
    column take only valid Unicode. Other characters, control characters included, are kept."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
