"""The exported folder's shards by hand (cleaner/engine/export/folder.py): names, row groups, sizes
and the JSON columns, read back by pyarrow and by `datasets`, without a warehouse."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cleaner.engine.export import folder
from cleaner.engine.export.folder import (
    MESSAGES,
    PREFERENCE,
    SFT,
    Shards,
    schema_of,
    stored_messages,
)

datasets = pytest.importorskip("datasets", reason="needs the export-test extra (datasets, trl)")

CALL = {"type": "function", "function": {"name": "python", "arguments": {"code": "print('é')", "a": 1}}}
MESSAGES_OF = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
               {"role": "tool", "content": "é"}, {"role": "assistant", "content": "done", "tool_calls": []}]


def _row(index: int) -> dict:
    columns = {name: None for name in schema_of(SFT).names}
    return columns | {"messages": stored_messages(MESSAGES_OF), "tools": json.dumps([{"name": "python"}]),
                      "rollout_id": f"r{index}", "iteration": index, "reward": 0.5, "correct": True}


def test_messages_are_stored_with_every_field_and_arguments_as_json_text():
    assert stored_messages(MESSAGES_OF) == [
        {"role": "user", "content": "q", "tool_calls": None},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "python", "arguments": '{"code": "print(\'é\')", "a": 1}'}}]},
        {"role": "tool", "content": "é", "tool_calls": None},
        {"role": "assistant", "content": "done", "tool_calls": None}]


def test_each_format_declares_its_columns_with_json_as_arrows_json_type_once_built():
    for form, first in [(SFT, ["messages", "tools", "rollout_id"]), (MESSAGES, ["messages", "tools", "rollout_id"]),
                        (PREFERENCE, ["prompt", "chosen", "rejected", "tools", "pair"])]:
        schema, building = schema_of(form), schema_of(form, building=True)
        assert schema.names[:len(first)] == first and schema.names == building.names
        assert schema.field("tools").type == pa.json_() and building.field("tools").type == pa.string()
        conversation = schema.field(first[0]).type.value_type
        arguments = conversation.field("tool_calls").type.value_type.field("function").type.field("arguments").type
        assert arguments == pa.json_()
        assert [f.name for f in conversation] == ["role", "content", "tool_calls"]
    assert schema_of(SFT).field("reward").type == pa.float32() and schema_of(SFT).field("iteration").type == pa.int32()
    assert len(schema_of(PREFERENCE)) == 19 and len(schema_of(SFT)) == 17


def test_rows_go_into_shards_of_a_fixed_size_named_once_the_last_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(folder, "ROW_GROUP", 2)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # no hub call
    shards = Shards(tmp_path / "out", SFT, rows_per_shard=3)
    for index in range(7):
        shards.add(_row(index))
        assert shards.rows == index + 1
    assert [p.name for p in (tmp_path / "out" / "data").iterdir() if p.name.endswith("00002.parquet")] == [
        "train-00002.parquet"]  # the last shard keeps its working name until close
    paths = shards.close()
    assert [p.name for p in paths] == [f"train-0000{i}-of-00003.parquet" for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "out" / "data").iterdir()) == [p.name for p in paths]
    files = [pq.ParquetFile(p) for p in paths]
    assert [[f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)] for f in files] == [
        [2, 1], [2, 1], [1]]  # a row group of at most ROW_GROUP rows, a shard of rows_per_shard
    assert all(f.metadata.row_group(0).column(0).compression == "ZSTD" for f in files)
    tables = [f.read() for f in files]
    assert all(t.schema == schema_of(SFT) for t in tables)
    assert [r for t in tables for r in t.column("rollout_id").to_pylist()] == [f"r{i}" for i in range(7)]
    built = [pa.Table.from_pylist([_row(i) for i in rows], schema=schema_of(SFT, building=True)).cast(schema_of(SFT))
             for rows in ([0, 1], [2], [3, 4], [5], [6])]
    assert shards.bytes == sum(t.nbytes for t in built)
    loaded = datasets.load_dataset("parquet", data_files=[str(p) for p in paths], split="train",
                                   cache_dir=str(tmp_path / "cache"))  # no cache outside the test's folder
    assert loaded.num_rows == 7 and loaded[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "code": "print('é')", "a": 1}
    assert loaded[6]["tools"] == [{"name": "python"}] and loaded[3]["iteration"] == 3
    assert loaded[0]["messages"][1]["tool_calls"] == [CALL]  # the call's fields under their names


def test_preference_rows_are_shards_of_their_own_columns(tmp_path):
    columns = {name: None for name in schema_of(PREFERENCE).names}
    shards = Shards(tmp_path, PREFERENCE, rows_per_shard=10)
    stored = stored_messages(MESSAGES_OF)
    shards.add(columns | {"prompt": stored[:1], "chosen": stored[1:], "rejected": stored[3:], "pair": "chain",
                          "tools": "[]", "step": 2})
    (path,) = shards.close()
    table = pq.read_table(path)
    assert table.schema == schema_of(PREFERENCE)
    assert table.column("chosen").to_pylist()[0][0]["tool_calls"][0]["function"]["arguments"] == (
        '{"code": "print(\'é\')", "a": 1}')
    assert (table.column("pair").to_pylist(), table.column("step").to_pylist()) == (["chain"], [2])


def test_openai_call_ids_count_every_call_of_the_conversation_several_in_one_turn_too():
    two = {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]}
    shaped = folder.openai_messages([MESSAGES_OF[0], two, {"role": "tool", "content": "a"},
                                     MESSAGES_OF[1], {"role": "tool", "content": "b"}])
    assert [call["id"] for m in shaped for call in m.get("tool_calls", ())] == ["call_0", "call_1", "call_2"]
    assert [m.get("tool_call_id") for m in shaped if m["role"] == "tool"] == ["call_1", "call_2"]


def test_a_messages_export_is_json_lines_and_counts_the_bytes_written(tmp_path):
    shards = Shards(tmp_path, MESSAGES, rows_per_shard=2)
    rows = [{"messages": [{"role": "user", "content": f"é{i}"}], "id": i} for i in range(3)]
    for row in rows:
        shards.add(row)
    paths = shards.close()
    assert [p.name for p in paths] == ["train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl"]
    lines = [line for p in paths for line in p.read_text(encoding="utf-8").splitlines(keepends=True)]
    assert lines == [json.dumps(row, ensure_ascii=False) + "\n" for row in rows] and "é0" in lines[0]
    assert shards.bytes == sum(len(line.encode()) for line in lines)


@pytest.mark.parametrize("form", [SFT, MESSAGES])
def test_an_export_of_no_rows_is_one_empty_shard_that_still_says_its_columns(tmp_path, form):
    shards = Shards(tmp_path, form, rows_per_shard=5)
    (path,) = shards.close()
    assert path.name == f"train-00000-of-00001.{'jsonl' if form == MESSAGES else 'parquet'}"
    assert (shards.rows, shards.bytes) == (0, 0)
    if form == SFT:
        assert pq.read_table(path).schema == schema_of(SFT) and pq.read_metadata(path).num_rows == 0
    else:
        assert path.read_text() == ""


@pytest.mark.parametrize("form", [SFT, MESSAGES])
def test_a_shard_ends_exactly_at_its_size_and_the_next_row_opens_the_next(tmp_path, form):
    shards = Shards(tmp_path, form, rows_per_shard=2)
    for index in range(4):
        shards.add(_row(index) if form == SFT else {"id": index})
    assert len(shards.paths) == 2 and shards._in_shard == 0  # both closed: no empty third shard
    paths = shards.close()
    if form == SFT:
        assert [pq.read_metadata(p).num_rows for p in paths] == [2, 2]
    else:
        assert [p.read_text().count("\n") for p in paths] == [2, 2]
