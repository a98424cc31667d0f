"""Docker backend of the sandbox: one throw-away container per execution. UNVERIFIED.

What the test suite checks without a Docker engine: the in-container runner
(`usercode.docker_main`, run with a plain `python -c`) and the parsing of its output
(`parse_docker_output`). The container calls themselves are written against the docker SDK
(`docker>=7`, the `docker` extra) and are only exercised where an engine runs.

Design decisions:
- The runner is `usercode.py`'s own source text, run with `python -c`, so the container needs
  nothing but a stock `python:3.11-slim` image; the code travels base64-encoded in an environment
  variable (fine for tool calls, which are a few KB; the kernel caps one variable at 128 KB).
- Limits: network disabled, read-only root filesystem, a tmpfs working directory, memory and pids
  limits, all capabilities dropped, no-new-privileges, an unprivileged user (nobody), and a
  wall-clock timeout after which the container is killed. Removed after every execution.
- The runner reports its result as the last stderr line after `RESULT_MARKER`.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path

from cleaner.sandbox import usercode
from cleaner.sandbox.base import Sandbox, SandboxError
from cleaner.sandbox.child import OutputCapture, truncate_text
from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.outcome import ExecResult, ExecStatus, infra_error_result

logger = logging.getLogger(__name__)

WORKDIR = "/sandbox"  # tmpfs inside the container


def parse_docker_output(stdout: bytes, stderr: bytes, timed_out: bool, config: SandboxConfig,
                        exec_ms: float) -> ExecResult:
    """Build the ExecResult from a container's streams (the result rides on stderr's last line)."""
    error_text = stderr.decode("utf-8", errors="replace")
    marker_at = error_text.rfind(usercode.RESULT_MARKER)
    outcome = None
    if marker_at >= 0:
        outcome = json.loads(error_text[marker_at + len(usercode.RESULT_MARKER):])
        error_text = error_text[:marker_at].removesuffix("\n")
    stdout_capture = OutputCapture(len(stdout))
    stderr_capture = OutputCapture(len(error_text.encode()))
    stdout_capture.add(stdout)
    stderr_capture.add(error_text.encode())
    stdout_text = truncate_text(stdout_capture, config.max_output_chars)
    stderr_text = truncate_text(stderr_capture, config.max_output_chars)
    if timed_out:
        message = f"Timeout: execution exceeded the {config.timeout_s:g} s time limit"
        return ExecResult(ExecStatus.TIMEOUT, "Timeout", stdout_text, _join(stderr_text, message), exec_ms)
    if outcome is None:
        message = "SystemExit: the process ended before reporting a result"
        return ExecResult(ExecStatus.ERROR, "SystemExit", stdout_text, _join(stderr_text, message), exec_ms)
    if outcome["error_type"] is None:
        return ExecResult(ExecStatus.OK, None, stdout_text, stderr_text, exec_ms)
    return ExecResult(ExecStatus.ERROR, outcome["error_type"], stdout_text,
                      _join(stderr_text, outcome["error_text"]), exec_ms)


def _join(stderr: str, message: str) -> str:
    return f"{stderr.rstrip(chr(10))}\n{message}" if stderr.strip() else message


class DockerSandbox(Sandbox):
    """One container per execution through the docker SDK (imported lazily). Unverified."""

    def __init__(self, config: SandboxConfig) -> None:
        try:
            import docker  # the optional docker SDK (the `docker` extra): only this backend needs it
        except ImportError as error:
            raise SandboxError("the docker backend needs the docker SDK: pip install 'cleaner[docker]'") from error
        self.config = config
        try:
            self._client = docker.from_env()
            self._client.ping()
        except docker.errors.DockerException as error:
            raise SandboxError(f"no Docker engine reachable: {error}") from error
        self._runner_source = Path(usercode.__file__).read_text()

    def run(self, code: str, stdin: str | None = None) -> ExecResult:
        import docker  # the optional docker SDK, present once __init__ succeeded

        if stdin is not None:
            logger.warning("the docker backend does not pass stdin; the code reads /dev/null")
        failure = ""
        for attempt in range(self.config.infra_retries + 1):
            try:
                return self._run_once(code)
            except docker.errors.DockerException as error:
                logger.warning("docker execution failed (attempt %d): %s", attempt + 1, error)
                failure = str(error)
        return infra_error_result(f"docker sandbox failed {self.config.infra_retries + 1} times: {failure}")

    def _run_once(self, code: str) -> ExecResult:
        import requests  # comes with the docker SDK, whose read timeout it raises

        mb = 1024 * 1024
        container = self._client.containers.run(
            self.config.docker_image, ["python", "-c", self._runner_source],
            environment={"CLEANER_CODE": base64.b64encode(code.encode()).decode()},
            detach=True, network_disabled=True, read_only=True, user="nobody",
            working_dir=WORKDIR, tmpfs={WORKDIR: f"size={4 * self.config.max_file_size_mb}m,mode=1777"},
            mem_limit=self.config.memory_mb * mb, memswap_limit=self.config.memory_mb * mb,
            pids_limit=self.config.max_processes, cap_drop=["ALL"], security_opt=["no-new-privileges"],
            ulimits=[{"Name": "fsize", "Soft": self.config.max_file_size_mb * mb,
                      "Hard": self.config.max_file_size_mb * mb},
                     {"Name": "nofile", "Soft": self.config.max_open_files,
                      "Hard": self.config.max_open_files}],
        )
        start = time.monotonic()
        timed_out = False
        try:
            try:
                container.wait(timeout=self.config.timeout_s)
            except requests.exceptions.ConnectionError:  # the SDK's read timeout
                timed_out = True
                container.kill()
            exec_ms = (time.monotonic() - start) * 1000.0
            stdout = container.logs(stdout=True, stderr=False)
            stderr = container.logs(stdout=False, stderr=True)
        finally:
            container.remove(force=True)
        return parse_docker_output(stdout, stderr, timed_out, self.config, exec_ms)

    def close(self) -> None:
        self.shutdown_executor()
        self._client.close()
