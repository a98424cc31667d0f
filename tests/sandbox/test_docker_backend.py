"""Docker backend: the in-container runner and output parsing run everywhere (with a plain
`python -c`, exactly as the container would run it); the container tests skip without an engine."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cleaner.sandbox import ExecResult, SandboxConfig, make_sandbox, usercode
from cleaner.sandbox.docker_backend import parse_docker_output

CONFIG = SandboxConfig(backend="docker", timeout_s=2.0, max_output_chars=64)


def run_runner_like_docker(code: str) -> ExecResult:
    source = Path(usercode.__file__).read_text()
    environment = {"CLEANER_CODE": base64.b64encode(code.encode()).decode(), "PATH": os.environ["PATH"]}
    completed = subprocess.run([sys.executable, "-c", source], env=environment, capture_output=True,
                               timeout=30)
    return parse_docker_output(completed.stdout, completed.stderr, False, CONFIG, 1.0)



def test_runner_success_with_last_expression():
    result = run_runner_like_docker("x = 20\nx + 22")
    assert (result.status, result.error_type, result.stdout, result.stderr) == ("ok", None, "42\n", "")


def test_runner_error_is_classified_after_user_stderr():
    result = run_runner_like_docker("import sys\nprint('warn', file=sys.stderr)\nundefined")
    assert (result.status, result.error_type) == ("error", "NameError")
    assert result.stderr == "warn\nNameError at line 3: name 'undefined' is not defined\n  undefined"


def test_parse_timeout_and_truncation():
    result = parse_docker_output(b"z" * 100, b"", True, CONFIG, 2000.0)
    assert (result.status, result.error_type) == ("timeout", "Timeout")
    assert result.stdout == "z" * 64 + "...[truncated 36 chars]"


def test_docker_container_round_trip():
    docker = pytest.importorskip("docker")
    try:
        docker.from_env().ping()
    except docker.errors.DockerException:
        pytest.skip("no Docker engine running")

    with make_sandbox(CONFIG) as sandbox:
        assert sandbox.run("print(6 * 7)").stdout == "42\n"
        assert sandbox.run("while True: pass").status == "timeout"
