"""The verification manifest: each part is read in full once, and again only when its identity on
the file system changed; its bytes stay pinned."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse import manifest as manifest_module
from cleaner.warehouse.manifest import MANIFEST_DIR, Manifest
from cleaner.warehouse.parts import list_parts, write_part
from tests.factories import make_rollout, make_segments


@pytest.fixture
def validated(monkeypatch) -> list[Path]:
    """The paths the manifest decodes in full (footer and every page), in order."""
    seen: list[Path] = []
    real = manifest_module.verify_content

    def spy(path, content, dataset):
        seen.append(path)
        return real(path, content, dataset)

    monkeypatch.setattr(manifest_module, "verify_content", spy)
    return seen


def _warehouse(tmp_path: Path, batches: int = 2) -> Warehouse:
    wh = Warehouse(tmp_path / "wh")
    for batch in range(batches):
        wh.write_rollouts(0, [make_rollout(f"r{batch}")], make_segments(f"r{batch}"))
    return wh


def _count(wh: Warehouse, view: str) -> int:
    return wh.connect().sql(f"SELECT count(*) FROM {view}").fetchall()[0][0]


def test_each_part_is_validated_once_then_only_new_ones(tmp_path, validated):
    wh = _warehouse(tmp_path)
    assert _count(wh, "segments") == 12
    assert sorted(validated) == sorted(list_parts(wh.root, schema.ROLLOUTS) + list_parts(wh.root, schema.SEGMENTS))
    validated.clear()
    assert _count(wh, "segments") == 12
    assert validated == []  # the manifest vouches for all four parts
    wh.write_rollouts(1, [make_rollout("r9", iteration=1)], make_segments("r9", iteration=1))
    assert _count(wh, "rollouts") == 3
    assert sorted(validated) == sorted(list_parts(wh.root, schema.ROLLOUTS, {"iteration": 1})
                                       + list_parts(wh.root, schema.SEGMENTS, {"iteration": 1}))
    entries = json.loads((wh.root / MANIFEST_DIR / "rollouts.json").read_text())["parts"]
    assert sorted(entries) == ["iteration=0/" + p.name for p in list_parts(wh.root, schema.ROLLOUTS, {"iteration": 0})] + [
        "iteration=1/" + p.name for p in list_parts(wh.root, schema.ROLLOUTS, {"iteration": 1})]


def test_a_touched_or_copied_part_is_reread_not_decoded(tmp_path, validated):
    wh = _warehouse(tmp_path)
    wh.connect()
    part = list_parts(wh.root, schema.ROLLOUTS)[0]
    os.utime(part, ns=(0, 10**18))  # another mtime and ctime, the same bytes
    copy = part.with_name(".copy")
    copy.write_bytes(part.read_bytes())
    os.replace(copy, part)  # another inode, the same bytes
    validated.clear()
    assert _count(wh, "rollouts") == 2
    assert validated == []  # its CRC-32 matched the manifest's: nothing to decode
    entry = json.loads((wh.root / MANIFEST_DIR / "rollouts.json").read_text())["parts"][f"iteration=0/{part.name}"]
    assert entry[:4] == [part.stat().st_size, part.stat().st_mtime_ns, part.stat().st_ctime_ns, part.stat().st_ino]


def test_a_part_replaced_under_its_name_is_named(tmp_path, validated):
    """Parts are never rewritten: other bytes under a verified part's name are an error, even when
    they are a valid part (the manifest pins what was verified)."""
    wh = _warehouse(tmp_path)
    wh.connect()
    part = list_parts(wh.root, schema.ROLLOUTS)[0]
    replacement = write_part(tmp_path / "elsewhere", schema.to_table(
        schema.ROLLOUTS, [make_rollout("x1"), make_rollout("x2")]))
    os.replace(replacement, part)
    validated.clear()
    for read in (wh.connect, lambda: wh.read_rollouts(0)):
        with pytest.raises(WarehouseError, match=rf"{part}: its bytes changed since cleaner verified them"):
            read()
    assert validated == [part, part]  # decoded to tell a corrupt part from a changed one


def test_a_corrupt_part_is_named_although_the_manifest_listed_it_valid(tmp_path):
    wh = _warehouse(tmp_path)
    wh.connect()
    part = list_parts(wh.root, schema.SEGMENTS)[0]
    stat = part.stat()
    content = bytearray(part.read_bytes())
    content[-8:] = b"garbage!"  # same size, the footer's length and magic destroyed
    part.write_bytes(bytes(content))
    assert part.stat().st_size == stat.st_size
    with pytest.raises(WarehouseError, match=rf"{part}: not a readable Parquet file"):
        wh.connect()
    part.write_bytes(bytes(content[: stat.st_size // 2]))  # truncated, its old mtime put back
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(WarehouseError, match=rf"{part}: not a readable Parquet file"):
        wh.connect()


def test_a_part_with_a_wrong_column_is_named_every_time(tmp_path):
    wh = _warehouse(tmp_path)
    table = schema.to_table(schema.ROLLOUTS, [make_rollout("r9")]).drop_columns(["reward"])
    path = write_part(wh.root / "rollouts" / "iteration=1", table)
    for _ in range(2):  # a failed read enters nothing in the manifest
        with pytest.raises(WarehouseError, match=rf"{path}.*missing column 'reward'"):
            wh.connect()
    assert not (wh.root / MANIFEST_DIR).exists()


def test_an_unreadable_or_foreign_manifest_is_ignored(tmp_path, validated):
    wh = _warehouse(tmp_path, batches=1)
    (wh.root / MANIFEST_DIR).mkdir()
    (wh.root / MANIFEST_DIR / "rollouts.json").write_text('{"schema": "')  # torn
    (wh.root / MANIFEST_DIR / "segments.json").write_text(json.dumps({"schema": "another", "parts": {}}))
    assert _count(wh, "segments") == 6
    assert len(validated) == 2
    assert Manifest(wh.root, schema.ROLLOUTS)._load()  # rewritten, readable


def test_a_reader_that_cannot_write_the_manifest_still_works(tmp_path, monkeypatch, validated):
    wh = _warehouse(tmp_path, batches=1)

    def refuse(*args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(manifest_module.os, "replace", refuse)
    for _ in range(2):
        assert _count(wh, "segments") == 6
    assert len(validated) == 4  # nothing remembered: validated on each read
    assert not [p for p in (wh.root / MANIFEST_DIR).iterdir()]  # no temporary file left behind


def test_concurrent_readers_and_a_writer_never_corrupt_it(tmp_path):
    wh = _warehouse(tmp_path, batches=1)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(15):
                counts = wh.connect().sql("SELECT (SELECT count(*) FROM rollouts), (SELECT count(*) FROM segments)")
                ((rollouts, segments),) = counts.fetchall()
                assert segments == 6 * rollouts
        except BaseException as error:  # handed to the main thread, which fails the test
            errors.append(error)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for thread in readers:
        thread.start()
    for batch in range(1, 16):
        wh.write_rollouts(0, [make_rollout(f"r{batch}")], make_segments(f"r{batch}"))
    for thread in readers:
        thread.join()
    assert errors == []
    for name in ("rollouts", "segments"):
        json.loads((wh.root / MANIFEST_DIR / f"{name}.json").read_text())
    assert _count(wh, "rollouts") == 16
