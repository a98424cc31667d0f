"""Experiment logging: a run's metrics mirrored to TensorBoard and Weights & Biases (docs/architecture.md §13).

The warehouse stays the record; a logger is a dashboard's copy of it, like verl's
`trainer.logger`. `cleaner run --log-to tensorboard --log-to wandb` logs every iteration's row
and every optimiser step's row as the run writes them.

Design decisions:
- One small protocol, `MetricsLogger`. `log_metrics(section, values, step)` is the primitive;
  `log_iteration` and `log_step` put an `iterations` row in section "iteration" at step =
  iteration and a `train_steps` row in section "train" at step = the run-wide optimizer_step.
  Anything else (an eval) logs a section of its own with `log_metrics`:

      with open_loggers(["tensorboard"], out_dir, name="eval") as logger:
          logger.log_metrics("eval/gsm8k", {"avg_at_n": 0.41, "pass_at_4": 0.62}, step=iteration)

- The caller owns a logger: it opens it, hands it to `run_loop`, and closes it (`with`).
- Loggers are lazy: no event file and no W&B run exist before the first metric, so a run that
  fails its checks before collecting leaves nothing behind. A missing package is reported when
  the logger is opened, before the run starts.
- TensorBoard: `torch.utils.tensorboard`'s writer in `<dir>/tensorboard/`, flushed after every
  call so a live TensorBoard shows each iteration as it ends.
- W&B: one W&B run per directory, its id kept in `<dir>/wandb/cleaner-run-id`, so `--resume`
  continues the same W&B run. Each section has its own x axis ("<section>/*" is defined against
  "<section>/step"), as iterations and optimiser steps advance at different rates. Mode: offline
  when asked (`--wandb-offline`), or when WANDB_MODE is unset and no API key is configured
  (neither WANDB_API_KEY nor a netrc entry for the W&B host), so a machine without an account or
  a network still keeps its metrics for `wandb sync`; else whatever WANDB_MODE says (default
  online). The mode goes to `wandb.init`, not into the environment, so nothing else in the
  process sees it changed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import netrc
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from cleaner.errors import CleanerError
from cleaner.records import IterationRow, TrainStepRow

logger = logging.getLogger(__name__)

TARGETS = ("tensorboard", "wandb")
WANDB_HOST = "https://api.wandb.ai"


class LoggingError(CleanerError):
    """A logging target that cannot be used (its package is missing); the message says which."""


class MetricsLogger(Protocol):
    """Where a run's metrics are mirrored; `ScalarLogger` implements the row methods for any sink."""

    def log_metrics(self, section: str, values: Mapping[str, float], step: int) -> None: ...

    def log_iteration(self, row: IterationRow) -> None: ...

    def log_step(self, row: TrainStepRow) -> None: ...

    def close(self) -> None: ...


def row_metrics(row: object, axis: str) -> dict[str, float]:
    """The numeric fields of a row, but its x axis `axis` and its within-iteration `step`
    (W&B's x axis of a section is named "<section>/step"). Empty values (None, or NaN: a rate over
    nothing) are left out rather than drawn as 0."""
    values = {}
    for f in dataclasses.fields(row):
        value = getattr(row, f.name)
        if f.name in (axis, "step") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isnan(value):
            values[f.name] = float(value)
    return values


class ScalarLogger:
    """The rows of a run as scalars; subclasses write `log_metrics` and `close`."""

    def log_metrics(self, section: str, values: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def log_iteration(self, row: IterationRow) -> None:
        self.log_metrics("iteration", row_metrics(row, "iteration"), row.iteration)

    def log_step(self, row: TrainStepRow) -> None:
        self.log_metrics("train", row_metrics(row, "optimizer_step"), row.optimizer_step)

    def close(self) -> None:
        pass

    def __enter__(self) -> ScalarLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NullLogger(ScalarLogger):
    """Logs nothing: `run_loop`'s default."""

    def log_metrics(self, section: str, values: Mapping[str, float], step: int) -> None:
        pass


class FanOut(ScalarLogger):
    """Every call to each of several loggers (`--log-to` given more than once)."""

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers = tuple(loggers)

    def log_metrics(self, section: str, values: Mapping[str, float], step: int) -> None:
        for one in self.loggers:
            one.log_metrics(section, values, step)

    def close(self) -> None:
        for one in self.loggers:
            one.close()


# ---------------------------------------------------------------------------------------------
# TensorBoard


class TensorBoardLogger(ScalarLogger):
    """Scalars "<section>/<name>" at their step, in event files under `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None

    def log_metrics(self, section: str, values: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # optional: tensorboard

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        for name, value in values.items():
            self._writer.add_scalar(f"{section}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# ---------------------------------------------------------------------------------------------
# Weights & Biases


def wandb_mode(offline: bool, environ: Mapping[str, str] = os.environ) -> str | None:
    """The mode to start W&B in: "offline", or None to let wandb follow WANDB_MODE (default online)."""
    if offline:
        return "offline"
    if environ.get("WANDB_MODE") or environ.get("WANDB_API_KEY"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL", WANDB_HOST)).hostname
    try:
        known = netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one wandb could not read either
        known = False
    return None if known else "offline"


class WandbLogger(ScalarLogger):
    """One W&B run per directory; each section plotted against its own "<section>/step"."""

    def __init__(self, directory: Path, *, project: str, name: str, config: Mapping | None = None,
                 offline: bool = False) -> None:
        self.directory = Path(directory)
        self.project, self.name, self.config = project, name, dict(config or {})
        self.mode = wandb_mode(offline)
        self._run = None
        self._sections: set[str] = set()

    def _start(self):
        import wandb  # optional, and slow to import

        id_file = self.directory / "wandb" / "cleaner-run-id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:16])
        if self.mode == "offline":
            logger.info("W&B logs offline to %s; upload it with `wandb sync`", id_file.parent)
        return wandb.init(project=self.project, name=self.name, id=id_file.read_text().strip(),
                          resume="allow", dir=str(self.directory), config=self.config, mode=self.mode,
                          settings=wandb.Settings(console="off"))

    def log_metrics(self, section: str, values: Mapping[str, float], step: int) -> None:
        if self._run is None:
            self._run = self._start()
        if section not in self._sections:
            self._run.define_metric(f"{section}/step")
            self._run.define_metric(f"{section}/*", step_metric=f"{section}/step")
            self._sections.add(section)
        self._run.log({**{f"{section}/{name}": value for name, value in values.items()},
                       f"{section}/step": step})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


# ---------------------------------------------------------------------------------------------
# From the command line


def _require(package: str, target: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise LoggingError(f"--log-to {target} needs the {package} package: pip install 'cleaner[logging]'")


def open_loggers(targets: Sequence[str], directory: Path, *, name: str, config: Mapping | None = None,
                 wandb_project: str = "cleaner", wandb_offline: bool = False) -> ScalarLogger:
    """One logger over `targets` (each of TARGETS, repeats ignored), writing under `directory`;
    a NullLogger for none."""
    loggers: list[ScalarLogger] = []
    for target in dict.fromkeys(targets):
        if target == "tensorboard":
            _require("tensorboard", target)
            loggers.append(TensorBoardLogger(Path(directory) / "tensorboard"))
        elif target == "wandb":
            _require("wandb", target)
            loggers.append(WandbLogger(Path(directory), project=wandb_project, name=name, config=config,
                                       offline=wandb_offline))
        else:
            raise LoggingError(f"--log-to takes {' or '.join(TARGETS)}, got {target!r}")
    if not loggers:
        return NullLogger()
    return loggers[0] if len(loggers) == 1 else FanOut(loggers)
