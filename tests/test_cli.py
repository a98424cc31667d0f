"""The command line, through typer's CliRunner: exit codes and messages."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.warehouse import Warehouse, schema
from cleaner.warehouse.parts import list_parts

from .warehouse.factories import make_rollout, make_segments

runner = CliRunner()


def _warehouse(tmp_path):
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                      make_segments("r0") + make_segments("r1"))
    return wh


def test_help_lists_every_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("collect", "purify", "train", "run", "ablate", "sql", "show", "demo", "sandbox"):
        assert command in result.output


def test_sql_table_csv_json(tmp_path):
    wh = _warehouse(tmp_path)
    query = "SELECT rollout_id, reward FROM rollouts ORDER BY rollout_id"
    result = runner.invoke(app, ["sql", query, "--warehouse", str(wh.root)])
    assert result.exit_code == 0, result.output
    assert "r0" in result.output and "2 rows" in result.output
    result = runner.invoke(app, ["sql", query, "-w", str(wh.root), "--format", "csv"])
    assert result.output.splitlines() == ["rollout_id,reward", "r0,1.0", "r1,0.0"]
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["sql", query, "-w", str(wh.root), "-f", "json", "-o", str(out)])
    assert result.exit_code == 0
    assert json.loads(out.read_text()) == [{"rollout_id": "r0", "reward": 1.0}, {"rollout_id": "r1", "reward": 0.0}]


def test_sql_bad_query_exits_nonzero(tmp_path):
    result = runner.invoke(app, ["sql", "SELECT nope FROM rollouts", "-w", str(_warehouse(tmp_path).root)])
    assert result.exit_code != 0
    assert "query failed" in result.output


def test_sql_names_a_truncated_file(tmp_path):
    wh = _warehouse(tmp_path)
    bad = list_parts(wh.root, schema.SEGMENTS)[0]
    content = bad.read_bytes()
    bad.write_bytes(content[:100])
    result = runner.invoke(app, ["sql", "SELECT 1", "-w", str(wh.root)])
    assert result.exit_code == 1
    assert bad.name in result.output.replace("\n", "") and "not a readable Parquet file" in result.output
    assert bad.read_bytes() == content[:100]


def test_sql_missing_warehouse(tmp_path):
    result = runner.invoke(app, ["sql", "SELECT 1", "-w", str(tmp_path / "none")])
    assert result.exit_code == 1 and "no such warehouse" in result.output


def test_show_prints_segments_in_order(tmp_path):
    wh = _warehouse(tmp_path)
    result = runner.invoke(app, ["show", "r0", "-w", str(wh.root)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.index("prompt") < out.index("step 0 attempt 0") < out.index("step 0 attempt 1")
    assert "error NameError" in out and "retry" in out
    missing = runner.invoke(app, ["show", "nope", "-w", str(wh.root)])
    assert missing.exit_code == 1 and "no rollout 'nope'" in missing.output
