"""CLEANER: collect tool-using rollouts, purify them with SAAR, train with GRPO/DAPO, over a Parquet
warehouse (docs/architecture.md §1).

The names a library user needs, from the modules that define them:

    from cleaner import CollectConfig, CollectRequest, Warehouse, collect_job

    warehouse = Warehouse("warehouse")
    outcome = collect_job(warehouse, CollectRequest(CollectConfig(n_prompts=4)))

Every job has the shape `<stage>_job(warehouse, request, *, handles)`: the request says what to
compute, the keyword-only handles pass what the caller already holds (a loaded backend or model).

Every name resolves on first use (PEP 562), so `import cleaner` loads neither torch nor the
warehouse's libraries, and `__version__` reads the installed distribution's metadata then too: the
sandbox's warm workers import this package before they fork, and a smaller worker forks faster.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cleaner.config import (
        DEFAULT_POLICY,
        CollectConfig,
        CurateConfig,
        EvalConfig,
        PurifyConfig,
        RunConfig,
        SandboxConfig,
        Shard,
        TrainConfig,
    )
    from cleaner.engine.collect.job import CollectRequest, collect_job
    from cleaner.engine.curate.job import curate_job
    from cleaner.engine.eval.job import eval_job
    from cleaner.engine.export.job import ExportRequest, export_job
    from cleaner.engine.model import load_backend
    from cleaner.engine.model.base import Backend
    from cleaner.engine.purify.job import PurifyRequest, purify_job
    from cleaner.engine.train.job import TrainRequest, train_job
    from cleaner.errors import CleanerError, JobError
    from cleaner.loop.iterations import run_loop
    from cleaner.records import (
        EvalRunRow,
        IterationRow,
        PurifiedRow,
        PurifyConfigRow,
        Rollout,
        Segment,
        TrainStepRow,
    )
    from cleaner.report.job import report_job
    from cleaner.warehouse import Warehouse, WarehouseError

__all__ = [
    "__version__",
    # configs (cleaner.config)
    "CollectConfig", "PurifyConfig", "TrainConfig", "EvalConfig", "RunConfig", "Shard", "SandboxConfig",
    "CurateConfig", "DEFAULT_POLICY",
    # records (cleaner.records)
    "Segment", "Rollout", "PurifiedRow", "PurifyConfigRow", "IterationRow", "TrainStepRow", "EvalRunRow",
    # the warehouse, the model, the jobs and the loop
    "Warehouse", "WarehouseError", "load_backend", "Backend",
    "collect_job", "purify_job", "train_job", "eval_job", "report_job", "export_job", "curate_job", "run_loop",
    "CollectRequest", "PurifyRequest", "TrainRequest", "ExportRequest",
    "CleanerError", "JobError",
]
_MODULES = {  # the module that defines each name of __all__ but __version__
    "cleaner.config": ("CollectConfig", "PurifyConfig", "TrainConfig", "EvalConfig", "RunConfig", "Shard",
                       "SandboxConfig", "CurateConfig", "DEFAULT_POLICY"),
    "cleaner.records": ("Segment", "Rollout", "PurifiedRow", "PurifyConfigRow", "IterationRow", "TrainStepRow",
                        "EvalRunRow"),
    "cleaner.warehouse": ("Warehouse", "WarehouseError"),
    "cleaner.engine.model": ("load_backend",),
    "cleaner.engine.model.base": ("Backend",),
    "cleaner.engine.collect.job": ("collect_job", "CollectRequest"),
    "cleaner.engine.purify.job": ("purify_job", "PurifyRequest"),
    "cleaner.engine.train.job": ("train_job", "TrainRequest"),
    "cleaner.engine.eval.job": ("eval_job",),
    "cleaner.engine.export.job": ("export_job", "ExportRequest"),
    "cleaner.engine.curate.job": ("curate_job",),
    "cleaner.report.job": ("report_job",),
    "cleaner.loop.iterations": ("run_loop",),
    "cleaner.errors": ("CleanerError", "JobError"),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> object:
    if name == "__version__":
        value: object = _version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'cleaner' has no attribute {name!r}")
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _version() -> str:
    """The installed distribution's version; in a source checkout that was never installed, the
    version pyproject.toml beside the package declares ("0+unknown" without one)."""
    from importlib import metadata  # on first use: it imports email, zipfile, csv (start-up time)

    try:
        return metadata.version("cleaner")
    except metadata.PackageNotFoundError:
        return _source_version(Path(__file__).resolve().parents[1] / "pyproject.toml")


def _source_version(pyproject: Path) -> str:
    import tomllib  # on first use, with the metadata above (start-up time)

    try:
        return tomllib.loads(pyproject.read_text())["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"
