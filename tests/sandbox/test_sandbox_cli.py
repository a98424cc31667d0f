"""`cleaner sandbox run FILE` through typer's CliRunner: exit codes and output."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cleaner.cli import app

runner = CliRunner()


def test_json_output_for_a_successful_file(tmp_path):
    source = tmp_path / "ok.py"
    source.write_text("print(input() * 2)")
    stdin = tmp_path / "in.txt"
    stdin.write_text("ab\n")
    result = runner.invoke(app, ["sandbox", "run", str(source), "--stdin", str(stdin), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert (payload["status"], payload["error_type"], payload["stdout"]) == ("ok", None, "abab\n")
    assert payload["response"] == "Tool call success\nstdout: abab\n"


def test_failing_code_still_exits_zero_and_shows_the_error(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text("x = 1\ny = x / 0")
    result = runner.invoke(app, ["sandbox", "run", str(source), "--timeout-s", "2"])
    assert result.exit_code == 0, result.output
    assert "ZeroDivisionError" in result.stdout
    assert "error" in result.stdout


def test_a_timeout_is_reported_with_json(tmp_path):
    source = tmp_path / "loop.py"
    source.write_text("while True:\n    pass")
    result = runner.invoke(app, ["sandbox", "run", str(source), "--timeout-s", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "timeout"


def test_a_missing_file_exits_non_zero(tmp_path):
    result = runner.invoke(app, ["sandbox", "run", str(tmp_path / "nope.py")])
    assert result.exit_code != 0
    assert "no such file" in result.output
