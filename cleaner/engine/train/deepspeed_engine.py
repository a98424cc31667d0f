"""DeepSpeed ZeRO behind the trainer's interface (engine = "deepspeed"; docs/architecture.md §7).

Launch one process per device with torchrun (or DeepSpeed's launcher), which sets the ranks; a
process started without a launcher is a world of one. Verified with ZeRO-2 and ZeRO-3 on two CPU
processes (gloo, `DS_ACCELERATOR=cpu`): the weights equal the torch engine's within 1e-5
(tests/engine/train/test_deepspeed.py).

Design decisions:
- The same stages as the torch engine (`prepare_rows`, `iter_mini_batches`, `packing`,
  `forward_micro_batch`, `StepMetrics`) on the same module, `policy.TrainablePolicy`, which
  DeepSpeed initialises with (under ZeRO-3 the lm_head weight the chunked head reads is gathered as
  a parameter of that module's forward), and the same optimiser: `optim.new_optimization`'s AdamW
  and warmup schedule, handed to DeepSpeed as its client optimiser and scheduler, with the batch
  sizes, clipping and precision of TrainConfig (`deepspeed_config.py`). Every rank sees every row in
  the same seeded order and trains on its share: `mini_rows[rank::world_size]`, or with a token
  budget the longest-first assignment that balances tokens across ranks.
- The mini batch's aggregate across ranks: each micro loss is divided by the totals of the WHOLE
  mini batch (its loss tokens and rows, which every rank knows; aggregation.py) and multiplied by
  world_size, because DeepSpeed averages gradients over ranks: (1/W) sum_r W g_r / N = sum_r g_r
  / N, the torch engine's gradient, for every loss_agg_mode.
  `backward(..., scale_wrt_gas=False)` because that normalisation already covers accumulation.
- Accumulation: the number of micro batches varies from step to step (token budgets), so the
  boundary is set explicitly (`set_gradient_accumulation_boundary`, true on the last micro batch);
  `engine.step()` after every micro batch steps there. Every rank knows every rank's share, so the
  ranks with fewer micro batches pad with zero-weight ones and all reach the boundary (and ZeRO-3's
  collective forwards) together.
- Numbering and schedule: a step row carries the run-wide `optimizer_step` and the lr that step
  used, read from the schedule before stepping. A step DeepSpeed skips (fp16 overflow) still moves
  the schedule on, as the torch engine's skipped step does, and its row's grad_norm is infinite, as
  the torch engine logs a non-finite norm (DeepSpeed 0.19's fp16 and ZeRO optimisers return before
  updating their norm on overflow, so `get_global_grad_norm()` still holds the previous step's). DeepSpeed skips non-finite steps only
  under fp16 (or bf16 with its `check_grad_overflow`); the torch engine skips any.
- The optimiser state is partitioned under ZeRO, so it is saved with DeepSpeed's own
  `save_checkpoint` (each rank its partition) into `<checkpoint>/optimizer/deepspeed/`, beside a
  small `optimizer/deepspeed.json` (run-wide step, ZeRO stage, ranks), inside the same atomic
  directory as the weights. Resuming needs the same stage and number of ranks (DeepSpeed cannot
  repartition); a checkpoint of the other engine is refused rather than silently restarted, since
  a fresh AdamW mid-run trains differently (`optim.py`); a plain Hugging Face model starts fresh.
- Only rank 0 writes: it creates the temporary directory, the ranks write their partitions into
  it, rank 0 adds the Hugging Face weights (`save_pretrained`; ZeRO-3 gathers them first), config,
  tokenizer and metadata, and swaps it in. `TrainResult.main_process` tells the callers which
  process prints and writes warehouse rows.
- LoRA (lora.py): the module is the PeftModel, its adapters DeepSpeed's only trainable parameters;
  the KL reference is each micro batch's forward with them disabled, through the engine (every rank
  runs the same forwards, as ZeRO-3's gathers need); DeepSpeed's state leaves the frozen base out,
  and rank 0 writes the merged weights (from ZeRO-3's gathered state under stage 3) and the adapter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.model.head import check_attention
from cleaner.engine.model.loading import load_tokenizer_if_present
from cleaner.engine.train.checkpoint import save_pretrained_as
from cleaner.engine.train.deepspeed_config import (
    check_deepspeed_setup,
    deepspeed_config_for,
    zero_stage,
)
from cleaner.engine.train.lora import AdapterReference, new_adapters, save_with_adapters
from cleaner.engine.train.optim import (
    DEEPSPEED_STATE_DIR,
    DEEPSPEED_STATE_META,
    STATE_PATH,
    Optimization,
    OptimizerStateError,
    advance_schedule,
    new_optimization,
    other_engine_error,
)
from cleaner.engine.train.outcome import check_trained
from cleaner.engine.train.packing import micro_batches, pack_rows, rank_share
from cleaner.engine.train.policy import load_trainable, training
from cleaner.engine.train.rollout_correction import Corrected
from cleaner.engine.train.step import (
    Reference,
    ReferenceLogProbs,
    StepMetrics,
    TrainResult,
    batch_totals,
    forward_micro_batch,
    iter_mini_batches,
    longest_row,
    prepare,
    timed,
    with_rollout_corr,
)
from cleaner.outputs import CHECKPOINT, atomic_directory
from cleaner.records import PurifiedRow, TrainStepRow

logger = logging.getLogger(__name__)

STATE_TAG = "state"  # the one save_checkpoint tag a checkpoint holds
STATE_FORMAT = 2  # 2: DeepSpeed's module is the TrainablePolicy (parameter names start with "policy.")
POLICY_PREFIX = "policy."  # the TrainablePolicy's name for the Hugging Face model inside it
GATHERED_WEIGHTS = ".gathered/pytorch_model.bin"  # ZeRO-3's gathered weights, removed after use


def _rank_device() -> torch.device:
    """This rank's device as DeepSpeed will take it: the GPU of its LOCAL_RANK, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _comm():
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    return deepspeed.comm


# ---------------------------------------------------------------------------
# Ranks and initialisation


def _init_distributed() -> None:
    """Join the launcher's process group; without a launcher, be a world of one."""
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        # DeepSpeed would otherwise look for MPI; these are what torchrun sets for one process.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    deepspeed.init_distributed()


def saved_optimizer_step(policy_path: str | Path, ds_config: dict, world_size: int) -> int | None:
    """The run-wide step of the DeepSpeed state saved with `policy_path`; None if it has none."""
    meta_path, torch_state = Path(policy_path) / DEEPSPEED_STATE_META, Path(policy_path) / STATE_PATH
    if not meta_path.is_file():
        if torch_state.is_file():
            raise other_engine_error(policy_path, STATE_PATH, "torch")
        logger.info("%s holds no optimiser state (%s): the optimiser starts fresh at step 0",
                    policy_path, DEEPSPEED_STATE_META)
        return None
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != STATE_FORMAT:
        raise OptimizerStateError(
            f"{meta_path}: format {meta.get('format')!r}, expected {STATE_FORMAT} (an earlier cleaner's "
            "DeepSpeed state names the parameters otherwise); delete its optimizer/ directory to start "
            "a fresh optimiser")
    saved = (meta["zero_stage"], meta["world_size"])
    if saved != (zero_stage(ds_config), world_size):
        raise OptimizerStateError(
            f"{policy_path}: its optimiser state is partitioned for ZeRO stage {saved[0]} on "
            f"{saved[1]} ranks, this run has stage {zero_stage(ds_config)} on {world_size}; resume "
            "with the same, or delete its optimizer/ directory to start a fresh optimiser")
    return int(meta["optimizer_step"])


def _initialize(model: torch.nn.Module, config: TrainConfig, ds_config: dict, step: int):
    """The DeepSpeed engine over cleaner's AdamW and schedule, positioned at run-wide `step`."""
    import deepspeed  # optional extra (deepspeed), needed only by this engine

    optimization = new_optimization(model, config, step)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimization.optimizer, lr_scheduler=optimization.scheduler,
        config=ds_config)
    return engine, optimization


def _resume(engine, optimization: Optimization, policy_path: str | Path, config: TrainConfig) -> None:
    """Load the saved partitions; hyper-parameters stay the config's, as in `optim.py`. A LoRA
    state holds no frozen base weight (`_write_partitions`): the module has them already."""
    loaded, _ = engine.load_checkpoint(str(Path(policy_path) / DEEPSPEED_STATE_DIR), tag=STATE_TAG,
                                       load_optimizer_states=True, load_lr_scheduler_states=False,
                                       load_module_strict=config.lora_rank == 0)
    if loaded is None:
        raise OptimizerStateError(f"{policy_path}: {DEEPSPEED_STATE_DIR} holds no DeepSpeed checkpoint")
    lrs = optimization.scheduler.get_last_lr()
    for group, base_lr, lr in zip(optimization.optimizer.param_groups, optimization.scheduler.base_lrs,
                                  lrs, strict=True):
        group.update(lr=lr, initial_lr=base_lr, weight_decay=config.weight_decay)
    logger.info("resuming the DeepSpeed optimiser of %s at step %d", policy_path, optimization.step)


# ---------------------------------------------------------------------------
# One optimiser step across ranks


def rank_micro_batches(mini_rows: Sequence[PurifiedRow], rank: int, world_size: int,
                       config: TrainConfig) -> list[tuple[list[PurifiedRow], float]]:
    """This rank's micro batches with their weights, as many as the rank with the most has: every
    rank knows every share, and the short ones are padded with zero-weight repeats of a row, so all
    ranks run the same number of forwards and backwards (ZeRO's collectives need it)."""
    balance = config.max_tokens_per_micro_batch is not None

    def micro_of(r: int) -> list[list[PurifiedRow]]:
        return micro_batches(rank_share(mini_rows, r, world_size, balance), config.micro_batch_size,
                             config.max_tokens_per_micro_batch)

    count = max(len(micro_of(r)) for r in range(world_size))
    mine = [(rows, 1.0) for rows in micro_of(rank)]
    filler = (mine[0][0][:1] if mine else [min(mini_rows, key=lambda row: len(row.token_ids))], 0.0)
    return mine + [filler] * (count - len(mine))


def rank_loss_scale(weight: float, world_size: int) -> float:
    """What a rank multiplies its micro loss (already / the mini batch's tokens) by, so that
    DeepSpeed's mean over ranks is the mini batch's token-mean gradient."""
    return weight * world_size


def _deepspeed_step(engine, optimization: Optimization, reference: Reference | None,
                    mini_rows: Sequence[PurifiedRow], prepared: Corrected, config: TrainConfig, iteration: int,
                    step: int) -> TrainStepRow:
    """One optimiser step across the ranks: this rank's micro batches, DeepSpeed's step at the
    explicit accumulation boundary (the last micro batch), the metrics summed over ranks."""
    comm = _comm()
    world_size, rank = comm.get_world_size(), comm.get_rank()
    started = time.perf_counter()
    totals = batch_totals(mini_rows, config)  # the whole mini batch's, which every rank knows
    optimizer_step, lr = optimization.step, optimization.lr  # what this step uses
    metrics = StepMetrics()
    micro = rank_micro_batches(mini_rows, rank, world_size, config)
    for index, (rows, weight) in enumerate(micro):
        engine.set_gradient_accumulation_boundary(index == len(micro) - 1)
        batch = pack_rows(rows, engine.device, prepared.is_weights)
        part = forward_micro_batch(engine, reference, rows, batch, config, totals)
        engine.backward(part.loss * rank_loss_scale(weight, world_size), scale_wrt_gas=False)
        engine.step()
        metrics.add(part, weight)
    grad_norm = engine.get_global_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    if not engine.was_step_applied():
        logger.warning("iteration %d step %d: DeepSpeed skipped the step (overflow)", iteration, step)
        advance_schedule(optimization.scheduler)  # the run-wide schedule moves on, as the torch engine's does
        grad_norm = math.inf  # DeepSpeed keeps the last applied step's norm; the row says it overflowed
    sums = metrics.tensor(engine.device)
    comm.all_reduce(sums)  # each rank holds its share of the mini-batch values
    row = StepMetrics.from_tensor(sums).row(iteration, step, optimizer_step, grad_norm, lr, int(totals.loss_tokens),
                                            kl=config.kl_coef > 0)
    return timed(row, engine.module.policy, mini_rows, started, world_size)


# ---------------------------------------------------------------------------
# Save and the iteration


def _write_partitions(engine, temp_dir: Path, ds_config: dict, lora: bool) -> dict | None:
    """Every rank: its optimiser partition, and under ZeRO-3 its share of the weight gathering.
    Returns the gathered weights on rank 0 under ZeRO-3, else None (the module holds them). With
    LoRA the frozen base stays out of DeepSpeed's state: the checkpoint's weights hold it."""
    engine.save_checkpoint(str(temp_dir / DEEPSPEED_STATE_DIR), tag=STATE_TAG, exclude_frozen_parameters=lora)
    if zero_stage(ds_config) != 3:
        return None
    gathered = temp_dir / GATHERED_WEIGHTS
    if not engine.save_16bit_model(str(gathered.parent), gathered.name):
        raise RuntimeError("ZeRO-3 saved no gathered weights although cleaner enabled gathering")
    if _comm().get_rank() != 0:
        return None
    state_dict = torch.load(gathered, map_location="cpu", weights_only=True)
    gathered.unlink()
    gathered.parent.rmdir()
    return state_dict


def _write_checkpoint(engine, optimization: Optimization, ds_config: dict, policy_path: str | Path,
                      out_path: str | Path, config: TrainConfig) -> Path:
    """All ranks write their partitions into rank 0's temporary directory; rank 0 swaps it in."""
    comm = _comm()
    out_path = Path(out_path).resolve()
    if comm.get_rank() != 0:
        shared = [None]
        comm.broadcast_object_list(shared, src=0)
        _write_partitions(engine, Path(shared[0]), ds_config, config.lora_rank > 0)
        comm.barrier()  # rank 0 completes the directory
        comm.barrier()  # and swaps it in
        return out_path
    tokenizer = load_tokenizer_if_present(policy_path)
    with atomic_directory(out_path, CHECKPOINT) as temp_dir:
        comm.broadcast_object_list([str(temp_dir)], src=0)
        state_dict = _write_partitions(engine, temp_dir, ds_config, config.lora_rank > 0)
        comm.barrier()
        if state_dict is not None:  # gathered from the TrainablePolicy: its keys start with "policy."
            state_dict = {name.removeprefix(POLICY_PREFIX): value for name, value in state_dict.items()}
        save_weights = save_with_adapters if config.lora_rank > 0 else save_pretrained_as
        save_weights(engine.module.policy, temp_dir, config.save_dtype, state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(temp_dir)
        (temp_dir / "train_config.json").write_text(config.to_json())
        meta = {"format": STATE_FORMAT, "optimizer_step": optimization.step,
                "zero_stage": zero_stage(ds_config), "world_size": comm.get_world_size(),
                "deepspeed_config": ds_config}
        (temp_dir / DEEPSPEED_STATE_META).write_text(json.dumps(meta, indent=1, sort_keys=True))
    comm.barrier()
    logger.info("saved checkpoint to %s", out_path)
    return out_path


def _reentrant(config: TrainConfig, ds_config: dict) -> bool:
    """Reentrant checkpointing under ZeRO-3 with LoRA: a non-reentrant recomputation keeps the
    frozen weights it saved, which ZeRO-3's forward hooks (DeepSpeed 0.19.0) partition in place
    before it checks them (deepspeedai/DeepSpeed#8148)."""
    return config.lora_rank > 0 and zero_stage(ds_config) == 3


def _reference_log_probs(policy_path: str | Path, train_rows: Sequence[PurifiedRow], config: TrainConfig,
                         iteration: int) -> ReferenceLogProbs | None:
    """The reference's log-probs of the rows this rank trains on, before the policy's engine exists;
    None without the KL term, or with LoRA (its reference is the engine's own base)."""
    if config.lora_rank > 0:
        return None
    comm = _comm()
    mine = [row for mini in iter_mini_batches(train_rows, config, iteration)
            for micro, _ in rank_micro_batches(mini, comm.get_rank(), comm.get_world_size(), config) for row in micro]
    return ReferenceLogProbs.of_checkpoint(policy_path, mine, config, _rank_device())


def train_iteration_deepspeed(
    rows: Sequence[PurifiedRow],
    policy_path: str | Path,
    out_path: str | Path,
    config: TrainConfig,
    iteration: int,
    model: torch.nn.Module | None = None,
    progress: bool = True,
    purify: PurifyConfig | None = None,
) -> TrainResult:
    """`trainer.train_iteration` on DeepSpeed; every rank calls it with the same rows.

    The optimiser state saved with `policy_path` by this engine is resumed. A `model` passed in
    belongs to DeepSpeed afterwards (ZeRO-3 partitions its parameters).
    """
    check_deepspeed_setup(config)
    torch.manual_seed(config.seed)
    _init_distributed()
    comm = _comm()
    ds_config = deepspeed_config_for(config, comm.get_world_size(), _rank_device().type)
    fresh = new_adapters(policy_path, config)  # new adapters start their optimiser with them
    step = None if fresh else saved_optimizer_step(policy_path, ds_config, comm.get_world_size())
    prepared = prepare(rows, config, purify)
    train_rows = prepared.rows
    reference = _reference_log_probs(policy_path, train_rows, config, iteration)
    # on the CPU until DeepSpeed places (and under ZeRO-3 partitions) the policy
    policy = load_trainable(policy_path, config, "cpu", model)
    check_attention(policy.policy, longest_row(train_rows))  # a sliding window every row fits in
    engine, optimization = _initialize(policy, config, ds_config, step or 0)
    if step is not None:
        _resume(engine, optimization, policy_path, config)
    if config.lora_rank > 0 and config.kl_coef > 0:
        reference = AdapterReference(engine, engine.module)
    main = comm.get_rank() == 0
    steps: list[TrainStepRow] = []
    mini_batches = list(iter_mini_batches(train_rows, config, iteration))
    bar = tqdm(mini_batches, desc=f"train iteration {iteration}", unit="step", disable=not (progress and main))
    with training(engine.module, config, reentrant=_reentrant(config, ds_config)):
        for index, mini_rows in enumerate(bar):
            steps.append(_deepspeed_step(engine, optimization, reference, mini_rows, prepared, config, iteration,
                                         index))
    # every rank holds the same (all-reduced) step rows, so all refuse alike; ZeRO-3's partitioned
    # weights are empty here and go unchecked
    check_trained(steps, engine.module.policy.named_parameters(), iteration,
                  loss_scaled=config.compute_dtype_on(_rank_device().type) == "float16")
    saved = _write_checkpoint(engine, optimization, ds_config, policy_path, out_path, config)
    if hasattr(engine, "destroy"):  # ZeRO-3's hooks would outlive the iteration in `cleaner run`
        engine.destroy()
    return TrainResult(out_path=saved, steps=with_rollout_corr(steps, prepared.metrics), model=None, optimization=None,
                       main_process=main)
