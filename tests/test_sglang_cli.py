"""`cleaner collect` and `cleaner purify` with the real in-process SGLang engine on CPU, from the
command line of .venv-sglang with no SGLang variable set by hand (`make test-sglang`):

- the two schedules write the same warehouse: lock step, then each rollout on its own clock with
  other parts, then a collection resumed after losing its last parts. Per-request seeds are ignored
  on SGLang's CPU path (they need deterministic inference, which refuses its attention), so a
  sampled rollout depends on what ran beside it there: these collections are greedy, and equal token
  for token, the behaviour log-probs within 1e-4 (batches of other shapes round otherwise);
- purifying the iteration through SGLang gives the old log-probs the torch prefix-trie scorer gives
  for the same rows, within 1e-4 on every row, and says how many tokens the engine computed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cleaner.engine.model.backend_scorer import SCORER_VERSION as BACKEND_SCORER
from cleaner.engine.model.sglang_engine import CPU_ENGINE_ENV
from cleaner.engine.model.trie_scorer import SCORER_VERSION as TRIE_SCORER
from cleaner.warehouse import Warehouse
from tests.helpers import assert_same_collection, comparable

pytestmark = pytest.mark.sglang

COLLECT = ["collect", "--backend", "sglang", "--device", "cpu", "--prompts", "8", "--group-size", "4"]


def cleaner(*args: str | Path) -> subprocess.CompletedProcess:
    """The venv's `cleaner` console script, as a user runs it, without SGLang's variable."""
    env = {name: value for name, value in os.environ.items() if name != CPU_ENGINE_ENV}
    result = subprocess.run([str(Path(sys.executable).parent / "cleaner"), *map(str, args)],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def _collection(warehouse: Path) -> tuple[list, list]:
    """Iteration 0's rollouts (without write times) and segments (without execution times), in order."""
    stored = Warehouse(warehouse)
    return comparable(stored.read_rollouts(0), stored.read_segments(0))


def _purified(warehouse: Path) -> dict[tuple, tuple]:
    rows = Warehouse(warehouse).connect().sql(
        "SELECT config_id, rollout_id, negative_seq, old_logprobs, loss_mask, scorer_version FROM purified"
    ).fetchall()
    return {(config, rollout, negative): (old, mask, version) for config, rollout, negative, old, mask, version in rows}


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The same iteration collected greedily three ways: lock step; each rollout on its own clock,
    in parts of 5, 7 in flight; and that collection with its last parts lost, resumed."""
    root = tmp_path_factory.mktemp("sglang-cli")
    greedy = [*COLLECT, "--temperature", "0"]
    output = cleaner(*greedy, "-w", root / "a", "--schedule", "lockstep").stdout
    assert "32 rollouts written (32 planned)" in output
    cleaner(*greedy, "-w", root / "b", "--batch-rollouts", "5", "--max-concurrent-rollouts", "7")
    kept = sorted(Warehouse(root / "b").read_rollouts(0), key=lambda r: r.created_at)[:20]  # the first parts
    lost = Warehouse(root / "c")
    lost.save_collect_config(0, Warehouse(root / "b").collect_config(0))
    ids = {r.rollout_id for r in kept}
    lost.write_rollouts(0, kept, [s for s in Warehouse(root / "b").read_segments(0) if s.rollout_id in ids])
    output = cleaner(*greedy, "-w", root / "c", "--resume", "--batch-rollouts", "3").stdout
    assert "12 rollouts written (32 planned)" in output
    return root / "a", root / "b", root / "c"


def test_the_schedule_never_changes_a_greedy_collection(collected):
    lockstep, on_their_own, resumed = (_collection(path) for path in collected)
    assert len(lockstep[0]) == 32 and all(r.n_tool_calls > 0 for r in lockstep[0])  # multi-turn rollouts
    assert_same_collection(on_their_own, lockstep)
    assert_same_collection(resumed, lockstep)


def test_purify_through_sglang_equals_the_torch_trie_scorer(collected, tmp_path):
    a = collected[0]
    through_torch = tmp_path / "torch"
    shutil.copytree(a, through_torch)
    output = cleaner("purify", "--backend", "sglang", "-w", a).stdout
    cleaner("purify", "--backend", "torch", "-w", through_torch)
    computed = re.search(r"the engine computed (\d+) of (\d+) tokens", output)
    assert computed is not None, output
    assert 0 < int(computed[1]) < int(computed[2])  # the prefix cache served part of the rows
    sglang_rows, torch_rows = _purified(a), _purified(through_torch)
    assert sglang_rows.keys() == torch_rows.keys() and len(sglang_rows) >= 32
    for key, (old, mask, version) in sglang_rows.items():
        torch_old, torch_mask, torch_version = torch_rows[key]
        assert version.startswith(BACKEND_SCORER + ":") and torch_version.startswith(TRIE_SCORER + ":")
        assert mask == torch_mask
        assert old == pytest.approx(torch_old, abs=1e-4), key
