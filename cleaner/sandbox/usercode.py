"""What runs inside a sandboxed execution: run the code jupyter-style and classify its failure.

Standard library only and free of package-relative imports, on purpose: the local backend calls
`execute_user_code` in a child forked from a warm worker, and the docker backend ships this file's
source text into a bare `python:3.11-slim` container and runs it with `python -c` (`docker_main`).
A third entry point, `python -m cleaner.sandbox.usercode --batch` (`batch_main`), runs a list of
TRUSTED snippets one after another in one process, with no isolation at all: the bootstrap corpus
uses it so that its tool texts are worded by this very code, not by a copy of it.

Design decisions (matching the reference's code_interpreter):
- If the last statement is a bare expression, its value's repr is printed (unless it is None), as
  a notebook cell would.
- A failure is one line of text, `"{ErrorType} at line {n}: {message}\\n  {offending line}"` when the
  failing line of the user's code is known (the innermost traceback frame in the user's code), else
  `"{ErrorType}: {message}"`. No full traceback: it would point into the sandbox's own frames.
- `SystemExit` with code 0 or None counts as success (a script that calls `sys.exit()` finished).
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import io
import json
import os
import sys

USER_FILENAME = "<code>"  # the filename user code is compiled under; frames with it are the user's
RESULT_MARKER = "\x00CLEANER-RESULT\x00"  # docker backend: result JSON follows on stderr's last line
MAX_ERROR_CHARS = 4096  # an error message, or the quoted line, longer than this is cut


# ---------------------------------------------------------------------------------------------
# Error text


def _user_line(error: BaseException) -> int | None:
    """Line number of the innermost traceback frame that belongs to the user's code."""
    if isinstance(error, SyntaxError) and error.filename == USER_FILENAME:
        return error.lineno
    line = None
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == USER_FILENAME:
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return line


def format_error(error: BaseException, code: str) -> str:
    """`"{ErrorType} at line {n}: {message}\\n  {line}"`, or `"{ErrorType}: {message}"`."""
    name = type(error).__name__
    message = _cut(error.msg if isinstance(error, SyntaxError) else str(error))
    line_number = _user_line(error)
    lines = code.splitlines()
    if line_number is None or not 1 <= line_number <= len(lines):
        return f"{name}: {message}"
    return f"{name} at line {line_number}: {message}\n  {_cut(lines[line_number - 1].strip())}"


def _cut(text: str) -> str:
    """At most MAX_ERROR_CHARS of `text`, with the streams' truncation marker: the quoted line of a
    one-line program of 100,000 brackets must not make the error text 100,000 characters long."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    return f"{text[:MAX_ERROR_CHARS]}...[truncated {len(text) - MAX_ERROR_CHARS} chars]"


# ---------------------------------------------------------------------------------------------
# Execution


def _split_last_expression(code: str) -> tuple[ast.Module, ast.Expression | None]:
    """The module without a trailing bare expression, and that expression (or None)."""
    tree = ast.parse(code, filename=USER_FILENAME, mode="exec")
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop()
        return tree, ast.Expression(body=last.value)
    return tree, None


def execute_user_code(code: str) -> tuple[str | None, str | None]:
    """Run `code` in a fresh `__main__` namespace. Returns (error_type, error_text); (None, None) if ok."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        module, last_expression = _split_last_expression(code)
        exec(compile(module, USER_FILENAME, "exec"), namespace)
        if last_expression is not None:
            value = eval(compile(last_expression, USER_FILENAME, "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as exit_request:
        if exit_request.code in (None, 0):
            return None, None
        return "SystemExit", format_error(exit_request, code)
    except BaseException as error:  # noqa: BLE001 - every user failure is a row value, classified
        return type(error).__name__, format_error(error, code)
    return None, None


def flush_standard_streams() -> None:
    """Flush stdout/stderr; the user may have closed or replaced them."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


# ---------------------------------------------------------------------------------------------
# Docker entry point: `python -c <this file> ` with the code base64-encoded in CLEANER_CODE


def docker_main() -> None:
    code = base64.b64decode(os.environ.pop("CLEANER_CODE", "")).decode("utf-8")
    error_type, error_text = execute_user_code(code)
    flush_standard_streams()
    payload = json.dumps({"error_type": error_type, "error_text": error_text})
    os.write(2, f"\n{RESULT_MARKER}{payload}\n".encode())
    os._exit(0)


# ---------------------------------------------------------------------------------------------
# Batch entry point: `python -m cleaner.sandbox.usercode --batch`, for trusted code only


def run_batch(codes: list[str]) -> list[list[str | None]]:
    """[stdout, error_type, error_text] per snippet, each run in fresh globals with its stdout
    captured; error_type and error_text are None when the snippet succeeded."""
    results = []
    for code in codes:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            error_type, error_text = execute_user_code(code)
        results.append([stdout.getvalue(), error_type, error_text])
    return results


def batch_main() -> None:
    """Read a JSON list of code strings on stdin; write the JSON list of `run_batch` results."""
    codes = json.load(sys.stdin)
    json.dump(run_batch(codes), sys.stdout)


if __name__ == "__main__":
    if "CLEANER_CODE" in os.environ:
        docker_main()
    elif sys.argv[1:] == ["--batch"]:
        batch_main()
