"""`cleaner run`: the loop over iterations, idempotence, and SIGKILL + --resume."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cleaner.config import CollectConfig, RunConfig, TrainConfig
from cleaner.engine.model.loading import policy_version_of
from cleaner.errors import JobError
from cleaner.loop.iterations import RUN_LOCK, checkpoint_dir, clear_run, run_loop
from cleaner.loop.ranks import Ranks, RanksError
from cleaner.sandbox import SandboxConfig
from cleaner.warehouse import Warehouse, WarehouseError
from tests.helpers import assert_same_collection, cli, comparable, sigkill_when, tree_digest


def _config(run_dir: Path, policy: Path, iterations: int = 2) -> RunConfig:
    return RunConfig(
        run_dir=str(run_dir), iterations=iterations,
        collect=CollectConfig(model=str(policy), n_prompts=2, group_size=2, max_turns=2,
                              max_new_tokens=12, max_response_tokens=24,
                              sandbox=SandboxConfig(workers=1)),
        train=TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2),
    )


def test_run_loop_chains_iterations_and_is_idempotent(tmp_path, random_policy):
    config = _config(tmp_path / "run", random_policy)
    rows = run_loop(config, progress=False)
    assert [r.iteration for r in rows] == [0, 1]
    first, second = checkpoint_dir(tmp_path / "run", 0), checkpoint_dir(tmp_path / "run", 1)
    assert (first / "model.safetensors").exists() and (second / "model.safetensors").exists()
    assert rows[1].policy_in == str(first) and rows[1].policy_out == str(second)
    warehouse = Warehouse(tmp_path / "run" / "warehouse")
    # Iteration 1 was collected by the policy trained in iteration 0, without a reload.
    versions = {r.policy_version for r in warehouse.read_rollouts(1)}
    assert versions == {policy_version_of(first)}
    assert {r.policy_version for r in warehouse.read_rollouts(0)} != versions
    with pytest.raises(JobError, match="--resume"):
        run_loop(config, progress=False)
    run_loop(config, resume=True, progress=False)  # nothing left to do: no new rows
    connection = warehouse.connect()
    assert connection.sql("SELECT count(*) FROM iterations").fetchall() == [(2,)]
    assert connection.sql("SELECT count(*), count(DISTINCT rollout_id) FROM rollouts").fetchall() == [(8, 8)]
    assert connection.sql("SELECT count(*) FROM purified").fetchall() == [(8,)]


def test_a_run_dir_given_relative_runs_its_second_iteration(tmp_path, random_policy, monkeypatch):
    """`make demo`'s `runs/demo`: the checkpoint the loop's backend adopts is named relative to the
    working directory, the one iteration 1's collect stored resolved; purify takes them as one."""
    monkeypatch.chdir(tmp_path)
    rows = run_loop(_config(Path("run"), random_policy), progress=False)
    assert [r.iteration for r in rows] == [0, 1]


def test_a_second_process_on_the_same_run_dir_fails_at_once_and_writes_nothing(tmp_path, random_policy):
    """Two processes driving one run would collect the same iteration twice (duplicate rollouts);
    the second finds the run directory's lock held and stops before touching the warehouse."""
    config = _config(tmp_path / "run", random_policy)
    (tmp_path / "run").mkdir()
    with open(tmp_path / "run" / RUN_LOCK, "a") as other:  # another process's open lock file
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(WarehouseError, match="another process is running this run"):
            run_loop(config, resume=True, progress=False)
        assert not (tmp_path / "run" / "warehouse").exists()
        result = subprocess.run(cli("run", "--run-dir", str(tmp_path / "run"), "--model", str(random_policy),
                                    "--resume"), capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and "another process is running this run" in result.stderr
        assert "Traceback" not in result.stderr
        # refused before the model stack loads (a run or a demo on a busy directory answers at once)
        probe = ("import sys\nfrom cleaner.cli import app\ntry:\n    app(sys.argv[1:])\n"
                 "except SystemExit as end:\n    print(end.code, 'torch' in sys.modules)")
        for command in (["run", "--model", str(random_policy), "--resume"], ["demo"]):
            result = subprocess.run([sys.executable, "-c", probe, *command, "--run-dir", str(tmp_path / "run")],
                                    capture_output=True, text=True, timeout=120)
            assert "another process is running this run" in result.stderr
            assert result.stdout.split() == ["1", "False"], (command, result.stdout)
    # released (as when the holder dies): the run goes on
    rows = run_loop(dataclasses.replace(config, iterations=1), resume=True, progress=False)
    assert [row.iteration for row in rows] == [0]


def test_several_ranks_without_deepspeed_or_on_a_named_gpu_are_refused_before_any_work_rank_0_printing(tmp_path, random_policy):
    """Checked before the ranks join their group, so a misconfigured job ends at once; the error is
    the same on every rank, so rank 0 prints it and the others exit 0 (a rank exiting non-zero first
    would make torchrun stop rank 0 before it prints); the job fails with rank 0's code."""
    from typer.testing import CliRunner

    from cleaner.cli import app

    config = _config(tmp_path / "run", random_policy)
    with pytest.raises(RanksError, match="^cleaner run was launched on 2 ranks, which train together with "
                                         "DeepSpeed: pass --engine deepspeed"):
        run_loop(config, ranks=Ranks(1, 2, 1), progress=False)
    deepspeed = dataclasses.replace(config, train=dataclasses.replace(
        config.train, engine="deepspeed", deepspeed_config=str(tmp_path / "ds.json")))
    deepspeed = dataclasses.replace(deepspeed, collect=dataclasses.replace(deepspeed.collect, device="cuda:1"))
    with pytest.raises(RanksError, match="^--device cuda:1: on several ranks each rank takes the GPU of its "
                                         "LOCAL_RANK; pass --device cuda$"):
        run_loop(deepspeed, ranks=Ranks(0, 2, 0), progress=False)
    whitened = dataclasses.replace(deepspeed, collect=config.collect, purify=dataclasses.replace(
        config.purify, adv_estimator="reinforce_plus_plus_baseline"))
    with pytest.raises(RanksError, match=r"^cleaner run on 2 ranks \(each purifies its shard\): adv_estimator "
                                         "reinforce_plus_plus_baseline whitens the advantages over the whole iteration"):
        run_loop(whitened, ranks=Ranks(1, 2, 1), progress=False)
    assert not (tmp_path / "run").exists()
    args = ["run", "--run-dir", str(tmp_path / "run"), "--model", str(random_policy)]
    for rank, code in ((0, 1), (1, 0)):
        result = CliRunner().invoke(app, args, env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)})
        assert result.exit_code == code, result.output
        printed = " ".join(result.output.split())
        assert printed == ("error: cleaner run was launched on 2 ranks, which train together with DeepSpeed: pass "
                           "--engine deepspeed --deepspeed-config FILE, or start one process" if rank == 0 else "")
    assert not (tmp_path / "run").exists()


def test_a_backend_in_other_processes_trains_a_model_of_its_own_and_reloads_each_checkpoint(tmp_path, random_policy):
    from tests.helpers import StandIn

    server = StandIn(str(random_policy))  # stands in for SGLang: /generate, /update_weights_from_disk
    try:
        config = _config(tmp_path / "run", random_policy)
        config = dataclasses.replace(config, collect=dataclasses.replace(
            config.collect, backend="sglang", sglang_url=server.url))
        rows = run_loop(config, progress=False)
    finally:
        server.close()
    first, second = checkpoint_dir(tmp_path / "run", 0), checkpoint_dir(tmp_path / "run", 1)
    assert [r.policy_out for r in rows] == [str(first), str(second)]
    # the server was already serving the policy; after each iteration it loads the new checkpoint
    assert server.paths("/update_weights_from_disk") == [{"model_path": str(first)}, {"model_path": str(second)}]
    warehouse = Warehouse(tmp_path / "run" / "warehouse")
    assert {r.policy_version for r in warehouse.read_rollouts(1)} == {policy_version_of(first)}
    assert policy_version_of(second) != policy_version_of(first)  # the trainer's own model moved on
    steps = [step for (step,) in warehouse.connect().sql(
        "SELECT optimizer_step FROM train_steps ORDER BY iteration, step").fetchall()]
    assert steps == list(range(len(steps))) and len(steps) >= 2  # one optimiser for the run


def test_an_engine_on_the_trainers_gpu_gives_its_memory_up_while_the_trainer_trains(tmp_path, random_policy,
                                                                                     monkeypatch):
    """The sequence of a run on one GPU, with the engine's device stood in for: before each train step
    the engine releases its memory and the model kept from the last iteration comes to the train
    device with its optimiser; after it, both go to the host, then the engine resumes and adopts the
    new checkpoint. The training itself is the same as without (the same checkpoints)."""
    import cleaner.loop.iterations as iterations
    from cleaner.engine.model.sglang_server import SGLangServerBackend
    from tests.helpers import StandIn

    events: list[tuple] = []
    original_move, original_train = iterations.move_training_state, iterations.train_job
    monkeypatch.setattr(SGLangServerBackend, "occupies", lambda self, device: True)
    monkeypatch.setattr(SGLangServerBackend, "release_memory", lambda self: events.append(("release",)))
    monkeypatch.setattr(SGLangServerBackend, "resume_memory", lambda self: events.append(("resume",)))
    monkeypatch.setattr(iterations, "move_training_state", lambda model, optimization, device: (
        events.append(("move", device, optimization is not None)), original_move(model, optimization, device)))
    monkeypatch.setattr(iterations, "train_job", lambda *args, **kwargs: (
        events.append(("train", kwargs["model"] is not None)), original_train(*args, **kwargs))[1])

    def run(run_dir):
        server = StandIn(str(random_policy))
        try:
            config = _config(run_dir, random_policy)
            config = dataclasses.replace(config, collect=dataclasses.replace(
                config.collect, backend="sglang", sglang_url=server.url))
            rows = run_loop(config, progress=False)
        finally:
            server.close()
        adopted = server.paths("/update_weights_from_disk")
        return rows, adopted

    rows, adopted = run(tmp_path / "aside")
    assert events == [("release",), ("train", False), ("move", "cpu", True), ("resume",),
                      ("release",), ("move", "cpu", True), ("train", True), ("move", "cpu", True), ("resume",)]
    assert len(adopted) == 2  # each resume is followed by the new checkpoint's load
    monkeypatch.setattr(SGLangServerBackend, "occupies", lambda self, device: False)
    events.clear()
    plain, _ = run(tmp_path / "plain")
    assert [e[0] for e in events] == ["train", "train"]
    assert [policy_version_of(r.policy_out).split("@")[1] for r in rows] == [
        policy_version_of(r.policy_out).split("@")[1] for r in plain]


def test_sigkill_collect_then_resume_has_every_rollout_once(tmp_path, random_policy):
    warehouse = tmp_path / "wh"
    # three rollouts in flight, parts of two: parts are committed while others still run
    args = ["collect", "-w", str(warehouse), "--prompts", "6", "--group-size", "2", "--batch-rollouts", "2",
            "--max-concurrent-rollouts", "3", "--model", str(random_policy), "--max-turns", "2",
            "--max-new-tokens", "48", "--max-response-tokens", "96", "--sandbox-workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}  # the same float rounding
    rollouts_dir = warehouse / "rollouts" / "iteration=0"
    sigkill_when(cli(*args), lambda: len(list(rollouts_dir.glob("part-*.parquet"))) >= 1, 120, env)
    assert len(Warehouse(warehouse).rollout_ids(0)) < 12, "killed too late to test resume"
    refused = subprocess.run(cli(*args), capture_output=True, text=True, env=env)
    assert refused.returncode == 1 and "--resume" in refused.stderr
    # resumed with another schedule: how rollouts are scheduled is not part of the config
    finished = subprocess.run(cli(*args, "--max-concurrent-rollouts", "5", "--batch-rollouts", "3", "--resume"),
                              capture_output=True, text=True, env=env)
    assert finished.returncode == 0, finished.stderr
    connection = Warehouse(warehouse).connect()
    assert connection.sql("SELECT count(*), count(DISTINCT rollout_id) FROM rollouts").fetchall() == [(12, 12)]
    # Every visible segment belongs to a committed rollout, and no rollout has two copies of a seq.
    assert connection.sql(
        "SELECT count(*) FROM segments WHERE rollout_id NOT IN (SELECT rollout_id FROM rollouts)"
    ).fetchall() == [(0,)]
    assert connection.sql(
        "SELECT count(*) FROM (SELECT rollout_id, seq FROM segments GROUP BY 1, 2 HAVING count(*) > 1)"
    ).fetchall() == [(0,)]
    uninterrupted = tmp_path / "whole"
    whole = subprocess.run(cli(*args[:2], str(uninterrupted), *args[3:]), capture_output=True, text=True, env=env)
    assert whole.returncode == 0, whole.stderr
    assert_same_collection(_collected(Warehouse(warehouse)), _collected(Warehouse(uninterrupted)))


def _collected(warehouse: Warehouse) -> tuple[list, list]:
    """Iteration 0's rollouts and segments, as collections compare."""
    return comparable(warehouse.read_rollouts(0), warehouse.read_segments(0))


@pytest.mark.slow
def test_run_killed_after_purifying_resumes_to_each_iteration_once(tmp_path, random_policy):
    run_dir = tmp_path / "run"
    args = ["run", "--run-dir", str(run_dir), "--iterations", "2", "--prompts", "2", "--group-size", "2",
            "--model", str(random_policy), "--max-turns", "2", "--max-new-tokens", "24"]
    purified = run_dir / "warehouse" / "purified"
    # killed after purify, before or during training of iteration 0
    sigkill_when(cli(*args), lambda: any(purified.glob("iteration=0/*/part-*.parquet")), 180)
    finished = subprocess.run(cli(*args, "--resume"), capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    connection = Warehouse(run_dir / "warehouse").connect()
    assert connection.sql("SELECT list(iteration ORDER BY iteration) FROM iterations").fetchall() == [([0, 1],)]
    assert connection.sql(
        "SELECT iteration, count(*), count(DISTINCT rollout_id) FROM rollouts GROUP BY 1 ORDER BY 1"
    ).fetchall() == [(0, 4, 4), (1, 4, 4)]
    assert connection.sql("SELECT count(*) FROM purified").fetchall() == [(8,)]
    steps = connection.sql("SELECT iteration, count(*) FROM train_steps GROUP BY 1 ORDER BY 1").fetchall()
    assert [iteration for iteration, _ in steps] == [0, 1]
    assert checkpoint_dir(run_dir, 1).exists()


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.slow
def test_run_killed_at_random_moments_and_resumed_equals_an_uninterrupted_run(tmp_path, random_policy):
    import random

    def args(run_dir: Path) -> list[str]:
        return ["run", "--run-dir", str(run_dir), "--iterations", "3", "--prompts", "2", "--group-size",
                "2", "--model", str(random_policy), "--max-turns", "2", "--max-new-tokens", "24",
                "--lr", "1e-2", "--mini-batch-size", "2", "--warmup-steps", "3", "--sandbox-workers", "1"]

    started = time.monotonic()
    whole = subprocess.run(cli(*args(tmp_path / "whole")), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    duration = time.monotonic() - started
    rng, kills = random.Random(0), 0
    while True:
        resume = ["--resume"] if (tmp_path / "killed").exists() else []
        process = subprocess.Popen(cli(*args(tmp_path / "killed"), *resume),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:  # kill at a random moment of a whole run's span; after 8 kills, let it finish
            process.wait(timeout=rng.uniform(0.2, 0.6) * duration if kills < 8 else None)
            break  # it finished before the kill
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            kills += 1
    assert process.returncode == 0 and kills >= 2, (process.returncode, kills)

    def contents(run_dir: Path):
        connection = Warehouse(run_dir / "warehouse").connect()
        rollouts = connection.sql("SELECT rollout_id, reward, finish_reason, policy_version FROM rollouts "
                                  "ORDER BY rollout_id").fetchall()
        segments = connection.sql("SELECT rollout_id, seq, token_ids, logprobs FROM segments "
                                  "ORDER BY rollout_id, seq").fetchall()
        iterations = connection.sql("SELECT iteration FROM iterations ORDER BY 1").fetchall()
        steps = connection.sql("SELECT iteration, step, optimizer_step, lr FROM train_steps "
                               "ORDER BY optimizer_step").fetchall()
        return rollouts, segments, iterations, steps

    rollouts, segments, iterations, steps = contents(tmp_path / "killed")
    assert (rollouts, segments) == contents(tmp_path / "whole")[:2]
    assert iterations == [(0,), (1,), (2,)]
    # Each iteration's steps are written once, after its checkpoint: a retrained iteration replaces
    # nothing, so the optimiser steps run 0..5 exactly once.
    assert [(it, step, opt) for it, step, opt, _ in steps] == [(i // 2, i % 2, i) for i in range(6)]
    final = checkpoint_dir(tmp_path / "killed", 2)
    for name, value in _weights(checkpoint_dir(tmp_path / "whole", 2)).items():
        torch.testing.assert_close(_weights(final)[name], value, atol=1e-5, rtol=0)


def test_run_logs_to_tensorboard_and_a_resumed_run_logs_only_its_new_iterations(tmp_path, random_policy):
    from typer.testing import CliRunner

    from cleaner.cli import app
    from tests.helpers import scalars

    def run(iterations: int, *more: str):
        return CliRunner().invoke(app, [
            "run", "--run-dir", str(tmp_path / "run"), "--iterations", str(iterations), "--prompts", "2",
            "--group-size", "2", "--model", str(random_policy), "--max-turns", "2", "--max-new-tokens", "12",
            "--max-response-tokens", "24", "--sandbox-workers", "1", "--mini-batch-size", "2", *more])

    first = run(1, "--log-to", "tensorboard")
    assert first.exit_code == 0, first.output
    # the logging targets are not part of the run's config: a resumed run may change them
    resumed = run(2, "--resume", "--log-to", "tensorboard", "--log-to", "tensorboard")
    assert resumed.exit_code == 0, resumed.output
    logged = scalars(tmp_path / "run" / "tensorboard")
    assert [step for step, _ in logged["iteration/accuracy"]] == [0, 1]  # iteration 0 logged once
    # 4 rollouts per iteration in mini batches of 2: two optimiser steps per iteration, numbered run-wide
    assert logged["train/iteration"] == [(0, 0.0), (1, 0.0), (2, 1.0), (3, 1.0)]


def test_clear_run_deletes_only_what_a_run_wrote_and_keeps_its_lock(tmp_path):
    run_dir = tmp_path / "demo"
    for name in ("warehouse/rollouts", "checkpoints/iteration-1", "report", "warehouse-report"):
        (run_dir / name).mkdir(parents=True)
    (run_dir / RUN_LOCK).touch()
    clear_run(run_dir)
    assert [entry.name for entry in run_dir.iterdir()] == [RUN_LOCK]  # held by the caller: kept
    clear_run(tmp_path / "absent")  # nothing to remove
    mine = tmp_path / "mine"
    (mine / "warehouse").mkdir(parents=True)
    (mine / RUN_LOCK).touch()
    (mine / "notes.txt").write_text("my notes")
    (tmp_path / "file").write_text("x")
    for path, why in ((mine, "holds .run.lock, notes.txt, warehouse"), (tmp_path / "file", "a file")):
        before = tree_digest(path)
        with pytest.raises(JobError, match=f"not a run directory cleaner wrote \\({why}\\)"):
            clear_run(path)
        assert tree_digest(path) == before


def _adapter(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))


def test_a_lora_run_continues_its_adapters_on_the_base_in_memory_and_after_a_resume(tmp_path, random_policy):
    """--lora-rank with the torch backend: the backend's own model is the adapters' base (trained in
    place, served with its adapters); every checkpoint's adapter names the run's model as its base;
    a run stopped after two iterations and resumed for a third (the trainer then loads the base and
    the adapter, the backend the merged weights) ends where three iterations in one go end."""
    import json

    def lora_config(run_dir: Path, iterations: int) -> RunConfig:
        config = _config(run_dir, random_policy, iterations)
        # the random policy's rewards are all 0 (no advantage): the entropy term moves the adapters
        return dataclasses.replace(config, train=dataclasses.replace(config.train, lora_rank=4, kl_coef=0.1,
                                                                     entropy_coef=0.05))

    whole = run_loop(lora_config(tmp_path / "whole", 3), progress=False)
    run_loop(lora_config(tmp_path / "resumed", 2), progress=False)
    resumed = run_loop(lora_config(tmp_path / "resumed", 3), resume=True, progress=False)
    assert [r.iteration for r in whole] == [r.iteration for r in resumed] == [0, 1, 2]
    for run in ("whole", "resumed"):
        warehouse = Warehouse(tmp_path / run / "warehouse")
        for iteration in range(3):
            checkpoint = checkpoint_dir(tmp_path / run, iteration)
            saved = json.loads((checkpoint / "adapter" / "adapter_config.json").read_text())
            assert saved["base_model_name_or_path"] == str(random_policy.resolve())
            assert {r.policy_version for r in warehouse.read_rollouts(iteration + 1)} == \
                ({policy_version_of(checkpoint)} if iteration < 2 else set())
        steps = [s for (s,) in warehouse.connect().sql(
            "SELECT optimizer_step FROM train_steps ORDER BY iteration, step").fetchall()]
        assert steps == list(range(3))  # one optimiser for the run, resumed with the adapters
    first, last = _adapter(checkpoint_dir(tmp_path / "whole", 0)), _adapter(checkpoint_dir(tmp_path / "whole", 2))
    assert any(not torch.equal(first[name], last[name]) for name in first)  # the adapters went on training
    for name, value in last.items():
        torch.testing.assert_close(_adapter(checkpoint_dir(tmp_path / "resumed", 2))[name], value, atol=1e-5, rtol=0)


def test_a_lora_run_trains_the_torch_backends_model_in_place_only_as_the_adapters_base(tmp_path, random_policy):
    """What `_policy_to_train` hands the trainer with LoRA and the torch backend: the backend's own
    model (in place: its next adopt takes no reload) when no adapters exist yet or they sit on it; the
    adapters trained last when they sit on another model (the backend then reloads); nothing when
    the backend serves a LoRA checkpoint's merged weights (the trainer loads the base and adapter)."""
    from cleaner.engine.model.torch_backend import TorchBackend
    from cleaner.engine.train.lora import with_adapters
    from cleaner.engine.train.trainer import train_iteration
    from cleaner.loop.iterations import _policy_to_train
    from tests.factories import train_batch

    config = TrainConfig(lora_rank=4, mini_batch_size=4, micro_batch_size=4)
    backend = TorchBackend(random_policy)
    try:
        assert _policy_to_train(backend, None, config) is backend.model and backend._trained_in_place
        backend.adopt(random_policy)
        adapted = with_adapters(backend.model, config, str(random_policy))
        assert _policy_to_train(backend, adapted, config) is adapted and backend._trained_in_place
        backend.adopt(random_policy)
        other = TorchBackend(random_policy)
        other.close()
        elsewhere = with_adapters(other.model, config, str(random_policy))
        assert _policy_to_train(backend, elsewhere, config) is elsewhere and not backend._trained_in_place
        checkpoint = train_iteration(train_batch(adapted), random_policy, tmp_path / "lora", config, 0,
                                     progress=False).out_path
        backend.adopt(checkpoint)  # loaded from disk: the merged weights
        assert _policy_to_train(backend, None, config) is None and not backend._trained_in_place
        assert _policy_to_train(backend, None, TrainConfig()) is backend.model  # no LoRA: always in place
    finally:
        backend.close()
