"""One optimiser and one learning-rate schedule for the whole run (docs/architecture.md §7).

The reference keeps a single AdamW for the whole run (lr 2e-6 with a linear warmup), so Adam's
moments build up across iterations. A fresh AdamW per iteration would instead make the first steps
of every iteration move each weight by about lr (Adam's first step is sign-like) and never let the
moments settle. So the optimiser lives as long as the run:
- `cleaner run` hands the same `Optimization` from one iteration's training to the next;
- every checkpoint carries the optimiser's state (`optimizer/state.pt`, written in the same atomic
  directory swap as the weights), so `cleaner train --policy CKPT` and `cleaner run --resume`
  continue exactly where the saved run was;
- a checkpoint without that file (any Hugging Face model) still loads: the optimiser starts fresh,
  and says so;
- the DeepSpeed engine saves the same optimiser partitioned, in its own format
  (`DEEPSPEED_STATE_DIR` and `DEEPSPEED_STATE_META`, `deepspeed_engine.py`); each engine refuses the
  other's state rather than silently starting fresh mid-run.

Design decisions:
- The schedule is transformers' `get_constant_schedule_with_warmup`: at optimiser step t (run-wide,
  from 0) the learning rate is lr * min(1, t / warmup_steps), so step 0 of a warmed-up run has lr 0
  (Adam's moments still take that step's gradient). warmup_steps = 0 is a constant lr.
  Unit: optimiser steps. verl steps its scheduler once per training iteration, so the reference's
  20 warmup steps are 20 iterations = 20 x (mini batches per iteration) optimiser steps here.
- The saved state is the optimiser's `state_dict` (moments and Adam's step counts) and the run-wide
  step number; when the checkpoint's weights are saved in bfloat16 (--save-dtype), also the float32
  weights the optimiser updates, which a resume copies back over the rounded ones.
  Hyper-parameters (lr, weight decay, warmup) always come from the current TrainConfig; the
  schedule's position comes from the saved step. A skipped step (non-finite
  gradient norm) still advances the schedule, as verl's once-per-iteration scheduler does.
- float16 compute: a GradScaler built as verl's actor builds its own (initial scale 2^16, halved
  on a non-finite step, doubled after 400 finite ones); the gradients are unscaled before clipping,
  so the clip and the logged norm see their true size. Its state (scale, growth tracker) is saved
  with the optimiser and resumed.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import get_constant_schedule_with_warmup

from cleaner.config import TrainConfig
from cleaner.errors import CleanerError

logger = logging.getLogger(__name__)

STATE_PATH = "optimizer/state.pt"  # inside a checkpoint directory; not a weight file
STATE_FORMAT = 1
MASTER_WEIGHTS = "master_weights"  # in the state file of a checkpoint whose weights are not float32
DEEPSPEED_STATE_DIR = "optimizer/deepspeed"  # DeepSpeed's save_checkpoint, one partition per rank
DEEPSPEED_STATE_META = "optimizer/deepspeed.json"  # {format, optimizer_step, zero_stage, world_size}
# verl's actor under float16: ShardedGradScaler(growth_interval=400) (verl/workers/actor/dp_actor.py,
# v0.7.0), the scale doubling after 400 finite steps where torch's default waits 2,000
SCALER_GROWTH_INTERVAL = 400


class OptimizerStateError(CleanerError, ValueError):
    """A checkpoint's optimiser state cannot continue this run; the message says how to go on."""


def other_engine_error(checkpoint: str | Path, found: str, engine: str) -> OptimizerStateError:
    """The error for a checkpoint whose optimiser state (`found`) was written by `engine`."""
    return OptimizerStateError(
        f"{checkpoint}: its optimiser state ({found}) was written by the {engine} engine; continue "
        f"with --engine {engine}, or delete its optimizer/ directory to start a fresh optimiser")


@dataclass
class Optimization:
    """An AdamW over a model's trainable parameters and its position in the lr schedule."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    named_params: list[tuple[str, torch.nn.Parameter]]  # the trainable parameters, as the optimiser holds them
    scaler: torch.amp.GradScaler | None = None  # float16 compute's dynamic loss scale; None otherwise

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a micro batch's loss (scaled, under float16)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self) -> None:
        """The accumulated gradients back at their true size, before clipping (float16)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)

    @property
    def step(self) -> int:
        """Run-wide number of the next optimiser step (0 before the first)."""
        return self.scheduler.last_epoch

    @property
    def lr(self) -> float:
        """The learning rate the next optimiser step uses."""
        return float(self.optimizer.param_groups[0]["lr"])

    def advance(self, apply: bool) -> None:
        """Apply the accumulated gradients (unless `apply` is False) and move the schedule on."""
        if apply:
            self.optimizer.step()
        if self.scaler is not None:  # the scale halves after a non-finite step, grows after good ones
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        advance_schedule(self.scheduler)

    def state(self, master_weights: bool = False) -> dict:
        """What a checkpoint stores: the optimiser's state_dict and the run-wide step, and with
        `master_weights` the float32 weights it updates (for a checkpoint saved in bfloat16)."""
        state = {"format": STATE_FORMAT, "optimizer": self.optimizer.state_dict(), "optimizer_step": self.step}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if master_weights:
            state[MASTER_WEIGHTS] = {name: p.detach().to("cpu", copy=True) for name, p in self.named_params}
        return state


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def new_optimization(model: torch.nn.Module, config: TrainConfig, step: int = 0,
                     optimizer_state: dict | None = None, scaler_state: dict | None = None) -> Optimization:
    """AdamW on the model's trainable parameters, positioned at run-wide step `step`; under
    float16 compute, with a GradScaler (its saved scale resumed)."""
    named_params = _trainable(model)
    params = [p for _, p in named_params]
    # fused on a GPU: one kernel per step, without the foreach path's step-sized temporaries
    fused = bool(params) and all(p.is_cuda for p in params)
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=fused or None)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)  # moments; casts them to each parameter's device
    for group in optimizer.param_groups:  # hyper-parameters are the config's, not the checkpoint's;
        # initial_lr lets the schedule start mid-run (step > 0) before DeepSpeed loads the moments
        group.update(lr=config.lr, initial_lr=config.lr, weight_decay=config.weight_decay)
        group.update(fused=fused or None, foreach=None)  # where it runs now, not where it was saved
    scheduler = get_constant_schedule_with_warmup(optimizer, config.warmup_steps, last_epoch=step - 1)
    device = params[0].device.type if params else "cpu"
    scaler = None
    if config.compute_dtype_on(device) == "float16":
        scaler = torch.amp.GradScaler(device, growth_interval=SCALER_GROWTH_INTERVAL)
        if scaler_state:  # the scale and its growth tracker resume; the interval is verl's
            scaler.load_state_dict({**scaler_state, "growth_interval": SCALER_GROWTH_INTERVAL})
    return Optimization(optimizer, scheduler, named_params, scaler)


def load_optimization(model: torch.nn.Module, config: TrainConfig, checkpoint: str | Path) -> Optimization:
    """The optimiser saved with `checkpoint`, bound to `model`; fresh if the checkpoint has none."""
    path = Path(checkpoint) / STATE_PATH
    if not path.is_file() and (Path(checkpoint) / DEEPSPEED_STATE_META).is_file():
        raise other_engine_error(checkpoint, DEEPSPEED_STATE_META, "deepspeed")
    if not path.is_file():
        logger.info("%s holds no optimiser state (%s): the optimiser starts fresh at step 0",
                    checkpoint, STATE_PATH)
        return new_optimization(model, config)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("format") != STATE_FORMAT:
        raise OptimizerStateError(f"{path}: optimiser state format {saved.get('format')!r}, expected {STATE_FORMAT}")
    groups = saved["optimizer"]["param_groups"]
    n_saved = sum(len(group["params"]) for group in groups)
    if n_saved != len(_trainable(model)):
        raise OptimizerStateError(f"{path}: optimiser state for {n_saved} parameters, the model trains "
                         f"{len(_trainable(model))}; it belongs to another architecture")
    if MASTER_WEIGHTS in saved:  # the checkpoint's weights are rounded (--save-dtype); these are not
        _restore_master_weights(model, saved[MASTER_WEIGHTS], path)
    logger.info("resuming the optimiser of %s at step %d", checkpoint, saved["optimizer_step"])
    return new_optimization(model, config, saved["optimizer_step"], saved["optimizer"], saved.get("scaler"))


def _restore_master_weights(model: torch.nn.Module, master: dict[str, torch.Tensor], path: Path) -> None:
    """Copy the saved float32 weights into the model's trainable parameters."""
    params = dict(_trainable(model))
    if set(master) != set(params):
        raise OptimizerStateError(f"{path}: master weights for other parameters than the model trains; "
                                  "it belongs to another architecture")
    with torch.no_grad():
        for name, value in master.items():
            params[name].copy_(value)


def advance_schedule(scheduler) -> None:
    """The schedule moved on one step, applied or skipped (verl's behaviour for a skipped float16
    step). torch warns when it moves before any optimiser step ran, which a first step skipped for
    overflow is: that step is logged as skipped already, so the warning is not repeated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()
