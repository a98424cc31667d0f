"""What an iteration must have trained before it saves (engine/train/outcome.py)."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

from cleaner.engine.train.outcome import check_trained
from cleaner.errors import JobError
from cleaner.records import TrainStepRow

NAN, INF = math.nan, math.inf


def _steps(*pairs: tuple[float, float]) -> list[TrainStepRow]:
    """Step rows with these (loss, grad_norm)."""
    return [TrainStepRow(iteration=2, step=index, optimizer_step=index, loss=loss, clip_fraction=0.0, approx_kl=0.0,
                         entropy=0.0, grad_norm=grad_norm, lr=1e-4, tokens=10)
            for index, (loss, grad_norm) in enumerate(pairs)]


def _weights(value: float = 0.5) -> list[tuple[str, torch.nn.Parameter]]:
    return [("layer.weight", torch.nn.Parameter(torch.full((2, 2), value)))]


@pytest.mark.parametrize("steps", [
    _steps((0.3, 1.2)), _steps((NAN, NAN), (0.2, 0.9)), _steps((0.3, INF), (0.2, 0.9)),  # one step trained
    [],  # nothing to train on: the policy is saved unchanged, by design
])
def test_an_iteration_that_trained_something_saves(steps):
    check_trained(steps, _weights(), 2, loss_scaled=False)


@pytest.mark.parametrize("scaled", [False, True])
def test_a_loss_never_finite_fails_whatever_the_scale(scaled):
    with pytest.raises(JobError, match="iteration 2: the loss is not finite at any of its 2 steps"):
        check_trained(_steps((NAN, NAN), (INF, NAN)), _weights(), 2, loss_scaled=scaled)


def test_every_step_skipped_fails_without_a_loss_scale():
    with pytest.raises(JobError, match="every one of its 3 steps was skipped"):
        check_trained(_steps((0.3, NAN), (0.2, INF), (0.1, NAN)), _weights(), 2, loss_scaled=False)


def test_every_step_skipped_by_float16s_scale_search_warns(caplog):
    with caplog.at_level(logging.WARNING):
        check_trained(_steps((0.3, INF), (0.2, INF)), _weights(), 2, loss_scaled=True)
    assert "all 2 steps overflowed float16's loss scale" in caplog.text


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_weights_that_are_no_longer_finite_fail_by_name(value):
    weights = [("a.weight", torch.nn.Parameter(torch.ones(3))), ("b.bias", torch.nn.Parameter(torch.tensor([0.0, value])))]
    with pytest.raises(JobError, match="weight b.bias is not finite after training"):
        check_trained(_steps((0.3, 1.0)), weights, 2, loss_scaled=False)


def test_steps_without_a_loss_token_save_with_a_warning(caplog):
    """Rejection emptied every row (verl keeps them, zero-masked): nothing to train on, as an
    iteration without rows, so it saves, and says so."""
    steps = [dataclasses.replace(step, tokens=0) for step in _steps((0.0, 0.0), (0.0, 0.0))]
    with caplog.at_level(logging.WARNING):
        check_trained(steps, _weights(), 2, loss_scaled=False)
    assert "none of its 2 steps had a loss token" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_trained(_steps((0.0, 0.0)), _weights(), 2, loss_scaled=False)
    assert caplog.text == ""
