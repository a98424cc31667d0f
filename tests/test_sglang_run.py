"""`cleaner run` through sglang-router in front of two real SGLang servers on CPU, all on 127.0.0.1
(`make test-sglang`): every iteration generates and scores through the router, and after each
training every worker serves the new checkpoint, which its `/model_info` and a probe scored on it
(against a transformers forward of that checkpoint) both show; a run killed between phases
finishes with --resume."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

from cleaner.config import DEFAULT_POLICY, CollectConfig, RunConfig, TrainConfig
from cleaner.engine.model.loading import load_policy
from cleaner.loop.iterations import checkpoint_dir, run_loop
from cleaner.sandbox import SandboxConfig
from cleaner.warehouse import Warehouse
from tests.helpers import cli, naive_logprobs, sigkill_when
from tests.sglang_cpu import get_json, post_json

pytestmark = pytest.mark.sglang

PROBE = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # scored from position 1 on each worker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("the sglang tests run in .venv-sglang (make sglang-cpu)")
    from tests.sglang_cpu import Cluster

    started = Cluster.start(DEFAULT_POLICY, 2, tmp_path_factory.mktemp("sglang-cluster"))
    yield started
    started.stop()


def _transformers_logprobs(checkpoint: Path) -> list[float]:
    return naive_logprobs(load_policy(checkpoint, "cpu", torch.float32).eval(), PROBE)


def _scored_on(worker: str) -> list[float]:
    body = {"input_ids": PROBE, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}
    entries = post_json(worker + "/generate", body)["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and [entry[1] for entry in entries] == PROBE
    return [entry[0] for entry in entries[1:]]


def assert_every_worker_serves(cluster, checkpoint: Path) -> None:
    expected = _transformers_logprobs(checkpoint)
    for server in cluster.servers:
        assert get_json(server.url + "/model_info")["model_path"] == str(checkpoint)
        assert _scored_on(server.url) == pytest.approx(expected, abs=1e-4)


def test_run_through_the_router_moves_every_worker_to_each_new_checkpoint(cluster, tmp_path):
    run_dir = tmp_path / "run"
    config = RunConfig(  # the committed policy: it solves some tasks, so its groups have advantages
        run_dir=str(run_dir), iterations=2,
        collect=CollectConfig(model=str(DEFAULT_POLICY), backend="sglang", sglang_url=cluster.router.url,
                              n_prompts=4, group_size=4, sandbox=SandboxConfig(workers=1)),
        train=TrainConfig(lr=1e-2, weight_decay=0.1, mini_batch_size=16, micro_batch_size=8),
    )
    checked = []

    def after_iteration(row) -> None:
        assert_every_worker_serves(cluster, Path(row.policy_out))
        checked.append(row.policy_out)

    rows = run_loop(config, progress=False, on_iteration=after_iteration)
    assert checked == [str(checkpoint_dir(run_dir, 0)), str(checkpoint_dir(run_dir, 1))] == [r.policy_out for r in rows]
    # the probe tells the checkpoints apart: each training moved the weights
    base, first = _transformers_logprobs(DEFAULT_POLICY), _transformers_logprobs(checkpoint_dir(run_dir, 0))
    assert max(abs(a - b) for a, b in zip(base, first, strict=True)) > 1e-3
    warehouse = Warehouse(run_dir / "warehouse")
    assert [len(warehouse.read_rollouts(i)) for i in (0, 1)] == [16, 16]


def test_a_run_killed_between_phases_finishes_with_resume(cluster, tmp_path):
    run_dir = tmp_path / "run"
    args = ["run", "--run-dir", str(run_dir), "--iterations", "2", "--prompts", "2", "--group-size", "2",
            "--backend", "sglang", "--sglang-url", cluster.router.url]
    purified = run_dir / "warehouse" / "purified"
    # killed after purify, before or during training of iteration 0
    sigkill_when(cli(*args), lambda: any(purified.glob("iteration=0/*/part-*.parquet")), 300)
    finished = subprocess.run(cli(*args, "--resume"), capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-3000:]
    connection = Warehouse(run_dir / "warehouse").connect()
    assert connection.sql("SELECT list(iteration ORDER BY iteration) FROM iterations").fetchall() == [([0, 1],)]
    assert connection.sql(
        "SELECT iteration, count(*), count(DISTINCT rollout_id) FROM rollouts GROUP BY 1 ORDER BY 1"
    ).fetchall() == [(0, 4, 4), (1, 4, 4)]
    assert_every_worker_serves(cluster, checkpoint_dir(run_dir, 1))
