"""A warehouse on a read-only file system, for real: a copy of a run's warehouse bind-mounted
read-only (as root), as teams share snapshots. Every reader works there and writes nothing; every
writer refuses in one line that says "read-only file system". Skipped, with the reason, where no
bind mount can be made."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.warehouse import Warehouse
from tests.helpers import tree_digest

runner = CliRunner()
READ_ONLY = "it is on a read-only file system"


@pytest.fixture(scope="module")
def read_only(small_run, tmp_path_factory):
    """A copy of the small run's warehouse, mounted read-only; the copy's digest to compare with."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root")
    root = tmp_path_factory.mktemp("read-only")
    source, mount = root / "source", root / "ro"
    shutil.copytree(small_run / "warehouse", source)
    Warehouse(source).connect()  # its manifest written, as a team's snapshot would be
    mount.mkdir()
    for command in (["mount", "--bind", str(source), str(mount)], ["mount", "-o", "remount,ro,bind", str(mount)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            subprocess.run(["umount", str(mount)], capture_output=True)
            pytest.skip(f"cannot bind-mount read-only here: {done.stderr.strip()}")
    try:
        yield mount, tree_digest(source)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _ok(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


def test_the_mount_is_read_only(read_only):
    mount, _ = read_only
    with pytest.raises(OSError, match="Read-only file system"):
        (mount / "probe").write_text("x")


def test_every_reader_works_and_writes_nothing(read_only, tmp_path):
    mount, digest = read_only
    assert "│ 32 " in _ok(["sql", "-w", str(mount), "SELECT count(*) AS n FROM rollouts"])
    assert _ok(["sql", "-w", str(mount), "--verify", "SELECT count(*) FROM purified"])
    (rollout_id,) = Warehouse(mount).connect().sql("SELECT min(rollout_id) FROM rollouts").fetchall()[0]
    assert rollout_id in _ok(["show", "-w", str(mount), rollout_id])
    _ok(["report", "-w", str(mount), "--out", str(tmp_path / "report")])
    assert (tmp_path / "report" / "report.md").exists()
    assert "16 rows from 16 rollouts" in _ok(["export", "-w", str(mount), "--iteration", "0", "--format", "sft",
                                              "--out", str(tmp_path / "sft")])
    assert "statistics of " in _ok(["curate", "-w", str(mount), "--iteration", "0", "--stats-out",
                                    str(tmp_path / "stats.jsonl")])
    assert len((tmp_path / "stats.jsonl").read_text().splitlines()) == 4  # the small run's four prompts
    # the browser and the notebooks' API: the same Warehouse, opened as they open it
    from starlette.testclient import TestClient

    from cleaner.ui.app import create_app
    from cleaner.warehouse.browse import Browser

    client = TestClient(create_app(Browser(Warehouse(mount, read_only=True))), base_url="http://127.0.0.1")
    assert client.get("/").status_code == 200 and client.get(f"/rollouts/{rollout_id}").status_code == 200
    assert len(Warehouse(mount).read_rollouts(0)) == 16
    assert tree_digest(mount) == digest  # nothing written, not even a manifest


@pytest.mark.parametrize("args", [
    ["collect", "--iteration", "5", "--prompts", "1", "--group-size", "1"],
    ["purify", "--iteration", "0", "--gamma", "0.9"],
    ["train", "--iteration", "0", "--config-id", "x", "--policy", ".", "--out", "{tmp}/out"],
    ["compact"],
], ids=["collect", "purify", "train", "compact"])
def test_every_writer_refuses_in_one_line(read_only, tmp_path, args):
    mount, digest = read_only
    result = runner.invoke(app, [args[0], "-w", str(mount), *[a.format(tmp=tmp_path) for a in args[1:]]])
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in result.output and output.count("error:") == 1, output
    assert READ_ONLY in output and str(mount) in output
    assert tree_digest(mount) == digest
