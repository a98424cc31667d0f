"""The train job: one GRPO/DAPO iteration on a purified config's rows (docs/architecture.md §7).

Idempotence and resume: the checkpoint is swapped in atomically, then its train_steps are written;
an iteration is complete once its `iterations` row exists. Each train_steps row carries the purify
config it trained on and the checkpoint it wrote, and training the same config of an iteration into
the same checkpoint again replaces that run's rows (`Warehouse.write_train_steps`).

One writer per iteration: the process that writes (DeepSpeed's rank 0; the only one otherwise)
holds the warehouse's train lock of the iteration from its checks to its last row, and refuses to
train when the checkpoint's file system lacks the room the checkpoint needs (`space.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cleaner.config import TrainConfig
from cleaner.engine.model.loading import check_device, check_model_path
from cleaner.engine.train import space
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
    writes = _writes_here(config)
    with warehouse.writer("train", iteration) if writes else contextlib.nullcontext():
        if writes:
            _check_room(request, model)
        config_id = warehouse.resolve_config_id(request.config_id)  # a unique prefix, as purify prints it
        if rows is None:
            try:
                rows = warehouse.read_purified(iteration, config_id)
            except WarehouseError as exc:
                raise JobError(f"{exc}; run `cleaner purify` first") from exc
        result = train_iteration(rows, request.policy, request.out, config, iteration, model=model,
                                 progress=progress, optimization=optimization)
        if result.main_process:  # DeepSpeed's ranks all train; one writes, so each step is one row
            checkpoint = str(Path(request.out).resolve())
            warehouse.write_train_steps(iteration, [dataclasses.replace(step, config_id=config_id, checkpoint=checkpoint)
                                                    for step in result.steps])
            warehouse.save_config(f"train-iteration={iteration}", config.to_json())
    return TrainOutcome(result, time.monotonic() - started)


def _writes_here(config: TrainConfig) -> bool:
    """Whether this process writes the checkpoint and the rows: DeepSpeed's rank 0 (the launcher's
    RANK), or the one process of the torch engine."""
    return config.engine != "deepspeed" or int(os.environ.get("RANK", "0")) == 0


def _check_room(request: TrainRequest, model) -> None:
    """JobError when the checkpoint would not fit where it goes (space.py); nothing is checked for
    a policy whose size is unknown (not a local directory of weights)."""
    n_parameters = space.model_parameters(model) if model is not None else space.stored_parameters(request.policy)
    if n_parameters is None:
        return
    save_dtype = request.config.save_dtype
    needed = space.checkpoint_bytes(n_parameters, save_dtype, request.config.engine,
                                    space.other_bytes(request.policy))
    refusal = space.room_error(Path(request.out), needed, n_parameters, save_dtype)
    if refusal is not None:
        raise JobError(refusal)
