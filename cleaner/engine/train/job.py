"""The train job: one GRPO/DAPO iteration on a purified config's rows (docs/architecture.md §7).

Idempotence and resume: the checkpoint is swapped in atomically, then its train_steps are written;
an iteration is complete once its `iterations` row exists.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import check_device, check_model_path
from cleaner.engine.train.deepspeed_config import check_deepspeed_setup
from cleaner.engine.train.optim import Optimization
from cleaner.engine.train.trainer import TrainResult, train_iteration
from cleaner.errors import JobError
from cleaner.outputs import CHECKPOINT, check_replaceable
from cleaner.records import PurifiedRow
from cleaner.warehouse import Warehouse, WarehouseError


@dataclass(frozen=True)
class TrainRequest:
    """What a train job computes: one GRPO/DAPO iteration on a purified config's rows."""

    iteration: int  # the purified iteration to train on
    config_id: str  # its purify config (a unique prefix, as `cleaner purify` prints it)
    policy: str | Path  # the policy to update: the one that collected the iteration
    out: str | Path  # where the new checkpoint goes
    config: TrainConfig  # how to train


@dataclass(frozen=True)
class TrainOutcome:
    result: TrainResult  # the checkpoint, the step rows, the trained model and its optimiser
    seconds: float


def train_job(warehouse: Warehouse, request: TrainRequest, *, model=None, rows: Sequence[PurifiedRow] | None = None,
              optimization: Optimization | None = None, progress: bool = True) -> TrainOutcome:
    """Train on one purified config of an iteration; write the checkpoint and the step metrics.

    `model` is the policy already in memory (else it is loaded from `policy`); `rows` are that
    config's purified rows when the caller has already read them; `optimization` is the run's
    optimiser bound to `model` (without it, the one saved with `policy` is resumed).
    """
    config, iteration = request.config, request.iteration
    started = time.monotonic()
    check_replaceable(request.out, CHECKPOINT)  # before any training: `out` must be absent or a checkpoint
    warehouse.check_writable()
    check_device(config.device)
    if config.engine == "deepspeed":
        check_deepspeed_setup(config)
    if model is None:
        check_model_path(request.policy)
    if rows is None:
        config_id = warehouse.resolve_config_id(request.config_id)  # a unique prefix, as purify prints it
        try:
            rows = warehouse.read_purified(iteration, config_id)
        except WarehouseError as exc:
            raise JobError(f"{exc}; run `cleaner purify` first") from exc
    result = train_iteration(rows, request.policy, request.out, config, iteration, model=model, progress=progress,
                             optimization=optimization)
    if result.main_process:  # DeepSpeed's ranks all train; one writes, so each step is one row
        warehouse.write_train_steps(iteration, result.steps)
        warehouse.save_config(f"train-iteration={iteration}", config.to_json())
    return TrainOutcome(result, time.monotonic() - started)
