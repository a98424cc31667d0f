"""`cleaner run`: collect -> purify -> train, iteration after iteration, in one process.

One backend serves the policy for the whole run: collect samples from it, purify scores with its
scorer, and after training it adopts the new checkpoint. With the torch backend the trainer
updates the backend's own in-memory model in place before saving it, so no phase reloads weights.
Another backend (SGLang) serves from its own processes: the trainer then keeps a model of its own,
loaded once from the checkpoint and trained from iteration to iteration, and the backend reloads
each saved checkpoint from disk. One optimiser lives for the whole run: each iteration's training
continues the previous one's AdamW and lr schedule, and every checkpoint carries that state
(cleaner.engine.train.optim).
Every phase is idempotent (see `cleaner.jobs`), so `resume` after a crash, even a SIGKILL, redoes
only the unfinished part of the unfinished iteration, and continues from the saved optimiser. An iteration is complete once its
`iterations` row is written; its trained policy is `<run_dir>/checkpoints/iteration-<i+1>`.

A metrics logger (cleaner.engine.tracking) gets each iteration this process completes, once its
row is written: its optimiser steps as the warehouse holds them, then its row. Iterations a
previous process completed were logged by that process, so a resumed run logs no step twice.

One process at a time drives a run directory (an exclusive lock on `<run_dir>/.run.lock`, which
the kernel releases if the process dies): a second `cleaner run` on it, resumed or not, fails at
once instead of collecting the same iteration twice.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cleaner.engine.backends import load_backend, require_backend
from cleaner.engine.backends.torch_backend import TorchBackend
from cleaner.engine.config import RunConfig
from cleaner.engine.models import check_device, check_model_path
from cleaner.engine.records import IterationRow
from cleaner.engine.tracking import MetricsLogger, NullLogger
from cleaner.engine.train.deepspeed_config import check_deepspeed_setup
from cleaner.jobs import JobError, collect_job, purify_job, train_job
from cleaner.warehouse import Warehouse
from cleaner.warehouse.lock import exclusive

if TYPE_CHECKING:
    import torch

    from cleaner.engine.backends import Backend
    from cleaner.engine.premise import PremiseStats
    from cleaner.engine.train.optim import Optimization
    from cleaner.engine.train.trainer import TrainResult

logger = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    """Where the policy trained on `iteration` goes (the policy of iteration + 1)."""
    return run_dir / "checkpoints" / f"iteration-{iteration + 1}"


def _load_backend(config: RunConfig, policy: str) -> Backend:
    collect = config.collect
    return load_backend(collect.backend, policy, device=collect.device, sglang_url=collect.sglang_url,
                        seed=collect.seed)


def _policy_to_train(backend: Backend, kept: torch.nn.Module | None, engine: str) -> torch.nn.Module | None:
    """The in-memory model training updates: the torch backend's own (trained in place, so the
    next collection needs no reload), else the model trained last iteration (None: the trainer
    loads the checkpoint). DeepSpeed always loads it: ZeRO-3 would partition a model it is handed."""
    if engine == "deepspeed":
        return None
    if isinstance(backend, TorchBackend):
        return backend.train_in_place()
    return kept


def _check_deepspeed_run(config: RunConfig) -> None:
    """A run trains with DeepSpeed in its one process only: every rank would collect and write the
    warehouse, so several ranks train with `cleaner train` under torchrun instead."""
    check_deepspeed_setup(config.train)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise JobError(f"cleaner run is one process, but it was launched on {world_size} ranks; "
                       "collect and purify once, then train on many ranks with `cleaner train "
                       "--engine deepspeed` under torchrun")


RUN_LOCK = ".run.lock"  # in the run directory: one process drives a run


def run_loop(config: RunConfig, *, resume: bool = False, progress: bool = True,
             on_iteration: Callable[[IterationRow], None] | None = None,
             metrics: MetricsLogger | None = None) -> list[IterationRow]:
    """Run `config.iterations` iterations; returns the iteration rows of the whole run.

    `metrics` gets every iteration completed here (module docstring); the caller closes it."""
    metrics = metrics or NullLogger()
    # a bad backend, device or model fails before anything is written
    require_backend(config.collect.backend, config.collect.sglang_url)
    check_device(config.collect.device)
    check_model_path(config.collect.model)
    if config.train.engine == "deepspeed":
        _check_deepspeed_run(config)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with exclusive(run_dir / RUN_LOCK, f"{run_dir}: another process is running this run (it holds "
                                       f"{RUN_LOCK}); wait for it to end, or choose another --run-dir"):
        return _run_iterations(config, run_dir, resume, progress, on_iteration, metrics)


def _run_iterations(config: RunConfig, run_dir: Path, resume: bool, progress: bool,
                    on_iteration: Callable[[IterationRow], None] | None,
                    metrics: MetricsLogger) -> list[IterationRow]:
    """The body of `run_loop`, under the run directory's lock."""
    warehouse = Warehouse(run_dir / "warehouse")
    exists = warehouse.root.exists()
    done = {row.iteration: row for row in warehouse.read_iterations()} if exists else {}
    if exists and not resume and (done or warehouse.iterations_collected()):
        raise JobError(f"{run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    warehouse.root.mkdir(parents=True, exist_ok=True)
    warehouse.save_config("run", config.to_json())
    policy, backend = config.collect.model, None
    kept, optimization = None, None  # the model training updates and its optimiser, across iterations
    try:
        for iteration in range(config.iterations):
            if iteration in done:
                policy = done[iteration].policy_out or policy
                continue
            backend = backend or _load_backend(config, policy)
            row, trained = _one_iteration(config, warehouse, iteration, policy, backend, kept, optimization,
                                          progress)
            backend.adopt(row.policy_out)
            if trained is not None:  # the trained model and its optimiser equal the saved checkpoint
                kept, optimization = trained.model, trained.optimization
            else:  # trained before a crash: the next training loads the checkpoint and its optimiser
                kept, optimization = None, None
            policy = row.policy_out
            # the steps as stored: in memory if trained here, else trained before a crash
            for step in trained.steps if trained is not None else warehouse.read_train_steps(iteration):
                metrics.log_step(step)
            metrics.log_iteration(row)
            if on_iteration is not None:
                on_iteration(row)
    finally:
        if backend is not None:
            backend.close()
    return warehouse.read_iterations()


def _premise_columns(premise: PremiseStats | None) -> dict[str, float]:
    """The iterations row's premise columns (clean_rollouts, clean_accuracy, ...)."""
    if premise is None:
        return {}
    return {f"{name}_{field}": getattr(getattr(premise, name), key)
            for name in ("clean", "recovered", "unrecovered")
            for field, key in (("rollouts", "rollouts"), ("accuracy", "accuracy"), ("advantage", "mean_advantage"))}


def _one_iteration(config: RunConfig, warehouse: Warehouse, iteration: int, policy: str, backend: Backend,
                   kept: torch.nn.Module | None, optimization: Optimization | None,
                   progress: bool) -> tuple[IterationRow, TrainResult | None]:
    """One iteration; returns its row and the training result if a model was trained here (None if
    a previous process had already trained and saved it)."""
    collect_config = dataclasses.replace(config.collect, iteration=iteration, model=str(policy))
    collected = collect_job(warehouse, collect_config, resume=True, backend=backend, progress=progress)
    purified = purify_job(warehouse, iteration, [config.purify], backend=backend,
                          device=config.collect.device, progress=progress)
    (result,) = purified.results
    out = checkpoint_dir(Path(config.run_dir), iteration)
    trained, train_s = None, 0.0
    if not (warehouse.has_train_steps(iteration) and out.exists()):
        outcome = train_job(warehouse, iteration, config.purify.config_id, policy, out, config.train,
                            model=_policy_to_train(backend, kept, config.train.engine), rows=result.rows,
                            optimization=optimization, progress=progress)
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
