"""A collection against real SGLang servers on CPU that die under it (`make test-sglang`): with two
servers behind sglang-router, one SIGKILLed mid-collection, every rollout is stored and the
warehouse is the one a healthy cluster collects (greedy); with the only server SIGKILLed, the
collection stops in one line, exit 1, and `--resume` against a server started again (at another
address) completes that same warehouse (docs/architecture.md §5, "Faults and load")."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cleaner.config import DEFAULT_POLICY
from cleaner.engine.model.sglang_engine import CPU_ENGINE_ENV
from cleaner.warehouse import Warehouse
from tests.helpers import assert_same_collection, comparable, wait_for

pytestmark = pytest.mark.sglang

# greedy (SGLang on CPU ignores per-request seeds), multi-turn rollouts of the tiny policy
COLLECT = ["collect", "--backend", "sglang", "--prompts", "12", "--group-size", "2", "--temperature", "0",
           "--batch-rollouts", "2", "--max-concurrent-rollouts", "4", "--sandbox-workers", "1"]


def _command(*args) -> list[str]:
    return [str(Path(sys.executable).parent / "cleaner"), *map(str, args)]


def _env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != CPU_ENGINE_ENV}


def _parts(warehouse: Path) -> int:
    return len(list((warehouse / "rollouts" / "iteration=0").glob("part-*.parquet")))


def _kill(server) -> None:
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


@pytest.fixture(scope="module")
def sglang_tools():
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("the sglang tests run in .venv-sglang (make sglang-cpu)")
    from tests import sglang_cpu

    return sglang_cpu


def test_a_server_killed_mid_collection_changes_nothing_stored(sglang_tools, tmp_path):
    cluster = sglang_tools.Cluster.start(DEFAULT_POLICY, 2, tmp_path / "logs")
    try:
        healthy = tmp_path / "healthy"
        done = subprocess.run(_command(*COLLECT, "-w", healthy, "--sglang-url", cluster.router.url),
                              capture_output=True, text=True, env=_env())
        assert done.returncode == 0, done.stderr[-3000:]
        faulty = tmp_path / "faulty"
        process = subprocess.Popen(_command(*COLLECT, "-w", faulty, "--sglang-url", cluster.router.url),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        wait_for(lambda: _parts(faulty) >= 2, 600, process)
        _kill(cluster.servers[1])  # mid-collection: its rollouts' next requests go to the other
        _, stderr = process.communicate(timeout=600)
    finally:
        cluster.stop()
    assert process.returncode == 0, stderr[-3000:]
    assert "out of the rotation" in stderr and "Traceback" not in stderr
    expected = comparable(Warehouse(healthy).read_rollouts(0), Warehouse(healthy).read_segments(0))
    got = comparable(Warehouse(faulty).read_rollouts(0), Warehouse(faulty).read_segments(0))
    assert len(got[0]) == 24 and any(r.n_tool_calls > 0 for r in got[0])
    assert_same_collection(got, expected)


def test_the_only_server_killed_stops_in_one_line_and_resumes_elsewhere(sglang_tools, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    server = sglang_tools.start_server(DEFAULT_POLICY, logs / "first.log")
    warehouse = tmp_path / "wh"
    try:
        process = subprocess.Popen(_command(*COLLECT, "-w", warehouse, "--sglang-url", server.url),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        wait_for(lambda: _parts(warehouse) >= 1, 600, process)
        _kill(server)
        _, stderr = process.communicate(timeout=600)
    finally:
        server.stop()
    assert process.returncode == 1 and "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--resume" in errors[0], stderr[-3000:]
    committed = len(Warehouse(warehouse).read_rollouts(0))
    assert 0 < committed < 24, errors
    again = sglang_tools.start_server(DEFAULT_POLICY, logs / "again.log")  # on another port
    try:
        resumed = subprocess.run(_command(*COLLECT, "-w", warehouse, "--sglang-url", again.url, "--resume"),
                                 capture_output=True, text=True, env=_env())
        healthy = tmp_path / "healthy"
        reference = subprocess.run(_command(*COLLECT, "-w", healthy, "--sglang-url", again.url),
                                   capture_output=True, text=True, env=_env())
    finally:
        again.stop()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert f"{24 - committed} rollouts written (24 planned)" in resumed.stdout
    assert_same_collection(comparable(Warehouse(warehouse).read_rollouts(0), Warehouse(warehouse).read_segments(0)),
                           comparable(Warehouse(healthy).read_rollouts(0), Warehouse(healthy).read_segments(0)))
