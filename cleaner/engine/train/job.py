"""The train job: one GRPO/DAPO iteration on a purified config's rows (docs/architecture.md §7).

Idempotence and resume: the checkpoint is swapped in atomically, then its train_steps are written;
an iteration is complete once its `iterations` row exists. Each train_steps row carries the purify
config it trained on and the checkpoint it wrote, and training the same config of an iteration into
the same checkpoint again replaces that run's rows (`Warehouse.write_train_steps`).

One writer per iteration: the process that writes (DeepSpeed's rank 0; the only one otherwise)
holds the warehouse's train lock of the iteration from its checks to its last row, and refuses to
train when the checkpoint's file system lacks the room the checkpoint needs (`space.py`). On a GPU,
every process refuses when training would not fit its memory by the estimate (`memory.py`), and an
out-of-memory error that still happens is one line with what to try.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.model.answers import refusal, row_value_faults
from cleaner.engine.model.loading import check_device, check_model_path, vocab_size_of
from cleaner.engine.train import lora, memory, space
from cleaner.engine.train.deepspeed_config import check_deepspeed_setup
from cleaner.engine.train.deepspeed_config import zero_stage as zero_stage_of
from cleaner.engine.train.optim import Optimization
from cleaner.engine.train.step import longest_micro_batch_tokens
from cleaner.engine.train.trainer import TrainResult, train_iteration
from cleaner.errors import JobError
from cleaner.outputs import CHECKPOINT, check_replaceable
from cleaner.records import PurifiedRow
from cleaner.warehouse import Warehouse, WarehouseError
from cleaner.warehouse.gate import check_config, check_iteration
from cleaner.warehouse.lock import phase_lock_path, refusal_if_held


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
    started = time.monotonic()
    check_device(request.config.device)
    device = _train_device(request.config)
    config = dataclasses.replace(request.config, compute_dtype=request.config.compute_dtype_on(device.type))
    request = dataclasses.replace(request, config=config)  # `auto` resolved: what trains, and is saved
    iteration = request.iteration
    if device.type == "cuda":
        memory.expandable_segments()
    check_replaceable(request.out, CHECKPOINT)  # before any training: `out` must be absent or a checkpoint
    warehouse.check_writable()
    warehouse.check_is_warehouse()  # before its lock file would make a run directory look like one
    if config.engine == "deepspeed":
        check_deepspeed_setup(config)
    if model is None:
        check_model_path(request.policy)
    lora.check_setup(request.policy, config, model)  # LoRA's settings against the model, before any work
    writes = _writes_here(config)
    with warehouse.writer("train", iteration) if writes else contextlib.nullcontext():
        if writes:
            _check_room(request, model)
        config_id = warehouse.resolve_config_id(request.config_id)  # a unique prefix, as purify prints it
        _check_purified(warehouse, iteration, config_id)
        if rows is None:
            try:
                rows = warehouse.read_purified(iteration, config_id)
            except WarehouseError as exc:
                raise JobError(f"{exc}; run `cleaner purify` first") from exc
        _check_values(warehouse, request, config_id, model, rows)
        _check_memory(request, model, rows)
        purify = _purify_config(warehouse, config_id)
        try:
            result = train_iteration(rows, request.policy, request.out, config, iteration, model=model,
                                     progress=progress, optimization=optimization, purify=purify)
        except torch.cuda.OutOfMemoryError as error:
            raise JobError(f"out of GPU memory while training iteration {iteration} on {config.device} "
                           f"({str(error).splitlines()[0][:160]}); {memory.out_of_memory_hint()}") from error
        if result.main_process:  # DeepSpeed's ranks all train; one writes, so each step is one row
            checkpoint = str(Path(request.out).resolve())
            warehouse.save_config(train_config_name(config), config.to_json())  # before the rows that name it
            warehouse.write_train_steps(iteration, [
                dataclasses.replace(step, config_id=config_id, checkpoint=checkpoint, train_config_id=config.config_id)
                for step in result.steps])
    return TrainOutcome(result, time.monotonic() - started)


def train_config_name(config: TrainConfig) -> str:
    """The name its JSON is saved under in the warehouse's configs/, by its id (`train_config_id`)."""
    return f"train-config={config.config_id}"


def _purify_config(warehouse: Warehouse, config_id: str) -> PurifyConfig:
    """The purify config of the rows as stored (its estimator recomputes advantages in the step); a
    config a warehouse lacks, or one an earlier version stored without the estimator, is GRPO's."""
    params = warehouse.purify_params(config_id)
    return PurifyConfig.from_json(params) if params is not None else PurifyConfig()


def _check_purified(warehouse: Warehouse, iteration: int, config_id: str) -> None:
    """JobError (or the gate's Refused, warehouse/gate.py) unless the iteration passes the readers'
    gate, its config's rows hold one row per rollout in parts the warehouse wrote, every rollout of
    the iteration has its rows under the config, and no purify of the iteration is running:
    training on part of an iteration, or on a row twice, would be a different step."""
    check_iteration(warehouse, iteration)
    check_config(warehouse, iteration, config_id)
    running = refusal_if_held(phase_lock_path(warehouse.root, "purify", iteration),
                              f"{warehouse.root}: iteration {iteration} is being purified",
                              "wait for it to end, then train", shared=False)
    if running:
        raise JobError(running)
    rollouts = warehouse.rollout_ids(iteration)
    missing = rollouts - warehouse.purified_rollout_ids(iteration, config_id)
    if missing and len(missing) < len(rollouts):  # none at all: reading the rows says to purify first
        raise JobError(f"{warehouse.root}: iteration {iteration} has rows under purify config {config_id} for "
                       f"{len(rollouts) - len(missing)} of its {len(rollouts)} rollouts: its purify was interrupted "
                       f"(or the collection was resumed after it); run `cleaner purify --iteration {iteration}` with "
                       "the same options again, then train")


def _check_values(warehouse: Warehouse, request: TrainRequest, config_id: str, model,
                  rows: Sequence[PurifiedRow]) -> None:
    """JobError, naming the rollouts, when the rows hold what no policy produced (ids past the
    policy's vocabulary, log-probs, rewards or advantages that are not finite): an older cleaner
    stored engines' answers unchecked (docs/architecture.md §5), and NaN would train as a number."""
    vocab_size = getattr(model.config, "vocab_size", None) if model is not None else vocab_size_of(request.policy)
    faults = row_value_faults(rows, vocab_size)
    if faults:
        raise JobError(f"{warehouse.root}: iteration {request.iteration}, purify config {config_id}: "
                       f"{refusal(faults, 'values')}; an older cleaner stored them unchecked: collect and purify "
                       "the iteration again before training")


def _check_memory(request: TrainRequest, model, rows: Sequence[PurifiedRow]) -> None:
    """JobError before training when the estimate (memory.py) says it will not fit on the GPU; on
    the CPU nothing is checked (the host's memory is the operating system's to share)."""
    config = request.config
    device = _train_device(config)
    if device.type != "cuda":
        return
    if model is not None:
        model_config, parameters = model.config, space.model_parameters(model)
    else:
        from transformers import AutoConfig  # CLI start-up time

        model_config = AutoConfig.from_pretrained(str(request.policy))
        parameters = space.stored_parameters(request.policy) or memory.parameter_count(model_config)
    trainable = _adapters(request, model)
    if trainable is not None and model is not None and lora.is_peft(model):
        parameters -= trainable  # a PeftModel's parameters count its adapters: the base's alone here
    zero_stage, world_size = 0, 1
    if config.engine == "deepspeed":
        zero_stage = zero_stage_of(json.loads(Path(config.deepspeed_config).read_text()))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    micro_tokens = longest_micro_batch_tokens(rows, config)
    compute_dtype = config.compute_dtype_on(device.type)
    plan = memory.plan(memory.ModelShape.of(model_config, parameters), micro_tokens=micro_tokens,
                       compute_dtype=compute_dtype, checkpointing=config.gradient_checkpointing,
                       kl=config.kl_coef > 0, chunk_tokens=config.logits_chunk_tokens, engine=config.engine,
                       zero_stage=zero_stage, world_size=world_size, device_bytes=memory.available_bytes(device),
                       trainable=trainable)
    refusal = memory.refusal(plan, what=f"{device} ({torch.cuda.get_device_name(device)})",
                             checkpointing=config.gradient_checkpointing, compute_dtype=compute_dtype,
                             engine=config.engine, zero_stage=zero_stage, micro_tokens=micro_tokens)
    if refusal is not None:
        raise JobError(refusal)


def _adapters(request: TrainRequest, model) -> int | None:
    """The parameters LoRA trains (the adapters'); None without LoRA (every parameter trains)."""
    if request.config.lora_rank == 0:
        return None
    return lora.adapter_parameters(model if model is not None else lora.meta_model(request.policy), request.config)


def _train_device(config: TrainConfig) -> torch.device:
    """The GPU (or CPU) this process trains on: --device, or under DeepSpeed its LOCAL_RANK's GPU."""
    if config.engine == "deepspeed":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
            else torch.device("cpu")
    return torch.device(config.device)


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
    needed = space.needed_bytes(space.checkpoint_bytes(n_parameters, save_dtype, request.config.engine,
                                                       space.other_bytes(request.policy), _adapters(request, model)))
    refusal = space.room_error(Path(request.out), needed, n_parameters, save_dtype)
    if refusal is not None:
        raise JobError(refusal)
