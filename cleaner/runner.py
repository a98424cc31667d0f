"""`cleaner run`: collect -> purify -> train, iteration after iteration, in one process.

The policy is loaded once; purify scores with the same in-memory model that collected, and the
trainer updates that model in place before saving its checkpoint, so no phase reloads weights.
One optimiser lives for the whole run: each iteration's training continues the previous one's
AdamW and lr schedule, and every checkpoint carries that state (cleaner.engine.train.optim).
Every phase is idempotent (see `cleaner.jobs`), so `resume` after a crash, even a SIGKILL, redoes
only the unfinished part of the unfinished iteration, and continues from the saved optimiser. An iteration is complete once its
`iterations` row is written; its trained policy is `<run_dir>/checkpoints/iteration-<i+1>`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cleaner.engine.backends import load_backend
from cleaner.engine.config import RunConfig
from cleaner.engine.models import check_device, check_model_path
from cleaner.engine.records import IterationRow
from cleaner.jobs import JobError, collect_job, purify_job, train_job
from cleaner.warehouse import Warehouse

if TYPE_CHECKING:
    from cleaner.engine.backends import Backend
    from cleaner.engine.premise import PremiseStats
    from cleaner.engine.train.optim import Optimization
    from cleaner.engine.train.trainer import TrainResult

logger = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    """Where the policy trained on `iteration` goes (the policy of iteration + 1)."""
    return run_dir / "checkpoints" / f"iteration-{iteration + 1}"


def _ensure_backend(backend, policy: str, device: str):
    if backend is not None and str(getattr(backend, "model_path", "")) == str(policy):
        return backend
    return load_backend("torch", policy, device=device)


def run_loop(config: RunConfig, *, resume: bool = False, progress: bool = True,
             on_iteration: Callable[[IterationRow], None] | None = None) -> list[IterationRow]:
    """Run `config.iterations` iterations; returns the iteration rows of the whole run."""
    check_device(config.collect.device)  # a bad device or model fails before anything is written
    check_model_path(config.collect.model)
    run_dir = Path(config.run_dir)
    warehouse = Warehouse(run_dir / "warehouse")
    exists = warehouse.root.exists()
    done = {row.iteration: row for row in warehouse.read_iterations()} if exists else {}
    if exists and not resume and (done or warehouse.iterations_collected()):
        raise JobError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    warehouse.root.mkdir(parents=True, exist_ok=True)
    warehouse.save_config("run", config.to_json())
    policy, backend, optimization = config.collect.model, None, None
    for iteration in range(config.iterations):
        if iteration in done:
            policy = done[iteration].policy_out or policy
            continue
        backend = _ensure_backend(backend, policy, config.collect.device)
        row, trained = _one_iteration(config, warehouse, iteration, policy, backend, optimization, progress)
        if trained is not None:  # the in-memory model and optimiser now equal the saved checkpoint
            backend.adopt(row.policy_out)
            optimization = trained.optimization
        else:  # trained before a crash: the next iteration loads the checkpoint and its optimiser
            backend, optimization = None, None
        policy = row.policy_out
        if on_iteration is not None:
            on_iteration(row)
    return warehouse.read_iterations()


def _premise_columns(premise: PremiseStats | None) -> dict[str, float]:
    """The iterations row's premise columns (clean_rollouts, clean_accuracy, ...)."""
    if premise is None:
        return {}
    return {f"{name}_{field}": getattr(getattr(premise, name), key)
            for name in ("clean", "recovered", "unrecovered")
            for field, key in (("rollouts", "rollouts"), ("accuracy", "accuracy"), ("advantage", "mean_advantage"))}


def _one_iteration(config: RunConfig, warehouse: Warehouse, iteration: int, policy: str, backend: Backend,
                   optimization: Optimization | None, progress: bool) -> tuple[IterationRow, TrainResult | None]:
    """One iteration; returns its row and the training result if the in-memory model was trained
    here (None if a previous process had already trained and saved it)."""
    collect_config = dataclasses.replace(config.collect, iteration=iteration, model=str(policy))
    collected = collect_job(warehouse, collect_config, resume=True, backend=backend, progress=progress)
    purified = purify_job(warehouse, iteration, [config.purify], backend=backend,
                          device=config.collect.device, progress=progress)
    (result,) = purified.results
    out = checkpoint_dir(Path(config.run_dir), iteration)
    trained, train_s = None, 0.0
    if not (warehouse.has_train_steps(iteration) and out.exists()):
        outcome = train_job(warehouse, iteration, config.purify.config_id, policy, out, config.train,
                            model=backend.model, rows=result.rows, optimization=optimization,
                            progress=progress)
        trained, train_s = outcome.result, outcome.seconds
    summary = collected.summary
    row = IterationRow(
        iteration=iteration, policy_in=str(policy), policy_out=str(out),
        collect_config_json=collect_config.to_json(), purify_config_json=config.purify.to_json(),
        train_config_json=config.train.to_json(), collect_s=collected.seconds, purify_s=purified.seconds,
        train_s=train_s, accuracy=summary.accuracy, first_attempt_error_rate=summary.first_attempt_error_rate,
        failures_per_trajectory=summary.failed_calls_per_rollout,
        n_shallow=result.stats.n_shallow, n_deep=result.stats.n_deep, n_gated=result.stats.n_gated,
        **_premise_columns(result.stats.premise),
    )
    warehouse.write_iteration(row)
    return row, trained
