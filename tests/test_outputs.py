"""Files swapped into place (cleaner/outputs.py, `atomic_files`): all renamed on a clean exit, none
replaced and nothing left behind when the writer fails."""

from __future__ import annotations

import errno

import pytest

from cleaner.errors import WriteError
from cleaner.outputs import atomic_files


def test_every_file_is_renamed_into_place_on_a_clean_exit(tmp_path):
    paths = [tmp_path / "a.parquet", tmp_path / "sub" / "a.parquet.curate.md"]
    paths[0].write_text("old")
    with atomic_files(paths) as temporaries:
        assert [t.parent for t in temporaries] == [p.parent for p in paths]  # beside each path
        assert not paths[1].exists() and paths[0].read_text() == "old"  # nothing replaced yet
        for temporary, text in zip(temporaries, ("new", "page"), strict=True):
            temporary.write_text(text)
    assert [p.read_text() for p in paths] == ["new", "page"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a.parquet", "a.parquet.curate.md", "sub"]


def test_a_writer_that_fails_replaces_nothing_and_leaves_no_temporary(tmp_path):
    paths = [tmp_path / "a.parquet", tmp_path / "b.json"]
    paths[0].write_text("old")
    with pytest.raises(RuntimeError, match="serialiser broke"), atomic_files(paths) as temporaries:
        temporaries[0].write_text("half")
        raise RuntimeError("serialiser broke")
    assert paths[0].read_text() == "old" and not paths[1].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet"]


def test_a_failed_write_is_one_error_naming_the_output(tmp_path):
    path = tmp_path / "a.parquet"
    with pytest.raises(WriteError, match=f"^{path}: cannot write it"), atomic_files([path]):
        raise OSError(errno.EIO, "Input/output error")
    assert list(tmp_path.iterdir()) == []
