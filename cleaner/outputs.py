"""Output directories swapped into place atomically, and the marker that says cleaner wrote them.

Checkpoints (`train`, `run`, `bootstrap`, the DeepSpeed engine), reports and exported datasets are
written this way; single files (`cleaner curate`'s dataset, its summaries and statistics, `cleaner
sql -o`) by `atomic_files`, each renamed over its path.

Design decisions:
- Atomic replace: everything is written into a temporary directory in the SAME parent (so the
  final rename never crosses a file system), every file and the directory are fsynced, then the
  temporary directory is renamed onto `out_path`. An existing `out_path` is first renamed aside,
  the new one swapped in, and only then the old one deleted. At no moment does `out_path` name a
  half-written output: it is the old complete one, absent (a crash between the two renames; the
  old one is still in `.<name>.old-*` beside it), or the new complete one. On any failure while
  writing, the temporary directory is removed and the exception re-raised.
- Made as `mkdir` and `open` make them: the temporary directory is created with mode 0o777 less
  the umask (not `tempfile.mkdtemp`'s 0700), and before the swap every folder in it gets that mode
  and every file 0o666 less the umask (a writer such as safetensors makes its files 0600), so under
  umask 022 a checkpoint is 755 folders of 644 files that an SGLang server or a colleague under
  another account can read, and under 077 it stays private.
- One writer wins: the swap replaces only what `out_path` was when the writer began (absent, or
  the same directory by device and inode). An output that appeared or was replaced meanwhile (two
  exports racing to one new `--out`) is left as it is and the later writer fails with one line. The
  rename goes onto nothing (what was there is moved aside first and checked to be what was found),
  so one that appears in the instant after the check fails it with ENOTEMPTY: every output holds
  its marker.
- Replacing deletes what was there, so cleaner replaces only a directory it wrote itself, of the
  same kind: every directory it swaps in holds `MARKER`, a JSON file naming the kind (checkpoint,
  report) and the top-level entries written. Anything else is refused with an `OutputError` and
  left untouched: a file, a warehouse, a directory holding anything the marker does not list (a
  user's notes.txt, even added to a checkpoint later), an output of another kind. Commands check
  their outputs before any work (`check_replaceable`), and the swap checks again.
- An empty directory holds nothing to lose: it is taken.
- Files (`atomic_files`): each is written under a hidden name in its final directory (made as
  `open` makes a file), fsynced, then all are renamed into place in the order given and the
  directories fsynced; a failure before the renames replaces nothing. Which existing file may be replaced is the writer's to check (curate
  records its dataset's sha256 in the summary beside it).
- Outputs written before the marker existed are recognised by their files: a checkpoint has
  config.json, a weight file, the config cleaner saved beside it (train_config.json or
  bootstrap*_config.json) and nothing but what a Hugging Face checkpoint holds; a report has
  report.md headed `# cleaner report` and PNGs only. The shipped policies in cleaner/assets/ are such
  checkpoints, so `cleaner bootstrap` can still rewrite them.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import secrets
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path

from cleaner.errors import CleanerError, is_disk_full, write_error, writer_gone

logger = logging.getLogger(__name__)

MARKER = ".cleaner-output.json"  # in every directory cleaner swaps into place
CHECKPOINT, REPORT, DATASET = "checkpoint", "report", "dataset"  # the kinds of output (a dataset: `cleaner export`)
KINDS = (CHECKPOINT, REPORT, DATASET)
REPORT_TITLE = "# cleaner report"  # the first line of every report.md

# What a checkpoint written before the marker holds (top-level names; `optimizer` is a directory).
_CHECKPOINT_FILES = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
    "*.bin.index.json", "*.pt", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "vocab.json", "merges.txt", "*_config.json", "optimizer",
)
_CLEANER_CONFIGS = ("train_config.json", "bootstrap*_config.json")
_WEIGHTS = ("*.safetensors", "*.bin")


class OutputError(CleanerError):
    """An output path cleaner must not replace; the message says what is there."""


# ---------------------------------------------------------------------------
# What may be replaced


def check_replaceable(out_path: str | Path, kind: str) -> None:
    """OutputError unless `out_path` is absent, an empty directory, or a `kind` output cleaner wrote."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(out_path)
    _check_parent(path)
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_dir():
        _refuse(path, kind, "it exists and is a file, not a directory")
    entries = sorted(entry.name for entry in path.iterdir())
    if not entries:
        return
    marker = _read_marker(path)
    if marker is None:
        if _legacy_kind(path, entries) == kind:
            return
        _refuse(path, kind, f"cleaner did not write it (no {MARKER}; it holds {_some(entries)})")
    if marker.get("kind") != kind:
        _refuse(path, kind, f"it is a {marker.get('kind')} cleaner wrote, not a {kind}")
    foreign = [name for name in entries if name != MARKER and name not in marker.get("entries", ())]
    if foreign:
        _refuse(path, kind, f"it holds what cleaner did not write there: {_some(foreign)}")


def check_outside(out_path: str | Path, warehouse: str | Path, option: str) -> None:
    """OutputError unless `out_path` lies outside the warehouse directory: every reader takes
    what is under it for part of the warehouse (a CSV in a partition stops them all). Symbolic
    links are followed, so a link into the warehouse is inside it."""
    out, root = Path(out_path).resolve(), Path(warehouse).resolve()
    if out == root or root in out.parents:
        raise OutputError(f"{option} {out_path} is inside the warehouse {warehouse}: its readers would take it for "
                          "part of the warehouse; write it outside the warehouse directory")


def _refuse(path: Path, kind: str, why: str) -> None:
    raise OutputError(f"{path}: will not replace it with a {kind}: {why}; cleaner replaces only a "
                      f"{kind} it wrote. Choose another path, or move this one away yourself")


def _check_parent(path: Path) -> None:
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"{path}: cannot be created: {parent} is a file, not a directory")
            return


def _some(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _read_marker(path: Path) -> dict | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("written_by") == "cleaner" else None


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch(name, pattern) for pattern in patterns)


def _legacy_kind(path: Path, entries: list[str]) -> str | None:
    """The kind of an output cleaner wrote before the marker existed, recognised by its files."""
    if ("config.json" in entries and any(_matches(name, _WEIGHTS) for name in entries)
            and any(_matches(name, _CLEANER_CONFIGS) for name in entries)
            and all(_matches(name, _CHECKPOINT_FILES) for name in entries)):
        return "checkpoint"
    if "report.md" in entries and all(name == "report.md" or name.endswith(".png") for name in entries):
        try:
            with open(path / "report.md") as page:
                if page.readline().rstrip("\n") == REPORT_TITLE:
                    return "report"
        except (OSError, UnicodeDecodeError):
            return None
    return None


def write_marker(directory: Path, kind: str) -> None:
    """Mark `directory` as a `kind` cleaner wrote, listing what it holds now."""
    entries = sorted(entry.name for entry in directory.iterdir() if entry.name != MARKER)
    marker = {"written_by": "cleaner", "kind": kind, "entries": entries}
    (directory / MARKER).write_text(json.dumps(marker, indent=1) + "\n")


# ---------------------------------------------------------------------------
# Atomic directory


def _fsync_path(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, giving each the mode `open` or `mkdir` gives
    under the umask: some writers make their files 0600 whatever it is (safetensors writes a
    temporary file and renames it). `root` was made by `mkdir(0o777)`, so its mode is the umask's
    complement, and nothing global is read or changed."""
    allowed = os.stat(root).st_mode & 0o777
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory) / name
            executable = os.stat(path).st_mode & 0o111
            os.chmod(path, (0o666 | executable) & allowed)
            _fsync_path(path)
        os.chmod(directory, allowed)
        _fsync_path(Path(directory))


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what `path` names now, None if nothing."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    return status.st_dev, status.st_ino


def _appeared(out_path: Path, kind: str) -> OutputError:
    return OutputError(f"{out_path}: another writer put a {kind} there while this one was writing; that one "
                       f"is kept and this {kind} is not written. Run again to replace it, or choose another path")


def _swap_into_place(new_dir: Path, out_path: Path, kind: str, found: tuple[int, int] | None) -> None:
    """Rename new_dir onto out_path. What is there must still be what was `found` when the writer
    began (and cleaner's own, checked again): it is moved aside first, then deleted."""
    check_replaceable(out_path, kind)
    aside = None
    if found is not None:
        aside = out_path.parent / f".{out_path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(out_path, aside)
        if _identity(aside) != found:  # replaced in the instant since the check
            os.rename(aside, out_path)
            raise _appeared(out_path, kind)
    try:
        os.rename(new_dir, out_path)  # onto nothing, so it fails if anything appeared since
    except OSError as error:
        if aside is not None:
            os.rename(aside, out_path)  # put the previous output back
        if error.errno in (errno.ENOTEMPTY, errno.EEXIST):  # appeared since the check above
            raise _appeared(out_path, kind) from error
        raise
    _fsync_path(out_path.parent)
    if aside is not None:
        shutil.rmtree(aside)


def _make_temporary(out_path: Path) -> Path:
    """A new directory beside `out_path`, named for its writer, made as `mkdir` makes one (0o777
    less the umask; module docstring)."""
    prefix = _temporary_prefix(out_path.name) + _me()
    while True:
        candidate = out_path.parent / (prefix + secrets.token_hex(4))
        try:
            candidate.mkdir(mode=0o777)
        except FileExistsError:
            continue
        return candidate


@contextmanager
def atomic_directory(out_path: str | Path, kind: str) -> Iterator[Path]:
    """Yield a temporary directory; on clean exit it is marked and atomically becomes `out_path`.

    OutputError at once, before the block runs, if `out_path` is not replaceable (module docstring).
    The temporary directories of writers of `out_path` that died are removed first. A write that
    fails for want of space (or on an OSError) is a WriteError naming `out_path` and what to free.
    """
    out_path = Path(out_path).resolve()
    check_replaceable(out_path, kind)
    found = _identity(out_path)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out_path)
        temp_dir = _make_temporary(out_path)
    except OSError as error:
        raise write_error(out_path, error) from error
    try:
        yield temp_dir
        write_marker(temp_dir, kind)
        _fsync_tree(temp_dir)
        _swap_into_place(temp_dir, out_path, kind, found)
    except Exception as error:
        # an OSError, or any error of a writer on a full disk (measured before the cleanup)
        failed = not isinstance(error, CleanerError) and (isinstance(error, OSError) or is_disk_full(error, temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
        if failed:
            raise write_error(out_path, error) from error
        raise
    except BaseException:  # Ctrl-C: nothing half-written stays
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------
# Atomic file


def write_file_atomically(path: str | Path, text: str) -> None:
    """`path` holds `text` whole, or what it held before (`atomic_files` for one file)."""
    with atomic_files([Path(path)]) as (temporary,):
        temporary.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------------------
# Temporary directories of writers that died


def _temporary_prefix(name: str) -> str:
    return f".{name}.tmp-"


def _me() -> str:
    """The writer part of a temporary directory's name: `<pid>@<host>@` (a random tail follows)."""
    return f"{os.getpid()}@{socket.gethostname()}@"


def remove_stale_temporaries(out_path: Path) -> list[Path]:
    """Remove the temporary directories beside `out_path` whose writer, a process of this host, is
    gone (a SIGKILL mid-write leaves a whole checkpoint's size there); those of live processes and
    of other hosts stay. Returns what was removed."""
    removed = []
    prefix = _temporary_prefix(out_path.name)
    for entry in out_path.parent.glob(f"{glob.escape(prefix)}*"):
        pid, at, rest = entry.name[len(prefix):].partition("@")
        writer_host = rest.rpartition("@")[0]
        if not (at and writer_gone(writer_host, pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:  # a file's (write_file_atomically)
            entry.unlink(missing_ok=True)
        logger.info("removed %s, left by pid %s, which is gone", entry, pid)
        removed.append(entry)
    return removed


# ---------------------------------------------------------------------------
# Atomic files


@contextmanager
def atomic_files(paths: list[Path]) -> Iterator[list[Path]]:
    """Yield a temporary path beside each of `paths`; on clean exit each is fsynced and renamed onto
    its path, in order, and the directories fsynced. On any failure the temporaries are removed and
    no path is replaced; a failed write is a WriteError naming the path."""
    paths = [Path(path).resolve() for path in paths]
    temporaries: list[Path] = []
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(path)
            temporary = path.parent / f"{_temporary_prefix(path.name)}{_me()}{secrets.token_hex(4)}"
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # as open makes it: the umask's
            temporaries.append(temporary)
    except OSError as error:
        _remove(temporaries)
        raise write_error(paths[len(temporaries)], error) from error
    try:
        yield list(temporaries)  # a copy: the caller may consume it
        for temporary in temporaries:
            _fsync_path(temporary)
        for temporary, path in zip(temporaries, paths, strict=True):
            os.replace(temporary, path)
        for parent in dict.fromkeys(path.parent for path in paths):
            _fsync_path(parent)
    except BaseException as error:
        _remove(temporaries)
        if isinstance(error, OSError) or (isinstance(error, Exception) and not isinstance(error, CleanerError)
                                          and is_disk_full(error, paths[0])):
            raise write_error(paths[0], error) from error
        raise


def _remove(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
