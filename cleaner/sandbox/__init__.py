"""The Python tool's sandbox (docs/architecture.md §8): runs model-written code, confined.

A leaf tool: nothing here imports the engine, the jobs, the CLI or the runner; they import it.

- config.py         SandboxConfig (nested in CollectConfig as `sandbox`)
- outcome.py        ExecStatus, ExecResult: what an execution did (no model-facing wording)
- pool.py           Sandbox, LocalSandbox (warm worker pool), make_sandbox, WorkerInfo, SandboxError
- protocol.py       length-prefixed JSON framing between pool, workers and children
- worker.py         the warm worker process (`python -P -m cleaner.sandbox.worker`)
- child.py          one execution: fork, confine, supervise and clean up a child
- isolation.py      uids, namespaces, killing and reaping, libc calls
- usercode.py       what runs the user's code; standard library only (shipped into docker too)
- docker_backend.py one container per execution (unverified where no Docker engine runs)
"""

from cleaner.sandbox.config import SandboxConfig
from cleaner.sandbox.outcome import ExecResult, ExecStatus
from cleaner.sandbox.pool import LocalSandbox, Sandbox, SandboxError, WorkerInfo, make_sandbox

__all__ = ["ExecResult", "ExecStatus", "LocalSandbox", "Sandbox", "SandboxConfig", "SandboxError",
           "WorkerInfo", "make_sandbox"]
