"""`cleaner sql` reads (cleaner/cli/read.py, warehouse/readonly.py): a statement that writes or
attaches is refused in one line unless --allow-write DIR, which reaches files under DIR alone and
never the warehouse's; -o is written whole and never into the warehouse; Ctrl-C stops a query.

The warehouse is tests/factories.py's: rollouts r0 and r1 of iteration 0, a failed call and its
fix each, in two parts."""

from __future__ import annotations

import errno
import os

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.warehouse import Warehouse
from cleaner.warehouse.parts import list_parts
from cleaner.warehouse.schema import ROLLOUTS
from tests.factories import make_rollout, make_segments
from tests.helpers import tree_digest

runner = CliRunner()


@pytest.fixture
def warehouse(tmp_path) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    wh.write_rollouts(0, [make_rollout("r0")], make_segments("r0"))
    wh.write_rollouts(0, [make_rollout("r1", reward=0.0)], make_segments("r1"))
    runner.invoke(app, ["sql", "SELECT 1", "-w", str(wh.root)])  # the manifest: verified once, before the digests
    return wh


def _fails(args: list[str], *expected: str) -> str:
    result = runner.invoke(app, args)
    output = " ".join(result.output.split())
    assert result.exit_code == 1 and output.count("error:") == 1 and "Traceback" not in result.output, result.output
    for text in expected:
        assert text in output, (text, output)
    return output


def _everything(tmp_path) -> str:
    return tree_digest(tmp_path)


# ---------------------------------------------------------------------------------------------
# Without --allow-write: SELECT statements, files under the warehouse only


@pytest.mark.parametrize(("query", "kind"), [
    ("COPY (SELECT * FROM rollouts) TO '{wh}/rollouts/iteration=0/part-evil.parquet'", "COPY"),
    ("COPY (SELECT 1) TO '{tmp}/out.csv'", "COPY"),
    ("CREATE TABLE t AS SELECT 1", "CREATE"),
    ("INSERT INTO rollouts SELECT * FROM rollouts", "INSERT"),
    ("UPDATE rollouts SET reward = 0", "UPDATE"),
    ("DELETE FROM rollouts", "DELETE"),
    ("DROP VIEW rollouts", "DROP"),
    ("ALTER VIEW rollouts RENAME TO r", "ALTER"),
    ("ATTACH '{tmp}/other.db' AS other", "ATTACH"),
    ("DETACH memory", "DETACH"),
    ("INSTALL httpfs", "INSTALL"),
    ("LOAD httpfs", "LOAD"),
    ("EXPORT DATABASE '{tmp}/exported'", "EXPORT"),
    ("SET allowed_directories = ['/']", "SET"),
    ("PRAGMA enable_profiling", "PRAGMA"),
    ("CALL pragma_version()", "CALL"),
    ("EXPLAIN ANALYZE COPY (SELECT 1) TO '{wh}/rollouts/iteration=0/x.csv'", "EXPLAIN"),
    ("PIVOT rollouts ON finish_reason USING count(*)", "MULTI"),
])
def test_a_statement_that_writes_attaches_or_sets_is_refused_and_nothing_is_written(warehouse, tmp_path, query, kind):
    query = query.format(wh=warehouse.root, tmp=tmp_path)
    before = _everything(tmp_path)
    _fails(["sql", query, "-w", str(warehouse.root)], f" {kind} statement, which may write", "--allow-write DIR")
    assert _everything(tmp_path) == before


def test_a_write_after_a_select_is_refused_by_its_number(warehouse, tmp_path):
    before = _everything(tmp_path)
    _fails(["sql", f"SELECT 1; COPY rollouts TO '{warehouse.root}/rollouts/iteration=0/part-x.parquet'",
            "-w", str(warehouse.root)], "statement 2 of 2 is a COPY statement")
    assert _everything(tmp_path) == before


def test_a_statement_kind_duckdb_cannot_name_is_refused_in_one_line(warehouse):
    _fails(["sql", "UPDATE EXTENSIONS", "-w", str(warehouse.root)], "a statement of a kind cleaner does not know")


def test_every_select_form_runs(warehouse):
    for query in ("FROM rollouts", "WITH r AS (FROM rollouts) SELECT count(*) FROM r", "DESCRIBE rollouts",
                  "SHOW TABLES", "SUMMARIZE rollouts", "VALUES (1)", "SELECT 1; SELECT 2"):
        result = runner.invoke(app, ["sql", query, "-w", str(warehouse.root), "-f", "csv"])
        assert result.exit_code == 0, (query, result.output)


def test_a_select_reads_no_file_outside_the_warehouse(warehouse, tmp_path):
    (tmp_path / "secret.csv").write_text("a\n1\n")
    _fails(["sql", f"SELECT * FROM read_csv('{tmp_path / 'secret.csv'}')", "-w", str(warehouse.root)],
           "query failed", "Permission Error", "without --allow-write, files under the warehouse only")


# ---------------------------------------------------------------------------------------------
# --allow-write DIR


def test_allow_write_writes_under_its_directory_and_reads_the_same_views(warehouse, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    query = "COPY (SELECT rollout_id, reward FROM rollouts ORDER BY rollout_id) TO '{}'"
    result = runner.invoke(app, ["sql", query.format(out / "r.parquet"), "-w", str(warehouse.root),
                                 "--allow-write", str(out)])
    assert result.exit_code == 0, result.output
    assert pq.read_table(out / "r.parquet").to_pylist() == [{"rollout_id": "r0", "reward": 1.0},
                                                           {"rollout_id": "r1", "reward": 0.0}]
    for view in ("rollouts", "segments", "attempts", "failures"):  # the same rows read through pyarrow
        query = f"SELECT * FROM {view} ORDER BY ALL"
        read = runner.invoke(app, ["sql", query, "-w", str(warehouse.root), "-f", "json"])
        written = runner.invoke(app, ["sql", query, "-w", str(warehouse.root), "-f", "json", "--allow-write", str(out)])
        assert read.exit_code == written.exit_code == 0 and read.output == written.output and len(read.output) > 10
    attached = runner.invoke(app, ["sql", f"ATTACH '{out / 'copy.db'}' AS copy; CREATE TABLE copy.r AS FROM rollouts",
                                   "-w", str(warehouse.root), "--allow-write", str(out)])
    assert attached.exit_code == 0, attached.output and (out / "copy.db").is_file()


@pytest.mark.parametrize("statement", [
    "COPY (SELECT * FROM rollouts) TO '{partition}/part-evil.parquet'",
    "COPY (SELECT * FROM rollouts) TO '{part}' (USE_TMP_FILE false)",  # onto a part the views read
    "ATTACH '{part}' AS part",
    "ATTACH '{partition}/evil.db' AS evil",
    "EXPORT DATABASE '{partition}/exported'",
    "COPY (SELECT 1 AS a) TO '{out}/../wh/x.csv'",
])
def test_allow_write_never_reaches_the_warehouse(warehouse, tmp_path, statement):
    out = tmp_path / "out"
    out.mkdir()
    part = list_parts(warehouse.root, ROLLOUTS)[0]
    before = tree_digest(warehouse.root)
    query = statement.format(partition=part.parent, part=part, out=out)
    _fails(["sql", query, "-w", str(warehouse.root), "--allow-write", str(out)], "Permission Error",
           "with --allow-write, files under")
    assert tree_digest(warehouse.root) == before


def test_allow_write_takes_only_a_directory_apart_from_the_warehouse(warehouse, tmp_path):
    for directory, relation in ((warehouse.root, "is"), (warehouse.root / "rollouts", "is inside"),
                                (tmp_path, "holds")):
        _fails(["sql", "SELECT 1", "-w", str(warehouse.root), "--allow-write", str(directory)],
               f"--allow-write {directory} {relation} the warehouse {warehouse.root}")
    _fails(["sql", "SELECT 1", "-w", str(warehouse.root), "--allow-write", str(tmp_path / "none")],
           f"--allow-write {tmp_path / 'none'}: no such directory")


# ---------------------------------------------------------------------------------------------
# -o


def test_output_inside_the_warehouse_is_refused_and_nothing_is_written(warehouse, tmp_path):
    """A CSV in a partition would block every reader."""
    before = _everything(tmp_path)
    for output in (warehouse.root / "rollouts" / "iteration=0" / "x.csv", warehouse.root / "x.csv"):
        _fails(["sql", "SELECT 1", "-w", str(warehouse.root), "-f", "csv", "-o", str(output)],
               f"--output {output} is inside the warehouse {warehouse.root}")
    assert _everything(tmp_path) == before


def test_a_failed_output_write_keeps_the_file_it_would_replace(warehouse, tmp_path, monkeypatch):
    """A full disk met while writing: the previous result stays whole, and no temporary is left."""
    output = tmp_path / "result.csv"
    output.write_text("the previous result\n")

    def disk_full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    _fails(["sql", "FROM rollouts", "-w", str(warehouse.root), "-f", "csv", "-o", str(output)],
           f"--output {output}: cannot write it, no space left on the device")
    assert output.read_text() == "the previous result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.csv", "wh"]


@pytest.mark.parametrize("umask", [0o022, 0o077], indirect=True)
def test_output_is_made_as_open_makes_it(warehouse, tmp_path, umask):
    output = tmp_path / "result.csv"
    result = runner.invoke(app, ["sql", "FROM rollouts", "-w", str(warehouse.root), "-f", "csv", "-o", str(output)])
    assert result.exit_code == 0, result.output
    assert output.read_text().startswith("rollout_id,") and os.stat(output).st_mode & 0o777 == 0o666 & ~umask


# ---------------------------------------------------------------------------------------------
# Ctrl-C


LONG_QUERY = "SELECT sum(hash(a)) FROM range(1000000000000) t(a)"  # hours on any machine


def test_one_ctrl_c_stops_a_running_query_in_one_line(warehouse, tmp_path):
    """A real SIGINT once the query runs: the process ends within seconds, exit 130, one line, and
    -o is not written."""
    from tests.helpers import cli, ctrl_c_when

    output, log = tmp_path / "result.csv", tmp_path / "stderr.txt"
    returncode, text, errors = ctrl_c_when(cli("-v", "sql", LONG_QUERY, "-w", str(warehouse.root), "-o", str(output)),
                                           log, "running the query", 0.5, "query")
    assert returncode == 130 and "Traceback" not in text, text
    assert errors == ["error: interrupted: the query was stopped; nothing was written"], text
    assert not output.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_checking_a_query_leaves_no_duckdb_database_running():
    """The statements are split on a parser database closed after: DuckDB's module-level default
    one would keep its worker threads until the interpreter exits (fresh interpreter: nothing
    else started them)."""
    import subprocess
    import sys

    code = ("import os\n"
            "from cleaner.warehouse.readonly import check_reads, check_select\n"
            "before = len(os.listdir('/proc/self/task'))\n"
            "check_reads('SELECT 1; FROM rollouts')\n"
            "check_select('SELECT 1')\n"
            "print(before, len(os.listdir('/proc/self/task')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, after = done.stdout.split()
    assert done.returncode == 0 and before == after, done.stdout + done.stderr
