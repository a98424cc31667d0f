"""`cleaner collect` and `cleaner purify` with the real in-process SGLang engine on CPU, from the
command line of .venv-sglang with no SGLang variable set by hand (`make test-sglang`):

- collecting twice with the same seed gives the same rollouts: per-request seeds are ignored on
  SGLang's CPU path, and the engine's random seed (cleaner derives it from --seed and the
  iteration) is what makes a collection reproducible across engine starts;
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


def _rollouts(warehouse: Path) -> list[tuple]:
    segments = Warehouse(warehouse).read_segments(0)
    return sorted((s.rollout_id, s.seq, tuple(s.token_ids)) for s in segments)


def _purified(warehouse: Path) -> dict[tuple, tuple]:
    rows = Warehouse(warehouse).connect().sql(
        "SELECT config_id, rollout_id, negative_seq, old_logprobs, loss_mask, scorer_version FROM purified"
    ).fetchall()
    return {(config, rollout, negative): (old, mask, version) for config, rollout, negative, old, mask, version in rows}


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> tuple[Path, Path]:
    """The same iteration collected twice through the engine, into two warehouses."""
    root = tmp_path_factory.mktemp("sglang-cli")
    for name in ("a", "b"):
        output = cleaner(*COLLECT, "-w", root / name).stdout
        assert "32 rollouts written (32 planned)" in output
    return root / "a", root / "b"


def test_the_engine_seed_makes_a_collection_reproducible(collected):
    a, b = collected
    first, second = _rollouts(a), _rollouts(b)
    assert len({rollout for rollout, _, _ in first}) == 32
    assert first == second


def test_purify_through_sglang_equals_the_torch_trie_scorer(collected, tmp_path):
    a, _ = collected
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
