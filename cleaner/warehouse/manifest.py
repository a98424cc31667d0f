"""The verification manifest: what each part's bytes were when cleaner read all of them
(docs/architecture.md §3, "Checksums").

`<warehouse>/.manifest/<dataset>.json` maps each verified part (its path under the dataset's
directory) to its identity on the file system (size, mtime and ctime in nanoseconds, inode), the
CRC-32 of its whole content and, for a merged part, the parts it replaces.

Verifying a part reads every byte of it once: the CRC-32 of the file; its footer against the
dataset's schema; every page decoded by pyarrow with its page checksum checked (parts.py writes
them); and every page decoded by DuckDB, which checks no page checksum and parses page headers more
strictly than pyarrow, so a part enters the manifest only once both readers that serve it have read
all of it without an error.

Design decisions:
- A part is verified the first time a reader sees it. Later reads trust its entry while its identity
  is unchanged. Any change to a file through the file system (a write, a truncation, `utime`,
  `chmod`, a replacement) sets its ctime to the present, which no unprivileged process can set back,
  so a part edited in place with its size and mtime put back is read again.
- Its bytes are pinned: a part whose identity changed is read again and its CRC-32 compared with its
  entry's. The same bytes pass without decoding (a `touch`, a copy of the warehouse); other bytes are
  an error naming the file, even when they decode, since nothing rewrites a part under its name.
  This is the content check of parts written before cleaner wrote page checksums, and of the bytes
  page checksums do not cover (page headers, the footer).
- Ownership (`ownership.py`) is judged when a part is decoded: a part that is not the warehouse's
  own is never entered, so it is judged again at every read (`foreign`) and an entry means the part
  is the warehouse's; its replaced names hide nothing.
- `rehash` compares every part's CRC-32 with its entry even when its identity is unchanged
  (`cleaner sql --verify`, compaction): the only check that sees bytes changed beneath the file
  system (a failing disk), at the cost of reading the whole warehouse.
- The dataset's schema is fingerprinted into the manifest: a manifest written against another
  schema or format (another version of cleaner) is ignored as a whole.
- Beside the data, never the data: written only after every part of the read passed, atomically (a
  temporary file of its own, renamed over the old one), so concurrent readers at worst lose each
  other's entries, which costs a verification. A read of some partitions merges its entries into the
  file as it is then; `Warehouse.connect()`, which lists every part, also drops the entries of parts
  it no longer saw. An unreadable or unparsable manifest counts as empty, and a reader that cannot
  write one (a read-only warehouse) still works. It is not fsynced: after a power loss a torn file
  fails to parse and is ignored. A lost manifest costs the pins: every part is verified again, and
  what changed in the meantime in bytes no page checksum covers goes unseen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb

from cleaner.warehouse.ownership import Ownership
from cleaner.warehouse.parts import (
    Identity,
    WarehouseError,
    identity,
    read_whole,
    relative_name,
    verify_content,
)
from cleaner.warehouse.schema import Dataset

logger = logging.getLogger(__name__)

MANIFEST_DIR = ".manifest"
_FORMAT = 2


@dataclass(frozen=True)
class PartEntry:
    identity: Identity  # of the file whose bytes were verified
    crc32: int  # CRC-32 of the whole file
    replaces: tuple[str, ...]  # names of the parts a merged part replaces; () for any other

    def to_json(self) -> list:
        return [*dataclasses.astuple(self.identity), self.crc32, list(self.replaces)]

    @classmethod
    def from_json(cls, value: list) -> PartEntry:
        size, mtime_ns, ctime_ns, inode, crc32, replaces = value
        return cls(Identity(int(size), int(mtime_ns), int(ctime_ns), int(inode)), int(crc32),
                   tuple(str(name) for name in replaces))


def _fingerprint(dataset: Dataset) -> str:
    return hashlib.sha256(f"{_FORMAT}:{dataset.schema.to_string()}".encode()).hexdigest()[:16]


class Manifest:
    """One dataset's manifest, loaded on construction; `verify` (or `check`) parts, then `save`."""

    def __init__(self, root: Path, dataset: Dataset, known: dict[str, PartEntry] | None = None, *,
                 rehash: bool = False, owner: Ownership | None = None) -> None:
        """`known`: entries to start from instead of the file's (a read-only reader keeps them in
        memory between reads, since it never writes the file). `owner`: tells the warehouse's own
        parts from others' (None: every part is taken as its own)."""
        self.dataset = dataset
        self.rehash = rehash  # compare every part's CRC-32, even under an unchanged identity
        self.owner = owner
        self.foreign: dict[Path, str] = {}  # parts checked that are not the warehouse's own: why not
        self.path = root / MANIFEST_DIR / f"{dataset.name}.json"
        self._base = root / dataset.name
        self._known = self._load() if known is None else dict(known)
        self._seen: dict[str, PartEntry] = {}  # entries checked by this manifest

    def _load(self) -> dict[str, PartEntry]:
        try:
            document = json.loads(self.path.read_text())
            if document.get("schema") != _fingerprint(self.dataset):
                return {}
            return {name: PartEntry.from_json(value) for name, value in document["parts"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}  # absent, torn or foreign: verify everything again

    @property
    def checked(self) -> dict[str, PartEntry]:
        """The entries of the parts checked since loading (what `save` would write)."""
        return dict(self._seen)

    def check(self, path: Path) -> tuple[str, ...]:
        """Verify one part (`verify`); return the names it replaces (none for a part that is not
        the warehouse's own: its list hides nothing)."""
        replaces = self.verify([path])[0].replaces
        return () if path in self.foreign else replaces

    def verify(self, paths: Sequence[Path]) -> list[PartEntry]:
        """Each part's entry, reading the parts that need it (module docstring); a WarehouseError
        names the first part that fails, and then nothing is entered. A part that is not the
        warehouse's own is not entered either: it goes in `foreign`."""
        entries: dict[str, PartEntry] = {}
        decoded: list[Path] = []
        for path in paths:
            name = relative_name(path, self._base)
            current = identity(path)
            checked = entries.get(name) or self._seen.get(name)  # by this manifest already
            pin = checked or self._known.get(name)
            if pin is None or pin.identity != current or (self.rehash and checked is None):
                entries[name] = self._read(path, pin)
                if pin is None:
                    decoded.append(path)
            else:
                entries[name] = pin
        _check_duckdb_reads(decoded, self.dataset)
        self._seen.update({name: entry for name, entry in entries.items() if self._base / name not in self.foreign})
        return [entries[relative_name(path, self._base)] for path in paths]

    def _read(self, path: Path, pin: PartEntry | None) -> PartEntry:
        content, found = read_whole(path)
        crc32 = zlib.crc32(content)
        if pin is not None and crc32 == pin.crc32:
            return PartEntry(found, crc32, pin.replaces)  # the bytes that were verified (and owned)
        footer = verify_content(path, content, self.dataset)  # names the file if they do not decode
        if pin is not None:
            raise WarehouseError(
                f"{path}: its bytes changed since cleaner verified them (CRC-32 {pin.crc32:08x}, now {crc32:08x}; "
                f"{pin.identity.size} bytes, now {found.size}); parts are never rewritten: restore it from a copy "
                f"(if you replaced it on purpose, delete {self.path})")
        reason = self.owner.foreign_reason(path, footer.stamp) if self.owner is not None else None
        if reason is not None:
            self.foreign[path] = reason
        return PartEntry(found, crc32, footer.replaces)

    def save(self, *, complete: bool = False) -> None:
        """Write the entries checked since loading, if any is new. `complete`: this read saw every
        part of the dataset, so the entries of the others (removed parts) are dropped; otherwise they
        are merged into the file's entries as they are now."""
        if complete:
            if self._seen == self._known:
                return
            entries = dict(self._seen)
        else:
            if all(self._known.get(name) == entry for name, entry in self._seen.items()):
                return
            entries = {**self._load(), **self._seen}
        document = {"schema": _fingerprint(self.dataset),
                    "parts": {name: entry.to_json() for name, entry in sorted(entries.items())}}
        temporary = self.path.parent / f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            self.path.parent.mkdir(exist_ok=True)
            temporary.write_text(json.dumps(document, separators=(",", ":")))
            os.replace(temporary, self.path)
        except OSError as error:  # a read-only warehouse: the next read verifies again
            logger.debug("cannot write %s: %s", self.path, error)
            with contextlib.suppress(OSError):  # on a read-only file system this fails as the write did
                temporary.unlink(missing_ok=True)
        else:
            self._known = entries


def _check_duckdb_reads(paths: Sequence[Path], dataset: Dataset) -> None:
    """Raise WarehouseError naming the first of `paths` whose pages DuckDB cannot decode: it parses
    page headers more strictly than pyarrow (a flipped bit pyarrow skips as an unknown field stops
    it). One scan over all of them, then one per part only to name a failure."""
    if not paths:
        return
    # every value of every column each part has (matched by name, so parts of other vintages mix)
    query = "SELECT bit_xor(hash(COLUMNS(*))) FROM read_parquet(?, hive_partitioning = false, union_by_name = true)"
    # closed however this ends: a refusal's traceback would otherwise keep the database and its
    # worker threads alive until the interpreter exits, which may abort ("terminate called
    # without an active exception") while they still run
    with duckdb.connect(":memory:") as connection:
        try:
            connection.execute(query, [[str(path) for path in paths]]).fetchall()
            return
        except duckdb.Error as error:
            together = str(error)
        for path in paths:
            try:
                connection.execute(query, [[str(path)]]).fetchall()
            except duckdb.Error as error:
                raise WarehouseError(f"{path}: DuckDB cannot read its pages ({error})") from error
    logger.warning("DuckDB reads each of %d %s parts but not all together: %s", len(paths), dataset.name, together)
