"""`cleaner run` on two ranks: `torchrun --nproc-per-node 2 cleaner run --engine deepspeed` (ZeRO-2,
the torch backend, gloo on CPU; docs/architecture.md §9) against one process with the same seed.

The run: the tiny policy, 4 prompts of 2 samples per iteration, 2 iterations of 2 optimiser steps.
With seed 4 the ranks' shares are none and 4 prompts in iteration 0 (rank 0 collects nothing, yet
writes the iteration's row from rank 1's rows) and 3 and 1 in iteration 1 (so both ranks collect
with the checkpoint they adopted). A forward's float rounding depends on the thread count, so
every process runs with one thread.

The reference is the plain single-process run (the torch engine). What differs is float32
rounding only: a rank's scorer packs other rows into its forwards than one process does, which
moves old log-probs by up to ~1e-5, and Adam turns such noise in a near-zero gradient into a
weight change of a few percent of the learning rate (the drift per learning rate: BENCHMARKS.md,
"One run on many ranks"). So the learning rate is 5e-5, and the weights must move by more than the
tolerance for the comparison to mean something.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cleaner.config import DEFAULT_POLICY, CollectConfig, Shard
from cleaner.engine.collect.job import load_tasks
from cleaner.engine.model.loading import policy_version_of
from cleaner.loop.iterations import RUN_LOCK, checkpoint_dir
from cleaner.warehouse import Warehouse
from tests.helpers import cli, wait_for

# deepspeed runs in the launched ranks only; this process needs to know it is there
pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="needs deepspeed: pip install 'cleaner[deepspeed]'")
ZERO2 = Path(__file__).resolve().parents[2] / "examples" / "deepspeed" / "zero2.json"
ARGS = ("--iterations", "2", "--prompts", "4", "--group-size", "2", "--max-turns", "3", "--max-new-tokens",
        "64", "--lr", "5e-5", "--mini-batch-size", "4", "--micro-batch-size", "1", "--batch-rollouts", "2",
        "--sandbox-workers", "1", "--seed", "4",
        # two in flight, so a kill point between parts exists (eight at once finish in one burst of parts)
        "--max-concurrent-rollouts", "2")
DEEPSPEED = ("--engine", "deepspeed", "--deepspeed-config", str(ZERO2))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
TOLERANCE = 1e-5


def torchrun(*args: str) -> list[str]:
    """`torchrun --nproc-per-node 2 cleaner ARGS` on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "cleaner.cli", *args]


def _kill_job(process: subprocess.Popen) -> None:
    """SIGKILL torchrun, its ranks and everything they started, at once (each rank runs in a
    session of its own, so the launcher's process group does not hold them)."""
    import psutil  # a dependency of deepspeed, which this module needs anyway

    everyone = [process.pid] + [child.pid for child in psutil.Process(process.pid).children(recursive=True)]
    for pid in everyone:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _parts(run_dir: Path, dataset: str, partition: str = "") -> bool:
    return any((run_dir / "warehouse" / dataset / partition).glob("part-*.parquet"))


def _contents(run_dir: Path) -> dict:
    """What the comparison looks at, in a fixed order; float columns apart, to compare approximately."""
    sql = Warehouse(run_dir / "warehouse").connect().sql
    return {
        "rollouts": sql("SELECT rollout_id, reward, correct, finish_reason, n_failed_calls FROM rollouts "
                        "ORDER BY rollout_id").fetchall(),
        "tokens": sql("SELECT rollout_id, seq, kind, token_ids FROM segments ORDER BY rollout_id, seq").fetchall(),
        "logprobs": sql("SELECT logprobs FROM segments WHERE logprobs IS NOT NULL ORDER BY rollout_id, seq").fetchall(),
        "rows": sql("SELECT iteration, rollout_id, token_ids, loss_mask, advantage FROM purified "
                    "ORDER BY iteration, rollout_id, token_ids").fetchall(),
        "old_logprobs": sql("SELECT old_logprobs FROM purified ORDER BY iteration, rollout_id, token_ids").fetchall(),
        # the collect summary, the merges and the premise over the whole iteration
        "iterations": sql("SELECT * EXCLUDE (policy_in, policy_out, collect_config_json, train_config_json, "
                          "collect_s, purify_s, train_s, created_at) FROM iterations ORDER BY iteration").fetchall(),
        "steps": sql("SELECT iteration, step, optimizer_step, lr, tokens FROM train_steps "
                     "ORDER BY optimizer_step").fetchall(),
        "losses": sql("SELECT loss FROM train_steps ORDER BY optimizer_step").fetchall(),
    }


def _close(a: list, b: list, tolerance: float) -> float:
    """The largest difference between two lists of rows of float lists (or floats)."""
    flat = [(x, y) for (p,), (q,) in zip(a, b, strict=True)
            for x, y in zip(p if isinstance(p, list) else [p], q if isinstance(q, list) else [q], strict=True)]
    difference = max(abs(x - y) for x, y in flat)
    assert difference < tolerance
    return difference


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def _max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.slow
def test_two_ranks_killed_and_resumed_end_as_one_process_does(tmp_path):
    collect = CollectConfig(n_prompts=4, seed=4)
    shares = [[sum(Shard(rank, 2).owns(task.prompt_id) for task in load_tasks(dataclasses.replace(collect, iteration=i)))
               for rank in range(2)] for i in range(2)]
    assert shares == [[0, 4], [3, 1]]  # the layout the module docstring describes
    reference, ranks = tmp_path / "one-process", tmp_path / "two-ranks"
    alone = subprocess.run(cli("run", "--run-dir", str(reference), *ARGS), capture_output=True, text=True,
                           env=ENV, timeout=600)
    assert alone.returncode == 0, alone.stderr[-5000:]

    job = torchrun("run", "--run-dir", str(ranks), *ARGS, *DEEPSPEED)
    process = subprocess.Popen(job, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    wait_for(lambda: _parts(ranks, "rollouts", "iteration=0"), 300, process)
    _kill_job(process)  # in the middle of iteration 0's collection
    assert len(Warehouse(ranks / "warehouse").rollout_ids(0)) < 8, "killed too late to test resume"
    process = subprocess.Popen([*job, "--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    wait_for(lambda: _parts(ranks, "iterations"), 300, process)
    _kill_job(process)  # between iterations: iteration 0 complete, iteration 1 started or about to
    assert [row.iteration for row in Warehouse(ranks / "warehouse").read_iterations()] == [0]
    finished = subprocess.run([*job, "--resume"], capture_output=True, text=True, env=ENV, timeout=600)
    assert finished.returncode == 0, finished.stderr[-20000:]
    # rank 0 alone reports: the iteration it completed, then the table
    assert finished.stdout.count("iteration 1: accuracy") == 1 and "iteration 0: accuracy" not in finished.stdout
    assert "Traceback" not in finished.stderr

    expected, found = _contents(reference), _contents(ranks)
    # token for token: every rollout, segment and purified row, the steps and the iterations' figures
    for key in ("rollouts", "tokens", "rows", "iterations", "steps"):
        assert found[key] == expected[key], key
    assert len(found["rollouts"]) == 16 and [s[:3] for s in found["steps"]] == [(0, 0, 0), (0, 1, 1), (1, 0, 2),
                                                                                (1, 1, 3)]
    # float32 rounding of forwards over other batches (module docstring)
    print("behaviour log-probs", _close(found["logprobs"], expected["logprobs"], 1e-4),
          "old log-probs", _close(found["old_logprobs"], expected["old_logprobs"], 1e-4),
          "losses", _close(found["losses"], expected["losses"], 1e-4))
    # every rank served the checkpoint of iteration 0 before collecting iteration 1
    second = Warehouse(ranks / "warehouse").read_rollouts(1)
    assert {Shard(1, 2).owns(rollout.prompt_id) for rollout in second} == {False, True}  # both collected
    assert {rollout.policy_version for rollout in second} == {policy_version_of(checkpoint_dir(ranks, 0))}
    final, initial = _weights(checkpoint_dir(ranks, 1)), _weights(DEFAULT_POLICY)
    difference = _max_difference(final, _weights(checkpoint_dir(reference, 1)))
    moved = _max_difference(final, initial)
    print(f"final weights: {difference:.2e} from the single process's; moved {moved:.2e} from the policy")
    assert difference < TOLERANCE and moved > 5 * TOLERANCE


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]


FAULTY_RANK = """
import os
import cleaner.loop.iterations
from cleaner.errors import JobError
if os.environ["RANK"] == "1":  # a fault on this rank alone, in its collection
    def collect_job(*args, **kwargs):
        raise {error}("injected fault: rank 1 cannot collect")
    cleaner.loop.iterations.collect_job = collect_job
from cleaner.cli import app
app()
"""


@pytest.mark.slow
def test_a_second_job_or_a_failing_rank_ends_every_rank_at_once(tmp_path):
    run_dir = tmp_path / "run"
    args = ("run", "--run-dir", str(run_dir), *ARGS, *DEEPSPEED)
    run_dir.mkdir()
    with open(run_dir / RUN_LOCK, "a") as other:  # another job's rank 0 holds the run directory
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused = subprocess.run(torchrun(*args, "--resume"), capture_output=True, text=True, env=ENV,
                                 timeout=300)
    assert refused.returncode != 0
    assert _error_lines(refused) == [f"error: {run_dir}: another process is running this run (it holds "
                                     f"{RUN_LOCK}); wait for it to end, or choose another --run-dir"]
    assert not (run_dir / "warehouse").exists()

    # rank 1 fails in its collection while rank 0 (whose share of iteration 0 is empty) waits for
    # it: an expected error is agreed on and reported once; a bug ends rank 1 with its traceback,
    # and torchrun stops rank 0
    agreed = ["error: rank 1 of 2: injected fault: rank 1 cannot collect"]
    for error, expected in (("JobError", agreed), ("RuntimeError", [])):
        script, run_dir = tmp_path / f"faulty_{error}.py", tmp_path / f"run-{error}"
        script.write_text(FAULTY_RANK.format(error=error))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(script), "run", "--run-dir", str(run_dir), *ARGS, *DEEPSPEED]
        failed = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)
        assert failed.returncode != 0 and _error_lines(failed) == expected, failed.stderr[-5000:]
        assert error == "JobError" or "RuntimeError: injected fault: rank 1 cannot collect" in failed.stderr
        assert Warehouse(run_dir / "warehouse").read_iterations() == []
