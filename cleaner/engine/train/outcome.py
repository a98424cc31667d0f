"""What an iteration's training must have done before its checkpoint is saved (docs/architecture.md §7).

A step whose gradient norm is not finite is skipped, so a batch whose loss is NaN on every step
trains nothing, and a learning rate that blows the weights up leaves a checkpoint of NaN that the
next iteration would collect with. Either is a failed train job (one line, exit 1, nothing saved),
never a success:

- every step's loss is not finite;
- every step was skipped, except under float16's dynamic loss scale, whose search skips the
  steps that overflow at too large a scale while the loss is finite (verl's actor skips them the
  same way): a warning says so, and the scale saved with the checkpoint goes on from there;
- a weight is not finite after the last step.

An iteration with no step (nothing left to train on) is not a failure: the policy is saved
unchanged, so a loop can go on (trainer.py). Nor is one whose steps hold no loss token (rollout
correction rejected every row, which verl keeps in the batch with a zero mask): a warning says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence

import torch

from cleaner.errors import JobError
from cleaner.records import TrainStepRow

logger = logging.getLogger(__name__)


def check_trained(steps: Sequence[TrainStepRow], parameters: Iterable[torch.nn.Parameter], iteration: int,
                  loss_scaled: bool) -> None:
    """JobError when the iteration's steps trained nothing or broke the weights (module notes);
    `loss_scaled`: float16's dynamic loss scale was on."""
    if not steps:
        return
    where = f"iteration {iteration}"
    if not any(step.tokens for step in steps):
        logger.warning("%s: none of its %d steps had a loss token (rollout correction rejected every row?): "
                       "nothing but AdamW's weight decay moved the policy", where, len(steps))
    if not any(math.isfinite(step.loss) for step in steps):
        raise JobError(f"{where}: the loss is not finite at any of its {len(steps)} steps (first: {steps[0].loss}); "
                       "nothing was trained and no checkpoint saved: check the rows' log-probs and advantages "
                       "(cleaner sql) and the rollout-correction settings")
    skipped = sum(not math.isfinite(step.grad_norm) for step in steps)
    if skipped == len(steps) and not loss_scaled:
        raise JobError(f"{where}: every one of its {len(steps)} steps was skipped (gradient norm "
                       f"{steps[-1].grad_norm}); nothing was trained and no checkpoint saved: try a lower --lr")
    if skipped == len(steps):
        logger.warning("%s: all %d steps overflowed float16's loss scale and were skipped; the scale keeps "
                       "halving from the one saved with the checkpoint", where, len(steps))
    broken = next((name for name, parameter in _named(parameters)
                   if parameter.numel() and not bool(torch.isfinite(parameter.detach()).all())), None)
    if broken is not None:
        raise JobError(f"{where}: weight {broken} is not finite after training (lr {steps[-1].lr:g}); no "
                       "checkpoint saved: try a lower --lr or a smaller --max-grad-norm")


def _named(parameters: Iterable) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) from named_parameters() or, unnamed, from parameters()."""
    for index, item in enumerate(parameters):
        yield item if isinstance(item, tuple) else (f"#{index}", item)
