"""Writer locks (cleaner/warehouse/lock.py): one writer per warehouse iteration and phase, refused at
once with the holder named, a dead holder's lock taken over; the run directory's lock taken before
the demo deletes anything. Holders are real processes: a Python process that takes the lock and
waits, or a real `cleaner collect`."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time

import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.config import PurifyConfig, TrainConfig
from cleaner.engine.purify.job import PurifyRequest, purify_job
from cleaner.engine.train.job import TrainRequest, train_job
from cleaner.warehouse import Warehouse
from cleaner.warehouse.compact import compact
from cleaner.warehouse.lock import LockHeld, holder_of, phase_lock_path
from tests.helpers import cli, tree_digest

runner = CliRunner()

def _refusal(root, phase: str, lock: str, pid: int) -> str:
    """The start of the line a refused writer prints, up to the holder's start time."""
    return f"{root}: another process is {phase} (it holds {lock}: pid {pid} on {socket.gethostname()} since "


def test_a_second_collect_of_an_iteration_is_refused_at_once_naming_the_holder(tmp_path, holder):
    root = tmp_path / "wh"
    process = holder("collect:0:", root)
    started = time.monotonic()
    result = CliRunner().invoke(app, ["collect", "-w", str(root), "--iteration", "0", "--prompts", "2",
                                      "--group-size", "2"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    line = " ".join(result.output.split())  # rich wraps the one line
    assert line.count("error:") == 1
    assert line.startswith("error: " + _refusal(root, "collecting iteration 0", "collect-iteration=0.lock",
                                                process.pid))
    assert line.endswith("; wait for it to end (then --resume finishes what is left), or collect another --iteration")
    assert time.monotonic() - started < 10  # refused before any model is loaded or rollout generated
    assert not (root / "rollouts").exists() and not (root / "configs").exists()


def test_a_dead_holders_lock_is_taken_over_and_the_live_holder_is_recorded(tmp_path, holder, caplog):
    root = tmp_path / "wh"
    process = holder("collect:3:", root)
    path = phase_lock_path(root, "collect", 3)
    recorded = holder_of(path)
    assert (recorded.pid, recorded.host) == (process.pid, socket.gethostname())
    with pytest.raises(LockHeld, match="another process is collecting iteration 3"):
        with Warehouse(root).writer("collect", 3):
            pass
    os.kill(process.pid, signal.SIGKILL)  # dies holding it: the kernel releases it, the record stays
    process.wait()
    assert holder_of(path).pid == process.pid
    with caplog.at_level(logging.WARNING, logger="cleaner.warehouse.lock"):
        with Warehouse(root).writer("collect", 3):
            assert holder_of(path).pid == os.getpid()
    assert [r.getMessage() for r in caplog.records] == [
        f"took over {path} from {recorded.describe()} (that process is gone)"]
    assert holder_of(path) is None and path.read_text() == ""  # released normally: records nobody


def test_shards_write_side_by_side_and_exclude_the_whole_iteration(tmp_path, holder):
    root = tmp_path / "wh"
    first = holder("purify:0:0/2", root)
    with Warehouse(root).writer("purify", 0, (1, 2)):  # the other shard: at once
        pass
    with pytest.raises(LockHeld) as same:
        with Warehouse(root).writer("purify", 0, (0, 2)):
            pass
    assert str(same.value).startswith(_refusal(root, "purifying iteration 0 shard 0/2",
                                               "purify-iteration=0-shard=0of2.lock", first.pid))
    second = holder("purify:0:1/2", root)
    with pytest.raises(LockHeld) as whole:
        with Warehouse(root).writer("purify", 0):
            pass
    message = str(whole.value)
    assert message.startswith(f"{root}: another process is purifying iteration 0 (shards of it hold "
                              f"purify-iteration=0-shard=0of2.lock: pid {first.pid} on ")
    assert f"purify-iteration=0-shard=1of2.lock: pid {second.pid} on " in message
    with Warehouse(root).writer("purify", 1), Warehouse(root).writer("collect", 0):  # other iteration, phase
        pass


def test_purify_and_train_are_refused_before_any_work(tmp_path, holder, tiny_qwen3_dir):
    root = tmp_path / "wh"
    purifier = holder("purify:0:", root)
    with pytest.raises(LockHeld, match=f"another process is purifying iteration 0 .*pid {purifier.pid} on "):
        purify_job(Warehouse(root), PurifyRequest(0, (PurifyConfig(),)), progress=False)
    trainer = holder("train:0:", root)
    request = TrainRequest(0, "abcd", tiny_qwen3_dir, tmp_path / "out", TrainConfig())
    with pytest.raises(LockHeld, match=f"another process is training on iteration 0 .*pid {trainer.pid} on .*"
                                       "training the same config into the same --out again replaces"):
        train_job(Warehouse(root), request, progress=False)
    assert not (tmp_path / "out").exists()


def test_purify_refuses_an_iteration_being_collected_or_left_incomplete(tmp_path, random_policy):
    """A real `cleaner collect` running, then SIGKILLed: purify refuses in one line while it runs
    and while its iteration lacks rollouts it planned; after --resume it purifies; and train refuses
    an iteration whose purify covers only part of it."""
    root = tmp_path / "wh"
    args = ["collect", "-w", str(root), "--prompts", "6", "--group-size", "2", "--batch-rollouts", "2",
            "--max-concurrent-rollouts", "2", "--model", str(random_policy), "--max-turns", "2",
            "--max-new-tokens", "48", "--max-response-tokens", "96", "--sandbox-workers", "1"]
    collecting = subprocess.Popen(cli(*args), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        parts = root / "rollouts" / "iteration=0"
        deadline = time.monotonic() + 120
        while not list(parts.glob("part-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.05)
        running = runner.invoke(app, ["purify", "-w", str(root)])
        output = " ".join(running.output.split())
        assert running.exit_code == 1 and "iteration 0 is being collected" in output, output
        assert f"pid {collecting.pid}" in output and "wait for the collection to end, then run this again" in output
    finally:
        os.kill(collecting.pid, signal.SIGKILL)
        collecting.wait()
    stored = len(Warehouse(root).rollout_ids(0))
    assert 0 < stored < 12, "killed too late to test an incomplete iteration"
    incomplete = runner.invoke(app, ["purify", "-w", str(root)])
    output = " ".join(incomplete.output.split())
    assert incomplete.exit_code == 1 and f"iteration 0 holds {stored} of the 12 rollouts its collection planned" in output
    assert "cleaner collect --iteration 0 --resume" in output and not (root / "purified").exists()
    assert subprocess.run(cli(*args, "--resume"), capture_output=True).returncode == 0
    assert runner.invoke(app, ["purify", "-w", str(root), "--shard", "0/2"]).exit_code == 0  # half of it
    [(config_id,)] = Warehouse(root).connect().sql("SELECT DISTINCT config_id FROM purified").fetchall()
    partly = runner.invoke(app, ["train", "-w", str(root), "--iteration", "0", "--config-id", config_id,
                                 "--policy", str(random_policy), "--out", str(tmp_path / "out")])
    output = " ".join(partly.output.split())
    assert partly.exit_code == 1 and "rows under purify config" in output and "of its 12 rollouts" in output
    assert runner.invoke(app, ["purify", "-w", str(root)]).exit_code == 0  # the rest
    trained = runner.invoke(app, ["train", "-w", str(root), "--iteration", "0", "--config-id", config_id,
                                  "--policy", str(random_policy), "--out", str(tmp_path / "out")])
    assert trained.exit_code == 0, trained.output


def test_a_refused_compaction_names_the_holder(tmp_path, holder):
    root = tmp_path / "wh"
    root.mkdir()
    process = holder("compact", root)
    result = CliRunner().invoke(app, ["compact", "-w", str(root)])
    assert result.exit_code == 1
    assert " ".join(result.output.split()).startswith(
        f"error: {root}: another `cleaner compact` is running (it holds .compact.lock: pid {process.pid} on ")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert compact(root).merges == ()  # taken over


def test_a_second_demo_deletes_nothing_of_a_running_one(tmp_path, holder):
    """The demo takes the run directory's lock before it deletes the previous demo's files."""
    run_dir = tmp_path / "demo"
    (run_dir / "warehouse" / "rollouts").mkdir(parents=True)
    (run_dir / "checkpoints" / "iteration-1").mkdir(parents=True)
    (run_dir / "checkpoints" / "iteration-1" / "model.safetensors").write_bytes(b"weights")
    process = holder("run", run_dir)
    before = tree_digest(run_dir)
    result = CliRunner().invoke(app, ["demo", "--run-dir", str(run_dir), "--iterations", "1", "--prompts", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert " ".join(result.output.split()).startswith(
        f"error: {run_dir}: another process is running this run (it holds .run.lock: pid {process.pid} on ")
    assert tree_digest(run_dir) == before


@pytest.mark.slow
def test_two_collects_of_one_iteration_store_each_rollout_once(tmp_path):
    """The issue's repro: two `cleaner collect` of iteration 0 started together; one collects, the
    other is refused at once in one line; every rollout is stored once."""
    root = tmp_path / "wh"
    command = cli("collect", "-w", str(root), "--iteration", "0", "--prompts", "32", "--group-size", "8")
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
    results = [(process.wait(timeout=600), process.stderr.read()) for process in processes]
    assert sorted(code for code, _ in results) == [0, 1]
    refused = next(stderr for code, stderr in results if code == 1)
    errors = [line for line in refused.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another process is collecting iteration 0" in errors[0], refused
    connection = Warehouse(root).connect()
    assert connection.sql("SELECT count(*), count(DISTINCT rollout_id) FROM rollouts").fetchall() == [(256, 256)]

