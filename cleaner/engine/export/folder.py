"""The exported dataset's files as the Hugging Face Hub lays them out (docs/architecture.md §15):
shards of a fixed number of rows under `data/` (the dataset card is card.py's).

Design decisions:
- Each format's columns are declared once here, as an Arrow schema; the card's `dataset_info`
  features are derived from it (card.py), so `datasets.load_dataset(folder)` reads back what the
  card says.
- A tool call's `arguments` and the `tools` column are `datasets.Json` features (Arrow's JSON
  extension type, text in the Parquet file): calls of different tools take different arguments,
  which one struct type could only hold as the union of all of them, filled with nulls that a
  chat template would then render. `datasets` hands them back as Python objects, as TRL and the
  chat templates take them; DuckDB and polars read JSON text.
- `sft` and `preference` are Parquet (row groups of at most 1,000 rows); `messages` is JSON Lines
  in OpenAI's chat shape (`arguments` a JSON string, `tool_call_id` on the tool's answer), for
  trainers that read that. Shards are named `train-<i>-of-<n>` once the last is written.
- Streaming: a writer holds one row group at a time, so memory does not grow with the export.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SPLIT = "train"
SFT, PREFERENCE, MESSAGES = "sft", "preference", "messages"
ROW_GROUP = 1000


def _message(arguments: pa.DataType) -> pa.DataType:
    call = pa.struct([("type", pa.string()), ("function", pa.struct([("name", pa.string()), ("arguments", arguments)]))])
    return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("tool_calls", pa.list_(call))]))


_CONVERSATION_COLUMNS = [
    ("rollout_id", pa.string()), ("iteration", pa.int32()), ("group_id", pa.string()), ("prompt_id", pa.string()),
    ("sample_index", pa.int32()), ("data_source", pa.string()), ("policy_version", pa.string()),
    ("collect_config_id", pa.string()), ("purify_config_id", pa.string()), ("view", pa.string()),
    ("reward", pa.float32()), ("correct", pa.bool_()), ("finish_reason", pa.string()),
    ("n_failed_calls", pa.int32()), ("exact", pa.bool_()),
]
_PAIR_COLUMNS = [
    ("pair", pa.string()), ("rollout_id", pa.string()), ("rejected_rollout_id", pa.string()),
    ("iteration", pa.int32()), ("group_id", pa.string()), ("prompt_id", pa.string()),
    ("policy_version", pa.string()), ("collect_config_id", pa.string()), ("purify_config_id", pa.string()),
    ("view", pa.string()), ("reward", pa.float32()), ("rejected_reward", pa.float32()), ("step", pa.int32()),
    ("depth", pa.string()), ("error_type", pa.string()),
]


def schema_of(form: str, building: bool = False) -> pa.Schema:
    """The columns of a format; `building`: JSON columns as strings, the schema rows are built in
    before the JSON extension type is cast on."""
    json_type = pa.string() if building else pa.json_()
    messages = _message(json_type)
    if form == PREFERENCE:
        return pa.schema([("prompt", messages), ("chosen", messages), ("rejected", messages),
                          ("tools", json_type), *_PAIR_COLUMNS])
    return pa.schema([("messages", messages), ("tools", json_type), *_CONVERSATION_COLUMNS])


def stored_messages(messages: Sequence[dict]) -> list[dict]:
    """Messages as a row holds them: every field present, a call's arguments as JSON text."""
    return [{"role": m["role"], "content": m["content"], "tool_calls": [
        {"type": call["type"], "function": {"name": call["function"]["name"],
                                            "arguments": _json(call["function"]["arguments"])}}
        for call in m["tool_calls"]] if m.get("tool_calls") else None} for m in messages]


def openai_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI's chat shape: each call with an id and its arguments as a JSON string, each tool
    answer naming the call it answers (none after a call that did not parse)."""
    shaped, last_call = [], None
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                last_call = f"call_{sum(len(m.get('tool_calls') or ()) for m in shaped) + len(calls)}"
                calls.append({"id": last_call, "type": "function", "function": {
                    "name": call["function"]["name"], "arguments": _json(call["function"]["arguments"])}})
            shaped.append({"role": message["role"], "content": message["content"], "tool_calls": calls})
        elif message["role"] == "tool":
            shaped.append({"role": "tool", "tool_call_id": last_call, "content": message["content"]})
            last_call = None
        else:
            shaped.append({"role": message["role"], "content": message["content"]})
    return shaped


def _json(value: object) -> str:
    """JSON text as a chat template's `tojson` writes it (keys in order, no ASCII escaping)."""
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# Shards


class Shards:
    """Rows in, shards of `rows_per_shard` rows out under `<directory>/data/`."""

    def __init__(self, directory: Path, form: str, rows_per_shard: int) -> None:
        self.data = directory / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.form, self.rows_per_shard = form, rows_per_shard
        self.building, self.schema = schema_of(form, building=True), schema_of(form)
        self.suffix = "jsonl" if form == MESSAGES else "parquet"
        self.paths: list[Path] = []
        self.rows = 0
        self.bytes = 0  # of the rows as Arrow holds them (a JSON line's: as written), the card's num_bytes
        self._in_shard = 0
        self._writer: pq.ParquetWriter | None = None
        self._lines = None
        self._pending: list[dict] = []

    def add(self, row: dict) -> None:
        if self._in_shard == 0:
            self._open()
        self._pending.append(row)
        self.rows += 1
        self._in_shard += 1
        if len(self._pending) >= ROW_GROUP or self._in_shard == self.rows_per_shard:
            self._flush()
        if self._in_shard == self.rows_per_shard:
            self._close_shard()

    def _open(self) -> None:
        path = self.data / f"{SPLIT}-{len(self.paths):05d}.{self.suffix}"
        self.paths.append(path)
        if self.form == MESSAGES:
            self._lines = path.open("w", encoding="utf-8")
        else:
            self._writer = pq.ParquetWriter(path, self.schema, compression="zstd")

    def _flush(self) -> None:
        if not self._pending:
            return
        if self._lines is not None:
            lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in self._pending]
            self._lines.writelines(lines)
            self.bytes += sum(len(line.encode()) for line in lines)
        else:
            table = pa.Table.from_pylist(self._pending, schema=self.building).cast(self.schema)
            self._writer.write_table(table)
            self.bytes += table.nbytes
        self._pending = []

    def _close_shard(self) -> None:
        self._flush()
        if self._lines is not None:
            self._lines.close()
            self._lines = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._in_shard = 0

    def close(self) -> list[Path]:
        """Finish the last shard and name every shard `train-<i>-of-<n>` (one empty shard when
        there are no rows, so the folder still loads and says its columns)."""
        if not self.paths:
            self._open()
        self._close_shard()
        named = []
        for index, path in enumerate(self.paths):
            final = path.with_name(f"{SPLIT}-{index:05d}-of-{len(self.paths):05d}.{self.suffix}")
            path.rename(final)
            named.append(final)
        return named
