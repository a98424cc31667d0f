"""The validation manifest: each immutable part's footer is checked once (docs/architecture.md §3).

`<warehouse>/.manifest/<dataset>.json` maps each validated part (its path under the dataset's
directory) to its size, its mtime in nanoseconds and, for a merged part, the parts it replaces.

Design decisions:
- Parts are never modified in place, so (path, size, mtime) identifies a footer that was read and
  found right. A part whose size or mtime differs from its entry, or that has none, is validated
  again; only parts that pass are entered, so a corrupt part is named on every read, even one an
  earlier manifest listed under another size or mtime.
- The dataset's schema is fingerprinted into the manifest: a manifest written against another
  schema (another version of cleaner) is ignored as a whole.
- It is a cache beside the data, never the data: written only after every part of the read passed,
  atomically (a temporary file of its own, renamed over the old one), so concurrent readers at worst
  overwrite each other's entries, which costs a re-validation and nothing else. An unreadable or
  unparsable manifest counts as empty, and a reader that cannot write one (a read-only warehouse)
  still works. It is not fsynced: after a power loss a torn file fails to parse and is ignored.
- Entries of parts a read no longer saw (removed by compaction) are dropped when it saves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from cleaner.warehouse.parts import WarehouseError, relative_name, validate_part
from cleaner.warehouse.schema import Dataset

logger = logging.getLogger(__name__)

MANIFEST_DIR = ".manifest"
_FORMAT = 1


@dataclass(frozen=True)
class PartEntry:
    size: int  # bytes
    mtime_ns: int  # st_mtime_ns when it was validated
    replaces: tuple[str, ...]  # names of the parts a merged part replaces; () for any other


def _fingerprint(dataset: Dataset) -> str:
    return hashlib.sha256(f"{_FORMAT}:{dataset.schema.to_string()}".encode()).hexdigest()[:16]


class Manifest:
    """One dataset's manifest, loaded on construction; `check` each part, then `save`."""

    def __init__(self, root: Path, dataset: Dataset, known: dict[str, PartEntry] | None = None) -> None:
        """`known`: entries to start from instead of the file's (a read-only reader keeps them in
        memory between reads, since it never writes the file)."""
        self.dataset = dataset
        self.path = root / MANIFEST_DIR / f"{dataset.name}.json"
        self._base = root / dataset.name
        self._known = self._load() if known is None else dict(known)
        self._seen: dict[str, PartEntry] = {}
        self.n_validated = 0  # parts whose footer this manifest had to read

    def _load(self) -> dict[str, PartEntry]:
        try:
            document = json.loads(self.path.read_text())
            if document.get("schema") != _fingerprint(self.dataset):
                return {}
            return {name: PartEntry(int(size), int(mtime_ns), tuple(replaces))
                    for name, (size, mtime_ns, replaces) in document["parts"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return {}  # absent, torn or foreign: validate everything again

    def check(self, path: Path) -> tuple[str, ...]:
        """Validate `path` unless its entry matches; return the names it replaces."""
        name = relative_name(path, self._base)
        try:
            stat = os.stat(path)
        except OSError as error:  # removed since it was listed, e.g. by a compaction
            raise WarehouseError(f"{path}: not a readable Parquet file ({error})") from error
        entry = self._known.get(name)
        if entry is None or (entry.size, entry.mtime_ns) != (stat.st_size, stat.st_mtime_ns):
            entry = PartEntry(stat.st_size, stat.st_mtime_ns, validate_part(path, self.dataset))
            self.n_validated += 1
        self._seen[name] = entry
        return entry.replaces

    @property
    def checked(self) -> dict[str, PartEntry]:
        """The entries of the parts checked since loading (what `save` would write)."""
        return dict(self._seen)

    def save(self) -> None:
        """Write the entries of the parts checked since loading, if they differ from the file's."""
        if self._seen == self._known:
            return
        document = {"schema": _fingerprint(self.dataset),
                    "parts": {name: [e.size, e.mtime_ns, list(e.replaces)] for name, e in sorted(self._seen.items())}}
        temporary = self.path.parent / f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            self.path.parent.mkdir(exist_ok=True)
            temporary.write_text(json.dumps(document, separators=(",", ":")))
            os.replace(temporary, self.path)
        except OSError as error:  # a read-only warehouse: the next read validates again
            logger.debug("cannot write %s: %s", self.path, error)
            temporary.unlink(missing_ok=True)
        else:
            self._known = dict(self._seen)
