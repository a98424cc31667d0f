"""Metrics loggers: rows to scalars, TensorBoard event files read back, W&B offline runs read back
(skipped without wandb), and the choice of W&B's mode."""

from __future__ import annotations

import math
import struct
import time
from datetime import datetime
from pathlib import Path

import pytest

from cleaner.records import IterationRow, TrainStepRow
from cleaner.report.tracking import (
    FanOut,
    LoggingError,
    NullLogger,
    TensorBoardLogger,
    WandbLogger,
    open_loggers,
    row_metrics,
    wandb_mode,
)
from cleaner.warehouse import Warehouse
from tests.helpers import scalars

ROW = IterationRow(3, "in", "out", "{}", "{}", "{}", 1.5, 0.5, 2.0, 0.75, math.nan, 0.25, 4, 1,
                   datetime(2026, 1, 1), clean_rollouts=6, clean_accuracy=0.5, recovered_rollouts=2,
                   recovered_accuracy=1.0, unrecovered_rollouts=0, n_gated=1)
STEP = TrainStepRow(3, 1, 9, -0.5, 0.125, 0.01, 2.5, 1.25, 1e-4, 320)


def test_rows_become_their_numeric_fields_without_the_axis_or_empty_values():
    assert row_metrics(ROW, "iteration") == {
        "collect_s": 1.5, "purify_s": 0.5, "train_s": 2.0, "accuracy": 0.75, "failures_per_trajectory": 0.25,
        "n_shallow": 4.0, "n_deep": 1.0, "clean_rollouts": 6.0, "clean_accuracy": 0.5,
        "recovered_rollouts": 2.0, "recovered_accuracy": 1.0, "unrecovered_rollouts": 0.0, "n_gated": 1.0,
    }  # no first_attempt_error_rate (NaN), no empty class's accuracy or advantage, no text
    assert row_metrics(STEP, "optimizer_step") == {
        "iteration": 3.0, "loss": -0.5, "clip_fraction": 0.125, "approx_kl": 0.01, "entropy": 2.5,
        "grad_norm": 1.25, "lr": pytest.approx(1e-4), "tokens": 320.0}


class Recorder:
    def __init__(self):
        self.calls, self.closed = [], False

    def log_metrics(self, section, values, step):
        self.calls.append((section, dict(values), step))

    def close(self):
        self.closed = True


def test_fan_out_sends_rows_to_every_logger_at_their_steps():
    one, two = Recorder(), Recorder()
    with FanOut([one, two]) as both:
        both.log_step(STEP)
        both.log_iteration(ROW)
    assert one.calls == two.calls
    assert [(section, step) for section, _, step in one.calls] == [("train", 9), ("iteration", 3)]
    assert one.closed and two.closed


def test_open_loggers_builds_what_is_asked(tmp_path):
    assert isinstance(open_loggers([], tmp_path, name="x"), NullLogger)
    tensorboard = open_loggers(["tensorboard", "tensorboard"], tmp_path, name="x")
    assert isinstance(tensorboard, TensorBoardLogger) and tensorboard.log_dir == tmp_path / "tensorboard"
    with pytest.raises(LoggingError, match="--log-to takes tensorboard or wandb, got 'mlflow'"):
        open_loggers(["mlflow"], tmp_path, name="x")
    assert not (tmp_path / "tensorboard").exists()  # lazy: nothing written before the first metric


def test_a_run_logs_its_iterations_and_optimiser_steps_to_tensorboard(small_run):
    logged = scalars(small_run / "tensorboard")
    connection = Warehouse(small_run / "warehouse").connect()
    steps = connection.sql("SELECT optimizer_step, iteration, loss, grad_norm FROM train_steps "
                           "ORDER BY optimizer_step").fetchall()
    # 16 rollouts per iteration, mini batches of 8: two optimiser steps per iteration, run-wide numbering
    assert logged["train/iteration"] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]
    assert logged["train/loss"] == [(s, pytest.approx(loss, rel=1e-6)) for s, _, loss, _ in steps]
    assert logged["train/grad_norm"] == [(s, pytest.approx(norm, rel=1e-6)) for s, _, _, norm in steps]
    rows = connection.sql("SELECT iteration, accuracy, n_shallow FROM iterations ORDER BY iteration").fetchall()
    assert logged["iteration/accuracy"] == [(i, pytest.approx(a, rel=1e-6)) for i, a, _ in rows]
    assert logged["iteration/n_shallow"] == [(i, float(n)) for i, _, n in rows]
    assert "iteration/iteration" not in logged and "train/optimizer_step" not in logged  # the axes


# ---------------------------------------------------------------------------------------------
# Weights & Biases


def test_wandb_is_offline_when_asked_or_when_no_key_is_configured(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert wandb_mode(True, {"WANDB_API_KEY": "k"}) == "offline"
    assert wandb_mode(False, {}) == "offline"
    assert wandb_mode(False, {"WANDB_API_KEY": "k"}) is None  # wandb's default: online
    assert wandb_mode(False, {"WANDB_MODE": "disabled"}) is None  # the user's WANDB_MODE wins
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password not-a-real-key\n")
    netrc.chmod(0o600)
    assert wandb_mode(False, {}) is None  # `wandb login` wrote a key
    assert wandb_mode(False, {"WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"  # not for this host


def wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline run file (W&B's LevelDB-style log: a 7-byte header, then
    32 KiB blocks of chunks, each with a 7-byte header of crc, length and type)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, records = run_file.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a chunk header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_history(run_file: Path, timeout_s: float = 30.0) -> list[dict[str, str]]:
    """The logged rows of a finished offline run, without W&B's own `_` keys. W&B's service writes
    the file on its own after `finish` returns, so this waits for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_file)):
        assert time.monotonic() < deadline, f"{run_file}: no exit record after {timeout_s} s"
        time.sleep(0.1)
    history = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            history.append({key: value for key, value in items.items() if not key.startswith("_")})
    return history


def test_wandb_offline_run_holds_every_metric_at_its_step_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    with WandbLogger(tmp_path / "run", project="cleaner-test", name="run", config={"lr": 1e-4},
                     offline=True) as logger:
        logger.log_step(STEP)
        logger.log_iteration(ROW)
    run_id = (tmp_path / "run" / "wandb" / "cleaner-run-id").read_text()
    (run_file,) = (tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history = wandb_history(run_file)
    assert [(h["train/step"], h["train/loss"]) for h in history if "train/step" in h] == [("9", "-0.5")]
    (iteration,) = [h for h in history if "iteration/step" in h]
    assert iteration["iteration/step"] == "3" and iteration["iteration/accuracy"] == "0.75"
    assert "iteration/first_attempt_error_rate" not in iteration  # NaN is left out
    with WandbLogger(tmp_path / "run", project="cleaner-test", name="run", offline=True) as again:
        again.log_iteration(ROW)  # --resume: the same W&B run id
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert runs and all(run.name.endswith(f"-{run_id}") for run in runs)
