"""The Python tool's sandbox (docs/architecture.md §8): runs model-written code, confined.

A leaf tool: nothing here imports the rest of cleaner (the engine, the loop, the CLI); they import it.

- config.py         SandboxConfig (nested in CollectConfig as `sandbox`)
- outcome.py        ExecStatus, ExecResult: what an execution did (no model-facing wording)
- base.py           Sandbox (the interface both backends are), SandboxError
- pool.py           LocalSandbox (warm worker pool), make_sandbox, WorkerInfo
- protocol.py       length-prefixed JSON framing between pool, workers and children
- worker.py         the warm worker process (`python -P -m cleaner.sandbox.worker`)
- child.py          one execution: fork, confine, supervise and clean up a child
- isolation.py      uids, namespaces, killing and reaping, libc calls
- usercode.py       what runs the user's code; standard library only (shipped into docker too)
- docker_backend.py one container per execution (unverified where no Docker engine runs)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cleaner.sandbox.base import Sandbox, SandboxError
    from cleaner.sandbox.config import SandboxConfig
    from cleaner.sandbox.outcome import ExecResult, ExecStatus
    from cleaner.sandbox.pool import LocalSandbox, WorkerInfo, make_sandbox

# The public API, resolved on first use (PEP 562): a warm worker imports `cleaner.sandbox.worker`,
# which runs this file first, and must not load the pool's threading and subprocess machinery,
# because every execution forks the worker and a smaller worker forks faster.
_EXPORTS = {
    "SandboxConfig": "cleaner.sandbox.config", "ExecResult": "cleaner.sandbox.outcome",
    "ExecStatus": "cleaner.sandbox.outcome", "LocalSandbox": "cleaner.sandbox.pool",
    "Sandbox": "cleaner.sandbox.base", "SandboxError": "cleaner.sandbox.base",
    "WorkerInfo": "cleaner.sandbox.pool", "make_sandbox": "cleaner.sandbox.pool",
}
__all__ = ["ExecResult", "ExecStatus", "LocalSandbox", "Sandbox", "SandboxConfig", "SandboxError",
           "WorkerInfo", "make_sandbox"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cleaner.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
