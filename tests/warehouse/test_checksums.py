"""Flipped bytes inside a part are named, never served (docs/architecture.md §3, "Checksums")."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cleaner.cli import app
from cleaner.records import IterationRow, PurifiedRow, TrainStepRow
from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse.compact import compact
from cleaner.warehouse.manifest import MANIFEST_DIR
from cleaner.warehouse.parts import list_parts
from cleaner.warehouse.schema import DATASETS
from tests.factories import make_eval_run, make_purify_config, make_rollout, make_segments

runner = CliRunner()


# ---------------------------------------------------------------------------------------------
# Byte surgery on a Parquet part


def column_chunk(path: Path, column: str) -> tuple[int, int]:
    """The byte range [start, end) of a column's pages (headers and data) in row group 0 of a part."""
    metadata = pq.ParquetFile(path).metadata.row_group(0)
    for index in range(metadata.num_columns):
        chunk = metadata.column(index)
        if chunk.path_in_schema.split(".")[0] == column:
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            return start, start + chunk.total_compressed_size
    raise KeyError(column)


def pages_region(path: Path) -> tuple[int, int]:
    """The byte range [start, end) of a part's pages (every column chunk of every row group): all of
    the file but its leading magic and its footer."""
    metadata = pq.ParquetFile(path).metadata
    chunks = [metadata.row_group(g).column(c) for g in range(metadata.num_row_groups) for c in range(metadata.num_columns)]
    starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
    return min(starts), max(start + c.total_compressed_size for start, c in zip(starts, chunks, strict=True))


def flip_in_place(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of `path` with `mask`, in place: same size, and its mtime put back."""
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def silent_flip(path: Path, column: str) -> int:
    """An offset in `column`'s pages where a flipped byte decodes without error to other values when
    the page checksums are not checked (what a reader without them serves)."""
    content = path.read_bytes()
    original = pq.read_table(pa.BufferReader(content))
    start, end = column_chunk(path, column)
    for offset in range(end - 1, start, -1):  # from the end: the values, not the page header
        flipped = bytearray(content)
        flipped[offset] ^= 0xFF
        try:
            table = pq.read_table(pa.BufferReader(bytes(flipped)), page_checksum_verification=False)
        except (pa.ArrowException, OSError):
            continue
        if not table.equals(original):
            return offset
    raise AssertionError(f"no silent flip in {column} of {path}")


# ---------------------------------------------------------------------------------------------
# Checksums


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
    """A byte flipped inside a segments part (same size, mtime put back) where it decodes, unchecked,
    to other log-probs is named by `cleaner sql` and by what `cleaner purify` reads."""
    wh = _collected(tmp_path)
    if read_before:  # the manifest then lists the part as validated under its size and mtime
        assert wh.connect().sql("SELECT count(*) FROM segments").fetchall() == [(24,)]
        assert len(wh.read_segments(0)) == 24
    part = list_parts(wh.root, schema.SEGMENTS)[0]
    size, mtime_ns = part.stat().st_size, part.stat().st_mtime_ns
    flip_in_place(part, silent_flip(part, "logprobs"))
    assert (part.stat().st_size, part.stat().st_mtime_ns) == (size, mtime_ns)
    _assert_named_by_sql_and_purify(wh, part)


def header_flip(path: Path, column: str) -> tuple[int, int]:
    """A byte of `column`'s pages and a mask that leave every page checksum intact and decode to
    other values: a page header's levels or encodings, which the checksum does not cover."""
    content = path.read_bytes()
    original = pq.read_table(pa.BufferReader(content), partitioning=None)
    start, end = column_chunk(path, column)
    for offset in range(start, end):
        for mask in range(1, 256):
            flipped = bytearray(content)
            flipped[offset] ^= mask
            try:
                table = pq.read_table(pa.BufferReader(bytes(flipped)), partitioning=None,
                                      page_checksum_verification=True)
            except (pa.ArrowException, OSError):
                continue
            if not table.equals(original):
                return offset, mask
    raise AssertionError(f"no flip in {column}'s page headers decodes past the checksums in {path}")


def test_a_flip_in_a_page_header_that_decodes_past_the_checksums_is_named(tmp_path):
    """Found by the property test below: in a part never read (no manifest entry), a byte of the
    `iteration` column's page header flipped so that its values decode as nulls and garbage, every
    page checksum intact. The footer's statistics (null count, min, max) contradict what decodes,
    so the stages' read and `cleaner sql` name the part."""
    wh = _collected(tmp_path)
    assert not (wh.root / MANIFEST_DIR).exists()  # nothing read it yet
    part = list_parts(wh.root, schema.ROLLOUTS)[0]
    flip_in_place(part, *header_flip(part, "iteration"))
    with pytest.raises(WarehouseError, match=f"^{part}: cannot read data pages \\(column iteration decodes"):
        Warehouse(wh.root).read_rollouts(0)
    result = runner.invoke(app, ["sql", "SELECT count(*) FROM rollouts", "-w", str(wh.root)])
    assert result.exit_code == 1 and str(part) in result.output, result.output


def test_the_statistics_check_passes_valid_columns_it_cannot_compare(tmp_path):
    """An INT64 column read back as a duration, and a name written twice (extra columns a foreign
    writer may add): valid files, which the statistics check passes."""
    from cleaner.warehouse.parts import _check_statistics

    for name, table in (("duration", pa.table({"d": pa.array([1, 2], pa.duration("s"))})),
                        ("twice", pa.Table.from_arrays([pa.array([1, 2], pa.int32())] * 2, names=["a", "a"]))):
        pq.write_table(table, tmp_path / f"{name}.parquet")
        parquet = pq.ParquetFile(tmp_path / f"{name}.parquet")
        _check_statistics(tmp_path / f"{name}.parquet", parquet.read_row_group(0), parquet.metadata.row_group(0))


def _pretend_unchanged(root: Path, part: Path) -> None:
    """Enter the part's present size, times and inode in the manifest, as if its bytes had changed
    beneath the file system (a failing disk), which leaves them as they were."""
    manifest = root / MANIFEST_DIR / "segments.json"
    document = json.loads(manifest.read_text())
    stat = part.stat()
    entry = document["parts"][str(part.relative_to(root / "segments"))]
    entry[:4] = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    manifest.write_text(json.dumps(document))


def test_bytes_changed_beneath_the_file_system_are_named_by_verify_and_by_the_stages(tmp_path):
    """An unchanged identity is trusted by a plain connect() (docs/architecture.md §3); `--verify`
    compares every part's CRC-32, and the stages' reads check every page checksum anyway."""
    wh = _collected(tmp_path)
    wh.connect()
    part = list_parts(wh.root, schema.SEGMENTS)[0]
    flip_in_place(part, silent_flip(part, "logprobs"))
    _pretend_unchanged(wh.root, part)
    query = ["sql", "SELECT count(*) FROM segments", "-w", str(wh.root)]
    assert runner.invoke(app, query).exit_code == 0  # the identity is what a plain connect() checks
    result = runner.invoke(app, [*query, "--verify"])
    assert result.exit_code == 1
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(f"error: {part}: cannot read data pages"), result.output
    assert "CRC checksum verification failed" in result.output
    with pytest.raises(WarehouseError, match=rf"{part}: cannot read data pages \(.*CRC checksum verification failed"):
        wh.read_segments(0)


def _flip_only_duckdb_rejects(path: Path) -> int:
    """An offset in a part's pages where a flipped bit passes pyarrow's checked read (a page header
    field it skips) but stops DuckDB's stricter page header parser."""
    content = path.read_bytes()
    start, end = pages_region(path)
    for offset in range(start, end):
        flipped = bytearray(content)
        flipped[offset] ^= 0x01
        trial = path.with_name(".trial")
        trial.write_bytes(bytes(flipped))
        try:
            pq.read_table(trial, page_checksum_verification=True)
        except (pa.ArrowException, OSError, ValueError):
            continue
        try:
            duckdb.sql(f"SELECT * FROM read_parquet('{trial}')").fetchall()
        except duckdb.Error:
            return offset
        finally:
            trial.unlink()
    raise AssertionError(f"no flip in {path} that only DuckDB rejects")


def test_a_part_duckdb_cannot_read_is_named_before_any_view_serves_it(tmp_path):
    """Verification reads every page with DuckDB too: a flip pyarrow skips is named by the stages'
    first read, not left for a query over the views to trip on without a file name."""
    wh = _collected(tmp_path)
    part = list_parts(wh.root, schema.ROLLOUTS)[0]
    flip_in_place(part, _flip_only_duckdb_rejects(part), 0x01)
    for read in (lambda: wh.read_rollouts(0), wh.connect):
        with pytest.raises(WarehouseError, match=rf"{part}: DuckDB cannot read its pages"):
            read()


def test_compaction_never_rewrites_changed_bytes_of_a_part_without_page_checksums(tmp_path):
    """A part written before page checksums decodes whatever its bytes are; its pinned CRC-32 is what
    stops a compaction from giving a flipped byte fresh checksums in a merged part."""
    wh = _collected(tmp_path)
    wh.write_rollouts(0, [make_rollout("r9")], make_segments("r9"))
    _without_page_checksums(wh.root)
    assert len(wh.read_segments(0)) == 30  # pins every part
    part = list_parts(wh.root, schema.SEGMENTS)[0]
    flip_in_place(part, silent_flip(part, "logprobs"))
    with pytest.raises(WarehouseError, match=rf"{part}: its bytes changed since cleaner verified them"):
        compact(wh.root)
    assert len(list_parts(wh.root, schema.SEGMENTS)) == 2  # nothing merged, nothing removed


# ---------------------------------------------------------------------------------------------
# Property: random flips in random parts of every dataset are named or provably harmless


CONFIG = make_purify_config("cfg")
READERS = {  # dataset: what a stage reads of it, through pyarrow
    "rollouts": lambda wh: (wh.read_rollouts(0), sorted(wh.rollout_ids(0))),
    "segments": lambda wh: wh.read_segments(0),
    "purified": lambda wh: (wh.read_purified(0, "cfg"), sorted(wh.purified_rollout_ids(0, "cfg"))),
    "purify_configs": lambda wh: sorted(wh.purify_config_ids()),
    "iterations": lambda wh: wh.read_iterations(),
    "train_steps": lambda wh: wh.read_train_steps(0),
    "eval_rollouts": lambda wh: wh.read_eval_rollouts("e1"),
    "eval_segments": lambda wh: wh.read_eval_segments("e1"),
    "eval_runs": lambda wh: wh.read_eval_run("e1"),
}


def _purified_row(rollout_id: str) -> PurifiedRow:
    return PurifiedRow("cfg", 0, rollout_id, "it0-p0", (1, 2, 3, 4), 1, (0, 1, 1, 1), (0.0, -0.5, -0.25, -2.0),
                       (0.0, -0.75, -0.125, -1.5), 1.0, 0.5, True, 1, 0, 0, 4, "test")


def _every_dataset(root: Path) -> Warehouse:
    """A warehouse with parts of every dataset (two collection batches), none read yet."""
    wh = Warehouse(root)
    for batch in range(2):
        ids = [f"b{batch}r{i}" for i in range(3)]
        wh.write_rollouts(0, [make_rollout(i, reward=float(n % 2)) for n, i in enumerate(ids)],
                          [s for i in ids for s in make_segments(i)])
    wh.write_purified(0, CONFIG, [_purified_row(f"b0r{i}") for i in range(3)])
    wh.write_iteration(IterationRow(0, "p0", "p1", "{}", "{}", "{}", 1.0, 2.0, 3.0, 0.5, 0.25, 1.5, 2, 1,
                                    datetime(2026, 1, 1)))
    wh.write_train_steps(0, [TrainStepRow(0, s, s, 0.5 / (s + 1), 0.1, 0.01, 1.0, 2.0, 1e-4, 10,
                                          datetime(2026, 1, 1)) for s in range(3)])
    wh.write_eval_batch("e1", [make_rollout("e1r0"), make_rollout("e1r1", reward=0.0)],
                        make_segments("e1r0") + make_segments("e1r1"))
    wh.write_eval_run(make_eval_run("e1", saar=True))
    return wh


def _without_page_checksums(root: Path) -> None:
    """Rewrite every part as cleaner wrote them before it wrote page checksums."""
    for part in root.rglob("part-*.parquet"):
        table = pq.read_table(part, partitioning=None)
        pq.write_table(table, part, compression="zstd", write_page_checksum=False)


def _reads(root: Path, dataset: str) -> tuple[Callable[[], str], Callable[[], str]]:
    """How the SQL path and the stages read `dataset` (as a repr, so that a NaN equals itself)."""
    wh = Warehouse(root)
    return (lambda: repr(wh.connect().sql(f"SELECT * FROM {dataset}").to_arrow_table().to_pylist()),
            lambda: repr(READERS[dataset](wh)))


class _Built(dict):
    def __repr__(self) -> str:  # hypothesis prints the fixture with a failing example
        return f"warehouses({', '.join(self)})"


@pytest.fixture(scope="module")
def warehouses(tmp_path_factory) -> dict[str, tuple[Path, dict[str, tuple[str, str]]]]:
    """name: (a warehouse to copy, what each dataset reads as) for: parts never read ("fresh"),
    parts read once ("pinned"), and parts without page checksums read once ("legacy")."""
    built = _Built()
    for name in ("fresh", "pinned", "legacy"):
        root = tmp_path_factory.mktemp(name) / "wh"
        _every_dataset(root)
        if name == "legacy":
            _without_page_checksums(root)
        expected = {dataset: tuple(read() for read in _reads(root, dataset)) for dataset in READERS}  # pins all
        if name == "fresh":
            shutil.rmtree(root / MANIFEST_DIR)
        built[name] = (root, expected)
    return built


def _outcome(read, part: Path, expected: str) -> str:
    """"named" (an error naming the part), "unnamed" (an error that does not), "harmless" (the
    original rows) or "served" (other rows, without an error)."""
    try:
        found = read()
    except WarehouseError as error:
        return "named" if str(part) in str(error) else "unnamed"
    return "harmless" if found == expected else "served"


def _flip_and_read(root: Path, expected: tuple[str, str], dataset: str, choose, anywhere: bool) -> list[str]:
    """Flip bytes of one part of `dataset` in a copy of `root`, then read it through SQL and through
    pyarrow, each in a copy of its own so that neither verifies the part for the other."""
    parts = list_parts(root, DATASETS[dataset])
    index = choose(st.integers(0, len(parts) - 1))
    start, end = (0, parts[index].stat().st_size) if anywhere else pages_region(parts[index])
    flips = choose(st.lists(st.tuples(st.integers(start, end - 1), st.integers(1, 255)), min_size=1, max_size=3,
                            unique_by=lambda flip: flip[0]))
    outcomes = []
    for reader in (0, 1):
        with tempfile.TemporaryDirectory() as scratch:
            copy = Path(scratch) / "wh"
            shutil.copytree(root, copy)
            part = copy / parts[index].relative_to(root)
            for offset, mask in flips:
                flip_in_place(part, offset, mask)
            outcomes.append(_outcome(_reads(copy, dataset)[reader], part, expected[reader]))
    return outcomes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), dataset=st.sampled_from(sorted(READERS)), kind=st.sampled_from(["pinned", "legacy"]))
def test_a_flip_anywhere_in_a_part_read_before_is_named_by_every_reader(warehouses, data, dataset, kind):
    """Once a part was read, any byte of it flipped (its pages, their headers, its footer; with or
    without page checksums in it) is named by `cleaner sql` and by the stages."""
    root, expected = warehouses[kind]
    assert _flip_and_read(root, expected[dataset], dataset, data.draw, anywhere=True) == ["named", "named"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), dataset=st.sampled_from(sorted(READERS)))
def test_a_flip_in_the_pages_of_a_part_never_read_is_named_or_harmless(warehouses, data, dataset):
    """A byte flipped in a part's pages before anything read it: the page checksums name it, or the
    flip was in a page header field no reader uses, and both readers read back the original rows."""
    root, expected = warehouses["fresh"]
    outcomes = _flip_and_read(root, expected[dataset], dataset, data.draw, anywhere=False)
    assert set(outcomes) <= {"named", "harmless"}


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_refusal_leaves_no_duckdb_database_running(tmp_path):
    """The part DuckDB cannot read is named with the checking database closed, its worker threads
    ended, even while the refusal (its traceback) is still held: threads left running at exit
    could abort the interpreter ("terminate called without an active exception", rc 134)."""
    healthy = _collected(tmp_path / "healthy")
    healthy.connect().close()  # pyarrow's and DuckDB's pools of this process, started once
    wh = _collected(tmp_path / "flipped")
    part = list_parts(wh.root, schema.ROLLOUTS)[0]
    flip_in_place(part, _flip_only_duckdb_rejects(part), 0x01)
    before = _threads()
    with pytest.raises(WarehouseError, match="DuckDB cannot read its pages") as refused:
        wh.connect()
    assert refused.value.__traceback__ is not None and _threads() == before
