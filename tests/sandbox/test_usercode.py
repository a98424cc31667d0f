"""The user-code runner's batch entry point (`python -m cleaner.sandbox.usercode --batch`, used by
the bootstrap corpus) words outcomes exactly as the sandbox does: same stdout, error class and
error text, because both call the same `execute_user_code` / `format_error`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cleaner.sandbox import LocalSandbox, SandboxConfig

CODES = {
    "name_error": "a = 1\nprint(a)\nprint(b)",
    "syntax_error": "x = 1\nif x >\n    print(x)",
    "nested_function": "def outer(x):\n    def inner(y):\n        return 1 / y\n    return inner(x)\n\nprint('go')\nouter(0)",
    "ok_with_last_expression": "x = 20\nx + 22",
}


def run_batch(codes: list[str]) -> list[list]:
    completed = subprocess.run([sys.executable, "-P", "-m", "cleaner.sandbox.usercode", "--batch"],
                               input=json.dumps(codes), capture_output=True, text=True, timeout=60,
                               check=True)
    return json.loads(completed.stdout)


@pytest.fixture(scope="module")
def sandbox_results():
    with LocalSandbox(SandboxConfig(workers=1, preload_scientific=False)) as sandbox:
        return {name: sandbox.run(code) for name, code in CODES.items()}


@pytest.mark.parametrize("name", sorted(CODES))
def test_batch_matches_the_sandbox(name, sandbox_results):
    (stdout, error_type, error_text), = run_batch([CODES[name]])
    real = sandbox_results[name]
    assert (stdout, error_type, error_text or "") == (real.stdout, real.error_type, real.stderr)


def test_batch_texts_are_the_sandbox_format():
    name_error, syntax_error, nested, ok = run_batch([CODES[name] for name in CODES])
    assert name_error == ["1\n", "NameError", "NameError at line 3: name 'b' is not defined\n  print(b)"]
    assert syntax_error == ["", "SyntaxError", "SyntaxError at line 2: invalid syntax\n  if x >"]
    assert nested == ["go\n", "ZeroDivisionError", "ZeroDivisionError at line 3: division by zero\n  return 1 / y"]
    assert ok == ["42\n", None, None]


def test_each_snippet_runs_in_fresh_globals():
    first, second = run_batch(["leaked = 1", "print('leaked' in globals())"])
    assert (first, second) == (["", None, None], ["False\n", None, None])


def test_a_long_error_message_and_line_are_cut_with_the_marker():
    (_, error_type, error_text), = run_batch(["(" * 100_000])
    quoted = "(" * 4096 + f"...[truncated {100_000 - 4096} chars]"
    assert (error_type, error_text) == ("SyntaxError", f"SyntaxError at line 1: too many nested parentheses\n  {quoted}")
    (_, error_type, error_text), = run_batch(["raise ValueError('m' * 5000)"])
    assert error_text == ("ValueError at line 1: " + "m" * 4096 + f"...[truncated {5000 - 4096} chars]"
                          "\n  raise ValueError('m' * 5000)")
