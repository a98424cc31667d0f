"""Parquet part files: atomic writes, validating reads, and which parts readers see.

Writers only ever add part files. A part is written to a hidden temporary name in its final
directory, fsynced, linked into place (atomic on POSIX, and refused if the name exists, so no part is
ever replaced, even by a racing writer) and the directory fsynced, so a crash never leaves a
half-written part where readers look (`part-*.parquet`). Every page is written with its Parquet page
checksum (a CRC-32 of the page's compressed bytes), and every pyarrow read here checks them: a
flipped byte in a page is an error naming the file, never a value. Readers are handed parts the
manifest has verified (`manifest.py`: footer against the schema, every byte read once, and the
parts' bytes pinned), and fail with a `WarehouseError` naming the file and the problem.

Visibility (docs/architecture.md §3) is decided from the file names and two footers' worth of facts:
- a part of a segments dataset is visible only while its twin of the same file name is visible
  in the rollouts dataset that commits it (`schema.COMMITTED_BY`): the twin is the commit marker;
- a merged part (`part-merged-*`, written by compaction) lists the parts it replaces in its footer's
  key-value metadata, so the moment it is renamed into place those parts are hidden, whether or not
  the compaction lived to delete them. The list travels inside the merged file itself, so no
  separate journal can disagree with it or go missing. Only merged parts' footers are read for it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cleaner.errors import CleanerError, write_error, writer_gone
from cleaner.warehouse.schema import COMMITTED_BY, Dataset

PART_GLOB = "part-*.parquet"  # the glob of every part; hidden temporaries start with a dot
MERGED_PREFIX = "part-merged-"
REPLACES_KEY = b"cleaner.replaces"  # footer metadata of a merged part: JSON list of file names
STAMP_KEY = b"cleaner.part"  # footer metadata of every part: whose it is (ownership.py)
_ROW_GROUP_BYTES = 64 * 2**20  # in-memory size a merged part's row group is gathered up to

ReplacesOf = Callable[[Path], tuple[str, ...]]
# What pyarrow raises on a damaged file: a footer's name that is no longer UTF-8 is a ValueError.
_READ_ERRORS = (pa.ArrowException, OSError, ValueError)


class WarehouseError(CleanerError):
    """A warehouse file is unreadable or does not match its schema."""


class PartExistsError(WarehouseError):
    """A part of that name already exists; parts are never overwritten."""


def new_part_name() -> str:
    return f"part-{uuid.uuid4().hex}.parquet"


def new_merged_name() -> str:
    return f"{MERGED_PREFIX}{uuid.uuid4().hex}.parquet"


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TEMPORARY_GLOB = ".part-*.tmp"


def temporary_name(name: str) -> str:
    """The hidden name a part is written under before its rename (readers never glob it): the
    part's name, the writer's host and its process id."""
    return f".{name}.{socket.gethostname()}.{os.getpid()}.tmp"


def remove_leftovers(directory: Path) -> int:
    """Delete the hidden temporaries killed writers left in `directory`; how many went. Safe beside
    running writers, on any host: a temporary goes if it is already linked into place (the same
    file as its part: a writer killed between the link and the unlink), or if its writer, a process
    of this host, is gone."""
    removed = 0
    for temporary in directory.glob(TEMPORARY_GLOB) if directory.is_dir() else ():
        name, _, rest = temporary.name[1:].partition(".parquet.")
        final = directory / f"{name}.parquet"
        owner, _, pid = rest.removesuffix(".tmp").rpartition(".")
        try:
            linked = final.exists() and os.path.samefile(temporary, final)
            gone = writer_gone(owner, pid)
            if linked or gone:
                temporary.unlink()
                removed += 1
        except FileNotFoundError:  # its writer finished meanwhile
            continue
    return removed


def _write_atomically(directory: Path, name: str, write: Callable[[BinaryIO], None]) -> Path:
    """Write a part through `write`, atomically; a failed write (a full disk) is a WriteError
    naming the part, and leaves nothing behind."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise write_error(directory, error) from error
    final = directory / name
    if final.exists():
        raise PartExistsError(f"{final}: part already exists; parts are never overwritten")
    temporary = directory / temporary_name(name)
    try:
        with open(temporary, "wb") as sink:
            write(sink)
            sink.flush()
            os.fsync(sink.fileno())
        link_into_place(temporary, final)
    except OSError as error:  # pyarrow's write errors are OSErrors too
        raise write_error(final, error) from error
    finally:
        temporary.unlink(missing_ok=True)
    fsync_dir(directory)
    return final


def link_into_place(temporary: Path, final: Path) -> None:
    """Give `temporary` the name `final` atomically, never replacing a part already there: the
    manifest pins each part's bytes, so two writers racing to one name (shards writing the same
    `purify_configs` part) must not swap its content under a reader."""
    try:
        os.link(temporary, final)
    except FileExistsError as exc:
        raise PartExistsError(f"{final}: part already exists; parts are never overwritten") from exc
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        os.rename(temporary, final)  # a file system without hard links: rename, as atomic


def write_part(directory: Path, table: pa.Table, name: str | None = None,
               stamp: Callable[[Path], bytes] | None = None) -> Path:
    """Write `table` as a new part file in `directory`, atomically. Returns the part's path.
    `stamp(path)` is the footer's ownership stamp (ownership.py) of the part at its final path."""
    name = name or new_part_name()
    if stamp is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), STAMP_KEY: stamp(directory / name)})

    def write(sink: BinaryIO) -> None:
        pq.write_table(table, sink, compression="zstd", use_dictionary=_dictionary_columns(table.schema),
                       write_page_checksum=True)

    return _write_atomically(directory, name, write)


def write_merged(directory: Path, name: str, tables: Iterable[pa.Table], dataset: Dataset,
                 replaces: Iterable[str], stamp: Callable[[Path], bytes] | None = None) -> Path:
    """Write the concatenation of `tables` as one merged part that replaces the named parts (and
    carries `stamp(path)`, as `write_part`).

    Tables are streamed: small inputs are gathered into row groups of about `_ROW_GROUP_BYTES`,
    so memory stays bounded by a row group, not by the merged part.
    """
    metadata = {REPLACES_KEY: json.dumps(sorted(replaces)).encode()}
    if stamp is not None:
        metadata[STAMP_KEY] = stamp(directory / name)
    schema = dataset.schema.with_metadata(metadata)

    def write(sink: BinaryIO) -> None:
        with pq.ParquetWriter(sink, schema, compression="zstd", use_dictionary=_dictionary_columns(schema),
                              write_page_checksum=True) as writer:
            pending: list[pa.Table] = []
            for table in tables:
                pending.append(table)
                if sum(t.nbytes for t in pending) >= _ROW_GROUP_BYTES:
                    writer.write_table(pa.concat_tables(pending))
                    pending = []
            if pending:
                writer.write_table(pa.concat_tables(pending))

    return _write_atomically(directory, name, write)


def _dictionary_columns(schema: pa.Schema) -> list[str]:
    """Dictionary-encode only string columns: on token and log-prob lists it costs twice the
    write time and saves almost nothing (BENCHMARKS.md, "Purify")."""
    return [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]


def list_parts(root: Path, dataset: Dataset, partition: dict[str, object] | None = None) -> list[Path]:
    """Every part file of `dataset` under `root` (visible or not), optionally in some partitions,
    sorted by directory then name. Listed with `os.scandir`: a read of thousands of parts spends
    most of its time here otherwise."""
    directories = [root / dataset.name]
    for key in dataset.partition_keys:
        value = (partition or {}).get(key)
        if value is not None:
            directories = [d / f"{key}={value}" for d in directories]
        else:
            directories = [d / name for d in directories for name in _names(d, f"{key}=", "")]
    return [d / name for d in directories for name in _names(d, "part-", ".parquet")]


def _names(directory: Path, prefix: str, suffix: str) -> list[str]:
    try:
        with os.scandir(directory) as entries:
            return sorted(e.name for e in entries if e.name.startswith(prefix) and e.name.endswith(suffix))
    except (FileNotFoundError, NotADirectoryError):
        return []


def validate_part(path: Path, dataset: Dataset) -> tuple[str, ...]:
    """Raise WarehouseError naming `path` if its footer is unreadable or its schema is not the
    dataset's; return the names of the parts it replaces (empty unless it is a merged part). Reads
    the footer only: `verify_content` reads the rest."""
    try:
        schema = pq.read_schema(path)
    except _READ_ERRORS as exc:
        raise WarehouseError(f"{path}: not a readable Parquet file ({exc})") from exc
    check_schema(path, schema, dataset)
    return _replaces(path, schema)


def check_schema(path: Path, schema: pa.Schema, dataset: Dataset) -> None:
    """Raise WarehouseError naming `path` and the column if `schema` lacks one of the dataset's (a
    column added later may be missing) or holds it in a type it does not accept."""
    added = dict(dataset.added)
    for field in dataset.schema:
        if field.name not in schema.names:
            if field.name in added:  # a part written before the column existed
                continue
            raise WarehouseError(f"{path}: missing column {field.name!r} ({dataset.name} expects {field.type})")
        found = schema.field(field.name).type
        if not found.equals(field.type):
            raise WarehouseError(f"{path}: column {field.name!r} has type {found}, expected {field.type}")


@dataclass(frozen=True)
class Identity:
    """What the file system says of a part. Writing to a file, truncating it, `utime`, `chmod` or
    replacing it all set its ctime to the present, which no unprivileged process can set back."""

    size: int  # bytes
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, stat: os.stat_result) -> Identity:
        return cls(stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


def identity(path: Path) -> Identity:
    try:
        return Identity.of(os.stat(path))
    except OSError as exc:  # removed since it was listed, e.g. by a compaction
        raise WarehouseError(f"{path}: not a readable Parquet file ({exc})") from exc


def read_whole(path: Path) -> tuple[bytes, Identity]:
    """Every byte of a part, and the identity of the file they were read from."""
    try:
        with open(path, "rb") as source:
            return source.read(), Identity.of(os.fstat(source.fileno()))
    except OSError as exc:
        raise WarehouseError(f"{path}: not a readable Parquet file ({exc})") from exc


@dataclass(frozen=True)
class Footer:
    """What a part's footer says of it besides its schema."""

    replaces: tuple[str, ...]  # the names of the parts a merged part replaces; () for any other
    stamp: bytes | None  # whose part it is (ownership.py); None in a part no stamping cleaner wrote


def verify_content(path: Path, content: bytes, dataset: Dataset) -> Footer:
    """Check a part's whole content: its footer against the dataset's schema, then every page of
    every column decoded with its page checksum checked (a part written without them, before
    cleaner wrote them, is only decoded)."""
    try:
        parquet = pq.ParquetFile(pa.BufferReader(content), page_checksum_verification=True)
        schema = parquet.schema_arrow
    except _READ_ERRORS as exc:
        raise WarehouseError(f"{path}: not a readable Parquet file ({exc})") from exc
    check_schema(path, schema, dataset)
    try:
        for index in range(parquet.num_row_groups):  # one row group in memory at a time
            _check_statistics(path, parquet.read_row_group(index), parquet.metadata.row_group(index))
    except _READ_ERRORS as exc:
        raise WarehouseError(f"{path}: cannot read data pages ({exc})") from exc
    return Footer(_replaces(path, schema), (schema.metadata or {}).get(STAMP_KEY))


def _check_statistics(path: Path, table: pa.Table, row_group: pq.RowGroupMetaData) -> None:
    """A row group's decoded flat columns against the statistics its footer holds (null count, and
    an integer column's min and max). A page checksum covers a page's data, not its header: a byte
    flipped in the header's levels or encodings can decode, checksum intact, to other values, which
    the writer's statistics then contradict."""
    for index in range(row_group.num_columns):
        chunk = row_group.column(index)
        name, stats = chunk.path_in_schema, chunk.statistics
        if stats is None or "." in name or table.schema.get_field_index(name) < 0:
            continue  # no statistics written; a nested column's leaves; a name not there once
        column = table.column(name)
        if stats.has_null_count and column.null_count != stats.null_count:
            raise WarehouseError(f"{path}: cannot read data pages (column {name} decodes {column.null_count} "
                                 f"null(s) where its footer counts {stats.null_count})")
        if (stats.has_min_max and chunk.physical_type in ("INT32", "INT64") and stats.logical_type.type == "NONE"
                and pa.types.is_integer(column.type)):  # not a duration, which is INT64 without a logical type
            found = pc.min_max(column)
            low, high = found["min"].as_py(), found["max"].as_py()
            if (low, high) != (stats.min, stats.max):
                raise WarehouseError(f"{path}: cannot read data pages (column {name} decodes values in "
                                     f"[{low}, {high}] where its footer says [{stats.min}, {stats.max}])")


def stamp_of(path: Path) -> bytes | None:
    """The ownership stamp in a part's footer (reads the footer only)."""
    try:
        return (pq.read_schema(path).metadata or {}).get(STAMP_KEY)
    except _READ_ERRORS as exc:
        raise WarehouseError(f"{path}: not a readable Parquet file ({exc})") from exc


def _replaces(path: Path, schema: pa.Schema) -> tuple[str, ...]:
    if not path.name.startswith(MERGED_PREFIX):
        return ()
    raw = (schema.metadata or {}).get(REPLACES_KEY)
    try:
        names = json.loads(raw) if raw is not None else None
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise WarehouseError(f"{path}: merged part without a readable {REPLACES_KEY.decode()!r} list")
    return tuple(names)


def visible_parts(root: Path, dataset: Dataset, partition: dict[str, object] | None = None,
                  replaces_of: ReplacesOf | None = None, *,
                  marker_parts: list[Path] | None = None) -> list[Path]:
    """The parts readers see, in name order (module docstring).

    `replaces_of(path)` gives a merged part's replaced names (default: validate its footer);
    `marker_parts` are the visible parts of the dataset that commits `dataset` (`COMMITTED_BY`), when
    the caller has them. The commit markers are always listed before the parts they commit: a
    writer adds the part first and its marker second, so a marker seen implies its part is seen.
    """
    marker = COMMITTED_BY.get(dataset.name)
    if marker is not None:
        if marker_parts is None:
            marker_parts = visible_parts(root, marker, partition, replaces_of)
        committed = {relative_name(p, root / marker.name) for p in marker_parts}
        base = root / dataset.name
        return [p for p in list_parts(root, dataset, partition) if relative_name(p, base) in committed]
    parts = list_parts(root, dataset, partition)
    check = replaces_of or (lambda path: validate_part(path, dataset))
    hidden = {f"{p.parent}/{name}" for p in parts if p.name.startswith(MERGED_PREFIX) for name in check(p)}
    return [p for p in parts if str(p) not in hidden] if hidden else parts


def relative_name(path: Path, base: Path) -> str:
    """`path` relative to `base`, as a string (what `Path.relative_to` gives, without its cost)."""
    return str(path)[len(str(base)) + 1:]


def read_parts(paths: list[Path], dataset: Dataset) -> pa.Table:
    """Concatenate verified part files (`manifest.Manifest.verify`) into one table in the dataset's
    schema, checking every page's checksum on the way."""
    tables = [read_part(path, dataset) for path in paths]
    if not tables:
        return dataset.schema.empty_table()
    return pa.concat_tables(tables)


def read_part(path: Path, dataset: Dataset) -> pa.Table:
    """One verified part in the dataset's schema (without a merged part's footer metadata)."""
    try:
        names = set(pq.read_schema(path).names) if dataset.added else set(dataset.columns)
        table = pq.read_table(path, columns=[c for c in dataset.columns if c in names], partitioning=None,
                              page_checksum_verification=True)
    except _READ_ERRORS as exc:
        raise WarehouseError(f"{path}: cannot read data pages ({exc})") from exc
    for name, value in dataset.added:
        if name not in names:  # a part written before the column existed reads as its default
            table = table.append_column(name, _filled(dataset, name, value, table.num_rows))
    return table.select(list(dataset.columns)).cast(dataset.schema).replace_schema_metadata(None)


def _filled(dataset: Dataset, column: str, value: object, length: int) -> pa.Array:
    return pa.array([value] * length, dataset.schema.field(column).type)


def read_column(paths: list[Path], dataset: Dataset, column: str) -> pa.ChunkedArray:
    """One column of verified parts (reads only that column's pages, checking their checksums)."""
    chunks = []
    added = dict(dataset.added)
    for path in paths:
        try:
            if column in added and column not in pq.read_schema(path).names:
                chunks.append(_filled(dataset, column, added[column], pq.read_metadata(path).num_rows))
                continue
            chunks.extend(pq.read_table(path, columns=[column], partitioning=None,
                                        page_checksum_verification=True).column(column).chunks)
        except _READ_ERRORS as exc:
            raise WarehouseError(f"{path}: cannot read data pages ({exc})") from exc
    return pa.chunked_array(chunks, dataset.schema.field(column).type)
