"""The sandbox's interface (docs/architecture.md §8): what the local pool (pool.py) and the docker
backend (docker_backend.py) both are, and the error either raises when it cannot work at all.

Its own module so that the two backends import it, not each other: pool.py's `make_sandbox` picks
the docker backend, which needs the interface.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.outcome import ExecResult


class SandboxError(RuntimeError):
    """The sandbox itself cannot work (a worker does not start)."""


class Sandbox:
    """Runs Python snippets; a context manager. Subclasses implement `run` and `close`.

    `run` is thread-safe; `run_async` awaits it on one of `config.workers` threads, so an event loop
    (the agent loop's) hands each call to the pool the moment it has one and the pool's workers are
    the only limit on how many run at once."""

    config: SandboxConfig
    _executor: ThreadPoolExecutor | None = None
    _executor_lock = threading.Lock()

    def run(self, code: str, stdin: str | None = None) -> ExecResult:
        raise NotImplementedError

    async def run_async(self, code: str, stdin: str | None = None) -> ExecResult:
        """`run`, awaited."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self.config.workers, thread_name_prefix="sandbox")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.run, code, stdin)

    def shutdown_executor(self) -> None:
        """Cancel `run_async`'s waiting calls; its threads end with the calls they run (subclasses'
        `close` calls it first, so a close never waits on them)."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

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
