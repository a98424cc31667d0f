"""Parquet part files: atomic writes and validating reads.

Writers only ever add part files. A part is written to a hidden temporary name in its final
directory, fsynced, renamed into place (atomic on POSIX) and the directory fsynced, so a crash never
leaves a half-written part where readers look (`part-*.parquet`). Readers check every part's footer
against the dataset's schema and fail with a `WarehouseError` naming the file and the problem.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.errors import CleanerError
from cleaner.warehouse.schema import Dataset

PART_GLOB = "part-*.parquet"


class WarehouseError(CleanerError):
    """A warehouse file is unreadable or does not match its schema."""


def new_part_name() -> str:
    return f"part-{uuid.uuid4().hex}.parquet"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(directory: Path, table: pa.Table, name: str | None = None) -> Path:
    """Write `table` as a new part file in `directory`, atomically. Returns the part's path."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / (name or new_part_name())
    if final.exists():
        raise WarehouseError(f"{final}: part already exists; parts are never overwritten")
    temporary = directory / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as sink:
            pq.write_table(table, sink, compression="zstd", use_dictionary=_dictionary_columns(table))
            sink.flush()
            os.fsync(sink.fileno())
        os.rename(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_dir(directory)
    return final


def _dictionary_columns(table: pa.Table) -> list[str]:
    """Dictionary-encode only string columns: on token and log-prob lists it costs twice the
    write time and saves almost nothing (BENCHMARKS.md, "Purify")."""
    return [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]


def list_parts(root: Path, dataset: Dataset, partition: dict[str, object] | None = None) -> list[Path]:
    """Part files of `dataset` under `root`, optionally restricted to some partition values."""
    base = root / dataset.name
    if not base.is_dir():
        return []
    pattern = "/".join(
        f"{key}={(partition or {}).get(key, '*')}" for key in dataset.partition_keys
    )
    pattern = f"{pattern}/{PART_GLOB}" if pattern else PART_GLOB
    return sorted(base.glob(pattern))


def validate_part(path: Path, dataset: Dataset) -> None:
    """Raise WarehouseError naming `path` if its footer is unreadable or its schema is not the dataset's."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise WarehouseError(f"{path}: not a readable Parquet file ({exc})") from exc
    for field in dataset.schema:
        if field.name not in schema.names:
            raise WarehouseError(f"{path}: missing column {field.name!r} ({dataset.name} expects {field.type})")
        found = schema.field(field.name).type
        if not found.equals(field.type):
            raise WarehouseError(f"{path}: column {field.name!r} has type {found}, expected {field.type}")


def read_parts(paths: list[Path], dataset: Dataset) -> pa.Table:
    """Validate and concatenate part files into one table in the dataset's schema."""
    tables = []
    for path in paths:
        validate_part(path, dataset)
        try:
            table = pq.read_table(path, columns=list(dataset.columns), partitioning=None)
        except (pa.ArrowException, OSError) as exc:
            raise WarehouseError(f"{path}: cannot read data pages ({exc})") from exc
        tables.append(table.cast(dataset.schema))
    if not tables:
        return dataset.schema.empty_table()
    return pa.concat_tables(tables)
