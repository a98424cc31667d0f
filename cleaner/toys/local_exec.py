"""Run trusted snippets in one child Python process and word the results like the sandbox.

The corpus's default executor (our own generated code, never model output: one process for a whole
corpus instead of a sandboxed fork per snippet) and the calibration bench's fallback. It is NOT a
sandbox: no limits beyond a wall-clock timeout on the whole batch. The child is the sandbox's own
user-code runner (`python -m cleaner.sandbox.usercode --batch`), so a snippet's stdout, error class
and error text come from the same `execute_user_code` / `format_error` as in the sandbox, and the
response is worded by `tools.responses.format_tool_response` as the collect loop words the sandbox's results
(docs/architecture.md §8): `Tool call success\\nstdout: 42\\n` and
`Tool call failure\\nreason: error\\nstderr: NameError at line 1: name 'x' is not defined\\n  x`.
Unlike the sandbox, stdout is not truncated and the snippets' own stderr is not part of the result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.tools.responses import format_tool_response

# -P: a module in the caller's working directory must not shadow the runner or the standard library.
RUNNER_COMMAND = [sys.executable, "-P", "-m", "cleaner.sandbox.usercode", "--batch"]


@dataclass(frozen=True)
class LocalResult:
    ok: bool
    response: str  # the tool's answer text, worded like the sandbox
    error_type: str | None  # exception name, None on success


def run_snippets(codes: Sequence[str], timeout_s: float = 60.0) -> list[LocalResult]:
    """Run each snippet in fresh globals inside one child process (trusted code only)."""
    completed = subprocess.run(
        RUNNER_COMMAND, input=json.dumps(list(codes)),
        capture_output=True, text=True, timeout=timeout_s, check=True,
    )
    results = []
    for stdout, error_type, error_text in json.loads(completed.stdout):
        ok = error_type is None
        response = format_tool_response(ok, stdout, error_text or "", None if ok else "error")
        results.append(LocalResult(ok, response, error_type))
    return results
