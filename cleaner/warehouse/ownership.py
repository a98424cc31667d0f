"""Which parts a warehouse wrote (docs/architecture.md §3, "Own parts and the gate").

A file named `part-*.parquet` under a dataset's directory is not thereby a part of the warehouse:
a `cp` from another warehouse, a part copied under a new name, or DuckDB's `COPY ... TO` into a
partition looks the same to a directory listing, and a reader that took it would count its rows
beside the warehouse's own (every rollout twice). So every part cleaner writes carries a stamp in
its footer's key-value metadata (`STAMP_KEY`): the warehouse's id and the part's own path under the
warehouse root. A part is the warehouse's own iff its stamp names this warehouse and this path.

Design decisions:
- The id is a random one, in `<root>/.warehouse.json`, made by the first write of a part (so a job
  that fails before writing leaves no file behind), with the warehouse's format version (format.py). A copy of the whole warehouse (`cp -r`, a
  backup restored) keeps its id and its paths, so its parts stay its own; a part restored from a
  backup under its own name is its own again; a part renamed or copied under another name, or
  copied in from another warehouse, is not.
- The stamp travels inside the part, as compaction's list of replaced parts does, so no ledger
  beside the data can disagree with it or go missing; the manifest (a cache) then pins the
  verdict with the part's bytes, so it is read once per part.
- Parts an older cleaner wrote carry no stamp. The first stamping write lists the part files then
  present in the identity file (`legacy`): those are taken as the warehouse's own, since nothing
  can tell them from a copy any more; so is an unstamped part the manifest verified before (an
  older reader read it). A warehouse no stamping cleaner has written (no identity file: an older
  one, read on a read-only file system) takes every unstamped part as its own, as before. One
  without its identity file whose parts carry stamps was copied without its hidden files: its
  parts are named with that advice, and no write makes a new id, which would disown them all.
- A part not its own is named, never adopted silently: the readers refuse its iteration
  (`gate.py`), the views leave it out, and `adopt` (its rows rewritten as the warehouse's own) or
  `remove` (`foreign.py`) settles it.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from cleaner.errors import write_error
from cleaner.warehouse.format import FORMAT_VERSION
from cleaner.warehouse.parts import (
    STAMP_KEY,
    PartExistsError,
    WarehouseError,
    link_into_place,
    list_parts,
    relative_name,
    stamp_of,
)
from cleaner.warehouse.schema import DATASETS

__all__ = ["IDENTITY_FILE", "STAMP_KEY", "Ownership", "claim", "ownership"]

IDENTITY_FILE = ".warehouse.json"


@dataclass(frozen=True)
class Ownership:
    """What tells this warehouse's parts from others' (module docstring)."""

    root: Path
    warehouse_id: str | None  # None: no stamping cleaner has written here yet
    legacy: frozenset[str]  # paths under the root of the unstamped parts present at the first stamping write
    format_version: int = 1  # the oldest format its data has (format.py); 1 without the record

    def stamp(self, path: Path) -> bytes:
        """The footer value of a part this warehouse writes at `path`."""
        if self.warehouse_id is None:
            raise ValueError(f"{self.root}: a part is stamped only by a warehouse with an id (claim it first)")
        return json.dumps({"warehouse": self.warehouse_id, "path": relative_name(path, self.root)}).encode()

    def foreign_reason(self, path: Path, stamp: bytes | None) -> str | None:
        """None if the part at `path` with footer value `stamp` is this warehouse's own, else why
        it is not (what it is, in a few words)."""
        if stamp is None:
            if self.warehouse_id is None or relative_name(path, self.root) in self.legacy:
                return None
            return "it carries no cleaner stamp: a file copied in or written by another program (e.g. `COPY ... TO`)"
        try:
            found = json.loads(stamp)
            warehouse, written_as = str(found["warehouse"]), str(found["path"])
        except (ValueError, TypeError, KeyError):
            return "its cleaner stamp is unreadable"
        if self.warehouse_id is None and written_as == relative_name(path, self.root):
            return (f"it was written by warehouse {warehouse} as this path, and {self.root / IDENTITY_FILE}, which "
                    "says whose parts are this warehouse's, is missing: if this is that warehouse copied without its "
                    "hidden files, copy that file back")
        if warehouse != self.warehouse_id:
            return f"it was written by another warehouse (id {warehouse}) as {written_as}"
        if written_as != relative_name(path, self.root):
            return f"it is a copy of this warehouse's part {written_as} under another name"
        return None


def ownership(root: Path) -> Ownership:
    """The warehouse's ownership record as it is (no id if no stamping cleaner has written)."""
    path = root / IDENTITY_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Ownership(root, None, frozenset())
    except OSError as error:
        raise WarehouseError(f"{path}: cannot be read ({error.strerror})") from error
    try:
        document = json.loads(text)
        return Ownership(root, str(document["id"]), frozenset(str(name) for name in document["legacy"]),
                         int(document.get("format", 1)))
    except (ValueError, TypeError, KeyError) as error:
        raise WarehouseError(f"{path}: not the warehouse's identity file cleaner writes (a JSON object with "
                             f"its id and its older parts; {error}): restore it from a copy of the warehouse"
                             ) from error


def claim(root: Path) -> Ownership:
    """The ownership record, made now if the warehouse has none (the first stamping write): a new
    id, and every part file present listed as the warehouse's own. Writers racing to make it agree
    on the first one linked into place."""
    found = ownership(root)
    if found.warehouse_id is not None:
        return found
    present = [part for dataset in DATASETS.values() for part in list_parts(root, dataset)]
    stamped = next((part for part in present if stamp_of(part) is not None), None)
    if stamped is not None:  # a warehouse copied without its hidden files: a new id would disown every part
        raise WarehouseError(f"{root}: {stamped} was written by a cleaner that stamps its parts, but "
                             f"{root / IDENTITY_FILE} is missing; copy it back from the warehouse this one was copied "
                             "from (a copy without hidden files loses it): nothing is written until then")
    legacy = sorted(relative_name(part, root) for part in present)
    final = root / IDENTITY_FILE
    temporary = root / f".{IDENTITY_FILE}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        version = 1 if legacy else FORMAT_VERSION  # parts an older cleaner wrote are of its format
        temporary.write_text(json.dumps({"id": uuid.uuid4().hex, "legacy": legacy, "format": version}))
        with contextlib.suppress(PartExistsError):  # another writer made it first: theirs holds
            link_into_place(temporary, final)
    except OSError as error:
        raise write_error(final, error) from error
    finally:
        temporary.unlink(missing_ok=True)
    return ownership(root)


def foreign_part(owner: Ownership, path: Path) -> str | None:
    """Why the part at `path` is not the warehouse's, judged by its footer's stamp alone (None: it
    is, or it is gone); for parts no reader reads (a segments part no rollouts part commits)."""
    try:
        return owner.foreign_reason(path, stamp_of(path))
    except WarehouseError:
        if path.exists():
            raise
        return None  # removed meanwhile (a collection's own cleanup)


def foreign_line(root: Path, path: Path, reason: str, consequence: str = "its rows are left out") -> str:
    """The one line that names a part the warehouse did not write, what that means for the reader
    (`consequence`), and what settles it."""
    return (f"{path}: not a part this warehouse wrote ({reason}); {consequence} until `cleaner warehouse -w {root} "
            f"--adopt {path}` makes its rows the warehouse's or `--remove {path}` deletes it")
