"""Run trusted snippets in one child Python process and word the results like the sandbox.

Used by the corpus (our own generated code, never model output) when `collect.sandbox` cannot be
imported, and by the calibration bench as a fallback. It is NOT a sandbox: no limits beyond a
wall-clock timeout on the whole batch. The wording matches the sandbox (docs/architecture.md §8):
`Tool call success\\nstdout: 42\\n` and
`Tool call failure\\nreason: error\\nstderr: NameError at line 1: name 'x' is not defined\\n  x`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from cleaner.engine.chat import format_tool_response

# The child reads a JSON list of code strings on stdin and writes a JSON list of results.
_RUNNER = r'''
import contextlib, io, json, sys, traceback
def run(code):
    out = io.StringIO()
    try:
        compiled = compile(code, "<tool>", "exec")
        with contextlib.redirect_stdout(out):
            exec(compiled, {"__name__": "__main__"})
    except SyntaxError as e:
        line = (e.text or "").strip()
        return [False, out.getvalue(), f"{type(e).__name__} at line {e.lineno}: {e.msg}\n  {line}", type(e).__name__]
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "<tool>"]
        lineno = frames[-1].lineno if frames else 1
        lines = code.splitlines()
        line = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        return [False, out.getvalue(), f"{type(e).__name__} at line {lineno}: {e}\n  {line}", type(e).__name__]
    return [True, out.getvalue(), "", None]
json.dump([run(code) for code in json.load(sys.stdin)], sys.stdout)
'''


@dataclass(frozen=True)
class LocalResult:
    ok: bool
    response: str  # the tool's answer text, worded like the sandbox
    error_type: str | None  # exception name, None on success


def run_snippets(codes: Sequence[str], timeout_s: float = 60.0) -> list[LocalResult]:
    """Run each snippet in fresh globals inside one child process (trusted code only)."""
    completed = subprocess.run(
        [sys.executable, "-c", _RUNNER], input=json.dumps(list(codes)),
        capture_output=True, text=True, timeout=timeout_s, check=True,
    )
    results = []
    for ok, stdout, stderr, error_type in json.loads(completed.stdout):
        response = format_tool_response(ok, stdout, stderr, None if ok else "error")
        results.append(LocalResult(ok, response, error_type))
    return results
