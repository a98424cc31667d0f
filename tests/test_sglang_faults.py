"""A collection against real SGLang servers on CPU that die under it (`make test-sglang`): with two
servers behind sglang-router, one SIGKILLed mid-collection, every rollout is stored and the
warehouse is the one a healthy cluster collects (greedy); with the last server SIGKILLed, the
collection stops in one line, exit 1, and `--resume` against a server started again (at another
address) completes that same warehouse (docs/architecture.md §5, "Faults and load"). One cluster
for all of it: a server starts in 20-40 s here."""

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
COLLECT = ["collect", "--backend", "sglang", "--prompts", "8", "--group-size", "2", "--temperature", "0",
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


def test_dead_servers_change_nothing_stored_and_the_last_one_dead_stops_resumably(sglang_tools, tmp_path):
    """One cluster, four collections of the same greedy iteration: (1) through the router, healthy:
    the reference; (2) through the router, one server SIGKILLed mid-collection: finishes, and equals
    the reference; (3) against the remaining server alone, SIGKILLed mid-collection: one error line,
    exit 1, its parts kept; (4) that one resumed against a server started again at another address:
    equals the reference."""
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = sglang_tools.Cluster.start(DEFAULT_POLICY, 2, logs)
    healthy, faulty, stopped = tmp_path / "healthy", tmp_path / "faulty", tmp_path / "stopped"
    try:
        done = subprocess.run(_command(*COLLECT, "-w", healthy, "--sglang-url", cluster.router.url),
                              capture_output=True, text=True, env=_env())
        assert done.returncode == 0, done.stderr[-3000:]
        rerouted, rerouted_err = _killed_under(faulty, cluster.router.url, cluster.servers[1], parts=2)
        lost, lost_err = _killed_under(stopped, cluster.servers[0].url, cluster.servers[0], parts=1)
    finally:
        cluster.stop()
    expected = _stored(healthy)
    assert len(expected[0]) == 16 and any(r.n_tool_calls > 0 for r in expected[0])
    # (2) the rollouts of the killed server went on on the other one
    assert rerouted == 0, rerouted_err[-3000:]
    assert "out of the rotation" in rerouted_err and "Traceback" not in rerouted_err
    assert_same_collection(_stored(faulty), expected)
    # (3) no server left: one line, exit 1, what was committed stays
    assert lost == 1 and "Traceback" not in lost_err
    errors = [line for line in lost_err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--resume" in errors[0], lost_err[-3000:]
    committed = len(Warehouse(stopped).read_rollouts(0))
    assert 0 < committed < 16, errors
    # (4) resumed against a server at another address (the servers' address is not the config's)
    again = sglang_tools.start_server(DEFAULT_POLICY, logs / "again.log")
    try:
        resumed = subprocess.run(_command(*COLLECT, "-w", stopped, "--sglang-url", again.url, "--resume"),
                                 capture_output=True, text=True, env=_env())
    finally:
        again.stop()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{16 - committed} rollouts written (16 planned)" in resumed.stdout
    assert_same_collection(_stored(stopped), expected)


def _killed_under(warehouse: Path, url: str, server, parts: int) -> tuple[int, str]:
    """A collection into `warehouse` through `url`, `server` SIGKILLed once `parts` parts are
    committed: its exit code and stderr."""
    process = subprocess.Popen(_command(*COLLECT, "-w", warehouse, "--sglang-url", url),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    wait_for(lambda: _parts(warehouse) >= parts, 600, process)
    _kill(server)
    _, stderr = process.communicate(timeout=600)
    return process.returncode, stderr


def _stored(warehouse: Path) -> tuple[list, list]:
    stored = Warehouse(warehouse)
    return comparable(stored.read_rollouts(0), stored.read_segments(0))
