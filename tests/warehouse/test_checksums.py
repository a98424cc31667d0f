"""Flipped bytes inside a part are named, never served (docs/architecture.md §3, "Checksums")."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse.parts import list_parts

from .factories import flip_in_place, make_rollout, make_segments, silent_flip

runner = CliRunner()


def _collected(tmp_path: Path) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout(f"r{i}") for i in range(4)],
                      [s for i in range(4) for s in make_segments(f"r{i}")])
    return wh


def _assert_named_by_sql_and_purify(wh: Warehouse, part: Path) -> None:
    result = runner.invoke(app, ["sql", "SELECT min(list_min(logprobs)), max(list_max(logprobs)) FROM segments",
                                 "-w", str(wh.root)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(part) in lines[0], result.output
    with pytest.raises(WarehouseError, match=str(part)):
        wh.read_segments(0)  # what `cleaner purify` reads


@pytest.mark.parametrize("read_before", [True, False], ids=["after-a-read", "before-any-read"])
def test_a_flipped_logprob_byte_is_named_by_sql_and_purify(tmp_path, read_before):
    """The issue's defect: a byte flipped inside a segments part (same size, mtime put back) was
    served as log-probs of 5911.2 and -4.2e19 by `cleaner sql` and `cleaner purify`."""
    wh = _collected(tmp_path)
    if read_before:  # the manifest then lists the part as validated under its size and mtime
        assert wh.connect().sql("SELECT count(*) FROM segments").fetchall() == [(24,)]
        assert len(wh.read_segments(0)) == 24
    part = list_parts(wh.root, schema.SEGMENTS)[0]
    size, mtime_ns = part.stat().st_size, part.stat().st_mtime_ns
    flip_in_place(part, silent_flip(part, "logprobs"))
    assert (part.stat().st_size, part.stat().st_mtime_ns) == (size, mtime_ns)
    _assert_named_by_sql_and_purify(wh, part)
