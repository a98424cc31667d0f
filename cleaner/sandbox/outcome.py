"""What one execution produced: a status, the error class, the captured streams and the wall time.

Design decisions:
- The sandbox reports what happened and nothing more. The text the model sees is worded by its
  caller (the collect loop, with `tools.responses.format_tool_response`), so the sandbox knows nothing of the
  chat format and a change of wording never touches the sandbox.
- `ExecStatus` is a `StrEnum`: its members compare equal to, and serialize as, the plain strings
  ("ok", "error", ...) that the warehouse stores in its `tool_status` column.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ExecStatus(StrEnum):
    OK = "ok"  # the code ran to its end (or called sys.exit with 0 / None)
    ERROR = "error"  # the code raised, exited non-zero or was killed by a signal
    TIMEOUT = "timeout"  # wall clock or CPU time ran out
    INFRA_ERROR = "infra_error"  # the sandbox itself failed; never the code's fault


@dataclass(frozen=True)
class ExecResult:
    status: ExecStatus
    error_type: str | None  # exception class name ("NameError"), "Timeout"; None when ok
    stdout: str  # truncated to max_output_chars with a "...[truncated N chars]" marker
    stderr: str  # the user's stderr, then the error text
    exec_ms: float  # wall time of the execution, request sent to result received


def infra_error_result(message: str) -> ExecResult:
    """The result of an execution the sandbox could not carry out, `message` saying why."""
    return ExecResult(ExecStatus.INFRA_ERROR, "InfraError", "", message, 0.0)
