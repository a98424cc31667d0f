"""Part files by hand (cleaner/warehouse/parts.py): atomic writes, what a footer holds, which parts
readers see, and reads of parts written before a column existed, on tables of a few rows (no model,
no warehouse), so every line of parts.py has a test that runs in milliseconds."""

from __future__ import annotations

import errno
import json
import os
import re
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.errors import WriteError
from cleaner.warehouse import parts
from cleaner.warehouse.parts import (
    MERGED_PREFIX,
    REPLACES_KEY,
    STAMP_KEY,
    Footer,
    Identity,
    PartExistsError,
    WarehouseError,
    check_schema,
    identity,
    list_parts,
    read_column,
    read_part,
    read_parts,
    read_whole,
    relative_name,
    remove_leftovers,
    stamp_of,
    temporary_name,
    validate_part,
    verify_content,
    visible_parts,
    write_merged,
    write_part,
)
from cleaner.warehouse.schema import Dataset
from tests.helpers import ended_pid

SCHEMA = pa.schema([("id", pa.string()), ("n", pa.int64()), ("tokens", pa.list_(pa.int32())), ("note", pa.string())])
THINGS = Dataset("things", dict, SCHEMA, ("iteration",), added=(("note", "none yet"),))
FLAT = Dataset("flat", dict, SCHEMA, ())


def _table(*ids: str, start: int = 0) -> pa.Table:
    return pa.table({"id": list(ids), "n": list(range(start, start + len(ids))),
                     "tokens": [[i, i + 1] for i in range(start, start + len(ids))],
                     "note": [f"note {i}" for i in ids]}, schema=SCHEMA)


def _rows(table: pa.Table) -> list[tuple]:
    return list(zip(*(table.column(name).to_pylist() for name in table.column_names), strict=True))


# ---------------------------------------------------------------------------------------------
# Writing


def test_a_part_is_written_under_a_new_name_with_checksums_zstd_and_dictionaries_on_strings_only(tmp_path):
    directory = tmp_path / "a" / "b"  # made, parents too
    path = write_part(directory, _table("x", "y"))
    assert path.parent == directory and re.fullmatch(r"part-[0-9a-f]{32}\.parquet", path.name)
    assert sorted(p.name for p in directory.iterdir()) == [path.name]  # no temporary left
    assert _rows(pq.read_table(path)) == [("x", 0, [0, 1], "note x"), ("y", 1, [1, 2], "note y")]
    group = pq.ParquetFile(path).metadata.row_group(0)
    columns = {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}
    assert {c.compression for c in columns.values()} == {"ZSTD"}
    assert {name for name, c in columns.items() if c.dictionary_page_offset is not None} == {"id", "note"}
    assert parts._dictionary_columns(pa.schema([("a", pa.large_string()), ("b", pa.int8()), ("c", pa.string())])) == [
        "a", "c"]
    # every page carries its checksum: a flipped byte in a data page is an error, not a value
    data = bytearray(path.read_bytes())
    data[columns["n"].data_page_offset + columns["n"].total_compressed_size - 1] ^= 0xFF  # the page's last byte
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: cannot read data pages (") + ".*CRC"):
        verify_content(path, bytes(data), FLAT)


def test_a_part_given_a_name_and_a_stamp_keeps_both_and_its_own_metadata(tmp_path):
    seen = []

    def stamp(final):
        seen.append(final)
        return b"mine"

    table = _table("x").replace_schema_metadata({b"k": b"v"})
    path = write_part(tmp_path, table, name="part-one.parquet", stamp=stamp)
    assert path == tmp_path / "part-one.parquet" and seen == [path]
    assert pq.read_schema(path).metadata == {b"k": b"v", STAMP_KEY: b"mine"}
    assert stamp_of(path) == b"mine"
    assert stamp_of(write_part(tmp_path, _table("y"))) is None
    with pytest.raises(WarehouseError, match=re.escape(f"{tmp_path / 'nothing'}: not a readable Parquet file")):
        stamp_of(tmp_path / "nothing")


def test_a_part_is_never_overwritten_even_by_a_racing_writer(tmp_path, monkeypatch):
    path = write_part(tmp_path, _table("x"), name="part-one.parquet")
    before = path.read_bytes()
    with pytest.raises(PartExistsError, match=re.escape(f"{path}: part already exists; parts are never overwritten")):
        write_part(tmp_path, _table("y"), name="part-one.parquet")
    # a writer that finds the name free, then loses the race at the link
    real_link = os.link

    def racing(source, target):
        (tmp_path / "part-two.parquet").write_bytes(b"the other writer's")
        real_link(source, target)

    monkeypatch.setattr(os, "link", racing)
    with pytest.raises(PartExistsError, match=re.escape(f"{tmp_path / 'part-two.parquet'}: part already exists")):
        write_part(tmp_path, _table("y"), name="part-two.parquet")
    assert path.read_bytes() == before and (tmp_path / "part-two.parquet").read_bytes() == b"the other writer's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-one.parquet", "part-two.parquet"]


@pytest.mark.parametrize("code", [errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK])
def test_a_file_system_without_hard_links_gets_the_part_by_rename(tmp_path, monkeypatch, code):
    def no_links(source, target):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "link", no_links)
    path = write_part(tmp_path, _table("x"), name="part-one.parquet")
    assert _rows(pq.read_table(path)) == [("x", 0, [0, 1], "note x")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-one.parquet"]


def test_a_failed_write_is_one_error_naming_the_part_and_leaves_nothing(tmp_path, monkeypatch):
    def fails(source, target):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "link", fails)
    with pytest.raises(WriteError, match=re.escape(f"{tmp_path / 'part-one.parquet'}: cannot write it (Input/output "
                                                   "error)")):
        write_part(tmp_path, _table("x"), name="part-one.parquet")
    assert list(tmp_path.iterdir()) == []
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(WriteError, match=re.escape(f"{blocked / 'under'}: cannot write it (Not a directory)")):
        write_part(blocked / "under", _table("x"))


def test_the_temporary_name_is_hidden_and_names_its_writer(tmp_path):
    name = temporary_name("part-one.parquet")
    assert name == f".part-one.parquet.{socket.gethostname()}.{os.getpid()}.tmp"
    assert list(tmp_path.glob(parts.PART_GLOB)) == [] and parts.TEMPORARY_GLOB == ".part-*.tmp"
    assert re.fullmatch(r"part-merged-[0-9a-f]{32}\.parquet", parts.new_merged_name())
    assert parts.new_part_name() != parts.new_part_name()


def test_leftovers_go_when_linked_into_place_or_their_writer_is_gone_and_stay_otherwise(tmp_path):
    host = socket.gethostname()
    finished = ended_pid()
    linked_part = write_part(tmp_path, _table("x"), name="part-linked.parquet")
    linked = tmp_path / ".part-linked.parquet.otherhost.1.tmp"
    os.link(linked_part, linked)  # killed between the link and the unlink, on any host
    gone = tmp_path / f".part-gone.parquet.{host}.{finished}.tmp"
    running = tmp_path / f".part-running.parquet.{host}.{os.getpid()}.tmp"
    elsewhere = tmp_path / f".part-elsewhere.parquet.otherhost.{finished}.tmp"
    unlinked_twin = tmp_path / f".part-linked2.parquet.{host}.{os.getpid()}.tmp"
    write_part(tmp_path, _table("y"), name="part-linked2.parquet")  # a part of that name, another file
    for path in (gone, running, elsewhere, unlinked_twin):
        path.write_bytes(b"partial")
    assert remove_leftovers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [running.name, elsewhere.name, unlinked_twin.name, "part-linked.parquet", "part-linked2.parquet"])
    assert remove_leftovers(tmp_path) == 0
    assert remove_leftovers(tmp_path / "none") == 0
    assert remove_leftovers(linked_part) == 0  # a file, not a directory


def test_a_merged_part_lists_what_it_replaces_sorted_and_streams_row_groups(tmp_path, monkeypatch):
    tables = [_table("a", "b"), _table("c", start=2), _table("d", "e", start=3)]
    path = write_merged(tmp_path, "part-merged-1.parquet", tables, FLAT, ["part-b.parquet", "part-a.parquet"],
                        stamp=lambda final: final.name.encode())
    metadata = pq.read_schema(path).metadata
    assert metadata == {REPLACES_KEY: b'["part-a.parquet", "part-b.parquet"]', STAMP_KEY: b"part-merged-1.parquet"}
    assert _rows(pq.read_table(path)) == _rows(pa.concat_tables(tables))
    assert pq.ParquetFile(path).metadata.num_row_groups == 1  # gathered up to the row group size
    assert validate_part(path, FLAT) == ("part-a.parquet", "part-b.parquet")
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    # small row groups: written as soon as the gathered tables reach the size, the rest at the end
    monkeypatch.setattr(parts, "_ROW_GROUP_BYTES", tables[0].nbytes + 1)
    path = write_merged(tmp_path, "part-merged-2.parquet", tables, FLAT, [])
    file = pq.ParquetFile(path)
    assert [file.metadata.row_group(i).num_rows for i in range(file.metadata.num_row_groups)] == [3, 2]
    assert _rows(file.read()) == _rows(pa.concat_tables(tables))
    monkeypatch.setattr(parts, "_ROW_GROUP_BYTES", tables[0].nbytes)
    path = write_merged(tmp_path, "part-merged-3.parquet", tables, FLAT, [])
    file = pq.ParquetFile(path)
    assert [file.metadata.row_group(i).num_rows for i in range(file.metadata.num_row_groups)] == [2, 3]
    assert pq.read_schema(path).metadata == {REPLACES_KEY: b"[]"}
    assert write_merged(tmp_path, "part-merged-4.parquet", [], FLAT, []).exists()  # nothing to merge: no rows
    assert pq.read_metadata(tmp_path / "part-merged-4.parquet").num_rows == 0


# ---------------------------------------------------------------------------------------------
# Listing and visibility


def test_parts_are_listed_by_partition_then_name_and_nothing_else_is(tmp_path):
    root = tmp_path
    for iteration, name in [(1, "part-b.parquet"), (0, "part-c.parquet"), (1, "part-a.parquet")]:
        write_part(root / "things" / f"iteration={iteration}", _table("x"), name=name)
    (root / "things" / "iteration=0" / ".part-d.parquet.host.1.tmp").write_bytes(b"")
    (root / "things" / "iteration=0" / "part-e.csv").write_bytes(b"")
    (root / "things" / "iteration=0" / "notes.parquet").write_bytes(b"")
    (root / "things" / "other").mkdir()
    (root / "things" / "iteration=9").write_bytes(b"")  # a file, not a partition
    names = [relative_name(p, root / "things") for p in list_parts(root, THINGS)]
    assert names == ["iteration=0/part-c.parquet", "iteration=1/part-a.parquet", "iteration=1/part-b.parquet"]
    assert [p.name for p in list_parts(root, THINGS, {"iteration": 1})] == ["part-a.parquet", "part-b.parquet"]
    assert [p.name for p in list_parts(root, THINGS, {"iteration": None})] == [
        "part-c.parquet", "part-a.parquet", "part-b.parquet"]
    assert list_parts(root, THINGS, {"iteration": 7}) == []
    assert list_parts(tmp_path / "none", THINGS) == []
    assert relative_name(root / "things" / "iteration=0" / "part-c.parquet", root / "things") == (
        "iteration=0/part-c.parquet")
    write_part(root / "flat", _table("x"), name="part-z.parquet")
    assert [p.name for p in list_parts(root, FLAT, {"iteration": 1})] == ["part-z.parquet"]  # no such key


def test_a_merged_part_hides_the_parts_it_replaces_in_its_own_directory_only(tmp_path):
    base = tmp_path / "things"
    for iteration in (0, 1):
        for name in ("part-a.parquet", "part-b.parquet", "part-c.parquet"):
            write_part(base / f"iteration={iteration}", _table("x"), name=name)
    write_merged(base / "iteration=0", "part-merged-1.parquet", [_table("x", "y")], THINGS,
                 ["part-a.parquet", "part-b.parquet"])
    seen = [relative_name(p, base) for p in visible_parts(tmp_path, THINGS)]
    assert seen == ["iteration=0/part-c.parquet", "iteration=0/part-merged-1.parquet", "iteration=1/part-a.parquet",
                    "iteration=1/part-b.parquet", "iteration=1/part-c.parquet"]
    asked = []

    def replaces_of(path):
        asked.append(path.name)
        return ("part-c.parquet",)

    seen = [relative_name(p, base) for p in visible_parts(tmp_path, THINGS, {"iteration": 0}, replaces_of)]
    assert seen == ["iteration=0/part-a.parquet", "iteration=0/part-b.parquet", "iteration=0/part-merged-1.parquet"]
    assert asked == ["part-merged-1.parquet"]  # only merged parts' footers are read
    bad = write_merged(base / "iteration=1", "part-merged-2.parquet", [_table("x")], THINGS, [])
    pq.write_table(_table("x"), bad)  # no replaces list: a merged part that cannot say what it hides
    with pytest.raises(WarehouseError, match=re.escape(f"{bad}: merged part without a readable 'cleaner.replaces' "
                                                       "list")):
        visible_parts(tmp_path, THINGS)


def test_a_part_of_a_committed_dataset_is_seen_only_with_its_marker(tmp_path):
    from cleaner.warehouse import schema

    rollouts, segments = schema.ROLLOUTS, schema.SEGMENTS
    table = lambda dataset: dataset.schema.empty_table()  # noqa: E731
    for name in ("part-a.parquet", "part-b.parquet"):
        write_part(tmp_path / "segments" / "iteration=0", table(segments), name=name)
    write_part(tmp_path / "segments" / "iteration=1", table(segments), name="part-a.parquet")
    write_part(tmp_path / "rollouts" / "iteration=0", table(rollouts), name="part-b.parquet")
    write_part(tmp_path / "rollouts" / "iteration=1", table(rollouts), name="part-a.parquet")
    write_part(tmp_path / "rollouts" / "iteration=0", table(rollouts), name="part-c.parquet")  # its twin not yet
    seen = [relative_name(p, tmp_path / "segments") for p in visible_parts(tmp_path, segments)]
    assert seen == ["iteration=0/part-b.parquet", "iteration=1/part-a.parquet"]
    assert [p.name for p in visible_parts(tmp_path, segments, {"iteration": 1})] == ["part-a.parquet"]
    markers = [tmp_path / "rollouts" / "iteration=0" / "part-a.parquet"]  # what the caller says is visible
    assert [relative_name(p, tmp_path / "segments") for p in visible_parts(tmp_path, segments, marker_parts=markers)
            ] == ["iteration=0/part-a.parquet"]
    assert visible_parts(tmp_path, segments, marker_parts=[]) == []


# ---------------------------------------------------------------------------------------------
# Footers and content


def test_a_footer_is_checked_against_the_datasets_schema_naming_the_column(tmp_path):
    path = tmp_path / "part-x.parquet"
    check_schema(path, SCHEMA, THINGS)
    check_schema(path, pa.schema([f for f in SCHEMA if f.name != "note"]), THINGS)  # added later: may be missing
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: missing column 'note' (flat expects string)")):
        check_schema(path, pa.schema([f for f in SCHEMA if f.name != "note"]), FLAT)
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: missing column 'n' (things expects int64)")):
        check_schema(path, pa.schema([f for f in SCHEMA if f.name != "n"]), THINGS)
    retyped = pa.schema([("n", pa.int32()) if f.name == "n" else f for f in SCHEMA])
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: column 'n' has type int32, expected int64")):
        check_schema(path, retyped, THINGS)
    check_schema(path, SCHEMA.append(pa.field("extra", pa.int8())), THINGS)  # a column it does not know: no harm


def test_validating_a_part_reads_its_footer_and_names_what_is_wrong(tmp_path):
    plain = write_part(tmp_path, _table("x"), name="part-a.parquet")
    assert validate_part(plain, THINGS) == ()
    garbage = tmp_path / "part-b.parquet"
    garbage.write_bytes(b"not parquet at all")
    with pytest.raises(WarehouseError, match=re.escape(f"{garbage}: not a readable Parquet file (")):
        validate_part(garbage, THINGS)
    narrow = write_part(tmp_path, _table("x").drop_columns(["n"]), name="part-c.parquet")
    with pytest.raises(WarehouseError, match=re.escape(f"{narrow}: missing column 'n'")):
        validate_part(narrow, THINGS)


@pytest.mark.parametrize("raw", [None, b"not json", b'{"a": 1}', b'["a", 2]', b'"part-a.parquet"'])
def test_a_merged_part_whose_list_is_missing_or_not_names_is_refused(tmp_path, raw):
    table = _table("x")
    if raw is not None:
        table = table.replace_schema_metadata({REPLACES_KEY: raw})
    path = write_part(tmp_path, table, name=f"{MERGED_PREFIX}1.parquet")
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: merged part without a readable 'cleaner.replaces' "
                                                       "list")):
        validate_part(path, THINGS)
    assert validate_part(write_part(tmp_path, table, name="part-plain.parquet"), THINGS) == ()  # not merged: no list


def test_the_whole_content_is_checked_and_its_footer_given(tmp_path):
    path = write_merged(tmp_path, "part-merged-1.parquet", [_table("x", "y")], THINGS, ["part-a.parquet"],
                        stamp=lambda final: b"stamp")
    content, found = read_whole(path)
    assert content == path.read_bytes() and found == identity(path)
    stat = os.stat(path)
    assert found == Identity(stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)
    assert verify_content(path, content, THINGS) == Footer(("part-a.parquet",), b"stamp")
    plain = write_part(tmp_path, _table("x"))
    assert verify_content(plain, plain.read_bytes(), THINGS) == Footer((), None)
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: not a readable Parquet file (")):
        verify_content(path, content[: len(content) // 2], THINGS)
    wider = Dataset("flat", dict, SCHEMA.append(pa.field("note2", pa.int8())), ())
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: missing column 'note2' (flat expects int8)")):
        verify_content(path, content, wider)
    for reader in (read_whole, identity):
        with pytest.raises(WarehouseError, match=re.escape(f"{tmp_path / 'gone'}: not a readable Parquet file (")):
            reader(tmp_path / "gone")


def test_a_row_group_whose_values_contradict_its_footers_statistics_is_named(tmp_path):
    """A page checksum covers a page's data, not its header: statistics catch a header's flip."""
    path = write_part(tmp_path, _table("x", "y", "z", start=5), name="part-a.parquet")
    metadata = pq.ParquetFile(path).metadata.row_group(0)
    wrong_range = pa.table({"id": ["x", "y", "z"], "n": [5, 6, 9], "tokens": [[5, 6], [6, 7], [7, 8]],
                            "note": ["a", "b", "c"]}, schema=SCHEMA)
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: cannot read data pages (column n decodes values in "
                                                       "[5, 9] where its footer says [5, 7])")):
        parts._check_statistics(path, wrong_range, metadata)
    low = wrong_range.set_column(1, "n", pa.array([4, 6, 7], pa.int64()))
    with pytest.raises(WarehouseError, match=re.escape("decodes values in [4, 7] where its footer says [5, 7]")):
        parts._check_statistics(path, low, metadata)
    nulls = wrong_range.set_column(0, "id", pa.array(["x", None, "z"]))
    with pytest.raises(WarehouseError, match=re.escape(f"{path}: cannot read data pages (column id decodes 1 null(s) "
                                                       "where its footer counts 0)")):
        parts._check_statistics(path, nulls, metadata)
    parts._check_statistics(path, pq.read_table(path), metadata)  # as written: agrees
    parts._check_statistics(path, pq.read_table(path).drop_columns(["n"]), metadata)  # a name not there: skipped


# ---------------------------------------------------------------------------------------------
# Reading


def test_parts_read_in_the_datasets_schema_and_a_missing_added_column_as_its_default(tmp_path):
    old = write_part(tmp_path, _table("x", "y").drop_columns(["note"]).replace_schema_metadata({b"k": b"v"}),
                     name="part-a.parquet")
    new = write_part(tmp_path, _table("z", start=2).select(["note", "tokens", "n", "id"]), name="part-b.parquet")
    table = read_parts([old, new], THINGS)
    assert table.schema == SCHEMA and table.schema.metadata is None
    assert _rows(table) == [("x", 0, [0, 1], "none yet"), ("y", 1, [1, 2], "none yet"), ("z", 2, [2, 3], "note z")]
    assert read_parts([], THINGS).schema == SCHEMA and read_parts([], THINGS).num_rows == 0
    assert read_part(new, FLAT).column_names == list(SCHEMA.names)  # no added columns: read by the schema's names
    assert read_column([old, new], THINGS, "note").to_pylist() == ["none yet", "none yet", "note z"]
    assert read_column([old, new], THINGS, "n").to_pylist() == [0, 1, 2]
    column = read_column([old, new], THINGS, "tokens")
    assert column.type == pa.list_(pa.int32()) and column.to_pylist() == [[0, 1], [1, 2], [2, 3]]
    assert read_column([], THINGS, "n").type == pa.int64() and len(read_column([], THINGS, "n")) == 0
    assert parts._filled(THINGS, "n", 3, 2).to_pylist() == [3, 3] and parts._filled(THINGS, "n", 3, 2).type == pa.int64()


def test_a_read_that_fails_names_the_part(tmp_path):
    good = write_part(tmp_path, _table("x"), name="part-a.parquet")
    bad = tmp_path / "part-b.parquet"
    content = good.read_bytes()
    bad.write_bytes(content[:-12] + b"\0" * 12)  # the footer's length and magic gone
    for read in (lambda: read_parts([good, bad], THINGS), lambda: read_part(bad, FLAT),
                 lambda: read_column([good, bad], THINGS, "n"), lambda: read_column([bad], THINGS, "note")):
        with pytest.raises(WarehouseError, match=re.escape(f"{bad}: cannot read data pages (")):
            read()


def test_a_directory_is_synced_and_one_that_is_not_there_is_an_error(tmp_path):
    parts.fsync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        parts.fsync_dir(tmp_path / "none")


def test_the_replaces_list_is_json_of_the_names(tmp_path):
    path = write_merged(tmp_path, "part-merged-1.parquet", [_table("x")], FLAT, ("b", "a"))
    assert json.loads(pq.read_schema(path).metadata[REPLACES_KEY]) == ["a", "b"]


def test_a_part_is_written_under_its_temporary_name_first(tmp_path, monkeypatch):
    linked = []
    real_link = os.link

    def link(source, target):
        linked.append((os.path.basename(source), os.path.basename(target)))
        real_link(source, target)

    monkeypatch.setattr(os, "link", link)
    write_part(tmp_path, _table("x"), name="part-one.parquet")
    assert linked == [(temporary_name("part-one.parquet"), "part-one.parquet")]  # what remove_leftovers finds


def test_leftovers_of_writers_on_hosts_with_dotted_names_are_read_by_their_last_fields(tmp_path, monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node7.cluster.example")
    gone = tmp_path / f".part-gone.parquet.node7.cluster.example.{ended_pid()}.tmp"
    gone.write_bytes(b"partial")
    part = write_part(tmp_path, _table("x"), name="part-linked.parquet")
    linked = tmp_path / ".part-linked.parquet.odd.parquet.host.1.tmp"  # a host named like a part
    os.link(part, linked)
    assert remove_leftovers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-linked.parquet"]


def test_a_leftover_whose_writer_finishes_meanwhile_is_passed_over_and_the_rest_still_go(tmp_path, monkeypatch):
    host, finished = socket.gethostname(), ended_pid()
    for name in "abc":
        (tmp_path / f".part-{name}.parquet.{host}.{finished}.tmp").write_bytes(b"partial")
    calls = []
    real = parts.writer_gone

    def finishing(owner, pid):  # the first one asked about is gone by the time it is looked at
        calls.append(owner)
        if len(calls) == 1:
            raise FileNotFoundError
        return real(owner, pid)

    monkeypatch.setattr(parts, "writer_gone", finishing)
    assert remove_leftovers(tmp_path) == 2 and len(calls) == 3
    assert len(list(tmp_path.iterdir())) == 1


def test_every_column_is_checked_after_an_added_one_that_is_missing(tmp_path):
    first = Dataset("first", dict, pa.schema([("note", pa.string()), ("n", pa.int64())]), (), added=(("note", ""),))
    with pytest.raises(WarehouseError, match=re.escape("missing column 'n' (first expects int64)")):
        check_schema(tmp_path / "part-x.parquet", pa.schema([("id", pa.string())]), first)


def test_checksums_are_written_into_merged_parts_and_checked_by_every_read(tmp_path):
    plain = write_part(tmp_path, _table("x", "y"), name="part-a.parquet")
    merged = write_merged(tmp_path, "part-merged-1.parquet", [_table("x", "y")], THINGS, [])
    for path in (plain, merged):
        group = pq.ParquetFile(path).metadata.row_group(0)
        chunk = next(group.column(i) for i in range(group.num_columns) if group.column(i).path_in_schema == "n")
        assert chunk.dictionary_page_offset is None and group.column(0).dictionary_page_offset is not None  # id
        data = bytearray(path.read_bytes())
        data[chunk.data_page_offset + chunk.total_compressed_size - 1] ^= 0xFF
        flipped = tmp_path / f"part-flipped-{path.name}"
        flipped.write_bytes(bytes(data))
        crc = re.escape(f"{flipped}: cannot read data pages (") + ".*CRC"
        for read, arguments in [(verify_content, (flipped, bytes(data), THINGS)), (read_part, (flipped, THINGS)),
                                (read_part, (flipped, FLAT)), (read_column, ([flipped], THINGS, "n"))]:
            with pytest.raises(WarehouseError, match=crc):
                read(*arguments)


def test_statistics_are_checked_on_every_flat_integer_column_after_a_nested_one(tmp_path):
    wide = pa.schema([("tokens", pa.list_(pa.int32())), ("k", pa.int32()), ("note", pa.string())])
    path = tmp_path / "part-a.parquet"
    pq.write_table(pa.table({"tokens": [[1], [2]], "k": [3, 4], "note": ["a", "b"]}, schema=wide), path)
    metadata = pq.ParquetFile(path).metadata.row_group(0)
    other_k = pa.table({"tokens": [[1], [2]], "k": [3, 5], "note": ["a", "b"]}, schema=wide)
    with pytest.raises(WarehouseError, match=re.escape("column k decodes values in [3, 5] where its footer says [3, 4]")):
        parts._check_statistics(path, other_k, metadata)  # an INT32 column, after the nested one
    null_note = pa.table({"tokens": [[1], [2]], "k": [3, 4], "note": ["a", None]}, schema=wide)
    with pytest.raises(WarehouseError, match=re.escape("column note decodes 1 null(s) where its footer counts 0")):
        parts._check_statistics(path, null_note, metadata)


def test_visibility_asks_the_callers_replaces_of_for_the_markers_too_and_keeps_to_the_partition(tmp_path):
    from cleaner.warehouse import schema

    rollouts, segments = schema.ROLLOUTS, schema.SEGMENTS
    for iteration in (0, 1):
        write_part(tmp_path / "segments" / f"iteration={iteration}", segments.schema.empty_table(), name="part-a.parquet")
        write_part(tmp_path / "rollouts" / f"iteration={iteration}", rollouts.schema.empty_table(), name="part-a.parquet")
    unreadable = tmp_path / "rollouts" / "iteration=0" / "part-merged-1.parquet"
    unreadable.write_bytes(b"its footer is the caller's to read")  # the manifest's verified answer stands for it
    asked = []

    def replaces_of(path):
        asked.append(relative_name(path, tmp_path))
        return ()

    seen = visible_parts(tmp_path, segments, {"iteration": 0}, replaces_of)
    assert [relative_name(p, tmp_path) for p in seen] == ["segments/iteration=0/part-a.parquet"]
    assert asked == ["rollouts/iteration=0/part-merged-1.parquet"]
    every_marker = list_parts(tmp_path, rollouts)
    seen = visible_parts(tmp_path, segments, {"iteration": 1}, replaces_of, marker_parts=every_marker)
    assert [relative_name(p, tmp_path) for p in seen] == ["segments/iteration=1/part-a.parquet"]


def test_an_added_column_a_part_lacks_reads_as_its_default_in_the_columns_type(tmp_path):
    later = Dataset("later", dict, pa.schema([("id", pa.string()), ("score", pa.float32()), ("k", pa.int32())]), (),
                    added=(("score", 0), ("k", None)))
    old = write_part(tmp_path, pa.table({"id": ["x", "y"]}), name="part-a.parquet")
    for column, expected in [("score", [0.0, 0.0]), ("k", [None, None])]:
        read = read_column([old], later, column)
        assert read.type == later.schema.field(column).type and read.to_pylist() == expected
    assert parts._filled(later, "k", None, 2).type == pa.int32()
