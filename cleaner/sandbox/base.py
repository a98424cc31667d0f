"""The sandbox's interface (docs/architecture.md §8): what the local pool (pool.py) and the docker
backend (docker_backend.py) both are, and the error either raises when it cannot work at all.

Its own module so that the two backends import it, not each other: pool.py's `make_sandbox` picks
the docker backend, which needs the interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.outcome import ExecResult


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (a worker does not start)."""


class Sandbox:
    """Runs Python snippets; a context manager. Subclasses implement `run` and `close`."""

    config: SandboxConfig

    def run(self, code: str, stdin: str | None = None) -> ExecResult:
        raise NotImplementedError

    def run_many(self, codes: Sequence[str]) -> list[ExecResult]:
        """Run every snippet, concurrently across the pool; results in input order."""
        with ThreadPoolExecutor(max_workers=self.config.workers) as executor:
            return list(executor.map(self.run, codes))

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
