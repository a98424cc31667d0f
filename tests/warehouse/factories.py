"""Small hand-made records for warehouse tests."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.records import EvalRunRow, PurifiedRow, PurifyConfigRow, Rollout, Segment


def make_rollout(rollout_id: str, iteration: int = 0, reward: float = 1.0, n_failed: int = 1) -> Rollout:
    return Rollout(
        rollout_id=rollout_id, iteration=iteration, group_id=f"it{iteration}-p0", prompt_id="p0",
        sample_index=0, policy_version="test", data_source="toy", ground_truth="42", answer="42",
        reward=reward, correct=reward > 0, finish_reason="answer", rollback_draw=0.25,
        collect_view="purified", collect_config_id="cfg", n_assistant_segments=3, n_tool_calls=2,
        n_failed_calls=n_failed,
    )


def make_segments(rollout_id: str, iteration: int = 0) -> list[Segment]:
    """prompt, a failed call (NameError), its retry (ok), the final answer."""
    def seg(seq, kind, step, attempt, tokens, **kw):
        logprobs = tuple(-0.5 for _ in tokens) if kind == "assistant" else None
        return Segment(rollout_id=rollout_id, iteration=iteration, seq=seq, kind=kind, step=step,
                       attempt=attempt, token_ids=tuple(tokens), logprobs=logprobs,
                       text=kw.pop("text", f"{kind}{seq}"), **kw)
    return [
        seg(0, "prompt", None, None, [1, 2, 3]),
        seg(1, "assistant", 0, 0, [4, 5, 6], call_start=1, tool_code="pirnt(1)"),
        seg(2, "tool", 0, 0, [7, 8], tool_code="pirnt(1)", tool_status="error", error_type="NameError",
            exec_ms=3.0),
        seg(3, "assistant", 0, 1, [4, 5, 9], call_start=1, tool_code="print(1)"),
        seg(4, "tool", 0, 1, [7, 10], tool_code="print(1)", tool_status="ok", exec_ms=2.0),
        seg(5, "assistant", 1, 0, [11, 12], text="\\boxed{42}"),
    ]


def make_eval_run(eval_id: str, saar: bool, **changes) -> EvalRunRow:
    """An `eval_runs` row; `changes` override its fields."""
    row = EvalRunRow(
        eval_id=eval_id, model="m", policy_version="m@1", dataset="aime24", data_path="a.parquet",
        data_source="AIME2024", prompt_style="reference", saar=saar, n=4, problems=2, rollouts=8, avg_at_n=0.25,
        pass_at_k=((1, 0.25), (2, 0.5), (4, 0.75)), maj_at_n=0.5, tool_calls_per_trajectory=1.5,
        failures_per_trajectory=0.125, first_call_error_rate=math.nan, recovery_rate=1.0, seconds=2.0,
        rollouts_generated=8, seed=0, temperature=1.0, top_p=0.6, max_turns=16, config_json="{}",
    )
    return dataclasses.replace(row, **changes)


def make_purify_config(config_id: str, gamma: float = 0.5, edit: str = "replace") -> PurifyConfigRow:
    """A `purify_configs` row."""
    return PurifyConfigRow(config_id=config_id, gamma=gamma, rollback_prob=1.0, similarity_on="code",
                           purify_when="always", params_json="{}", edit=edit)


def make_purified(config_id: str, rollout_id: str = "r0", iteration: int = 0) -> PurifiedRow:
    """A two-token `purified` row of one rollout under one config."""
    return PurifiedRow(
        config_id=config_id, iteration=iteration, rollout_id=rollout_id, group_id="g", token_ids=(1, 2),
        prompt_len=1, loss_mask=(0, 1), behavior_logprobs=(0.0, -0.5), old_logprobs=(0.0, -0.25), reward=1.0,
        advantage=0.5, rolled_back=False, n_shallow=0, n_deep=0, n_unrecovered=0, tokens_removed=0,
        scorer_version="t")


def column_chunk(path: Path, column: str) -> tuple[int, int]:
    """The byte range [start, end) of a column's pages (headers and data) in row group 0 of a part."""
    metadata = pq.ParquetFile(path).metadata.row_group(0)
    for index in range(metadata.num_columns):
        chunk = metadata.column(index)
        if chunk.path_in_schema.split(".")[0] == column:
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            return start, start + chunk.total_compressed_size
    raise KeyError(column)


def pages_region(path: Path) -> tuple[int, int]:
    """The byte range [start, end) of a part's pages (every column chunk of every row group): all of
    the file but its leading magic and its footer."""
    metadata = pq.ParquetFile(path).metadata
    chunks = [metadata.row_group(g).column(c) for g in range(metadata.num_row_groups) for c in range(metadata.num_columns)]
    starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
    return min(starts), max(start + c.total_compressed_size for start, c in zip(starts, chunks, strict=True))


def flip_in_place(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of `path` with `mask`, in place: same size, and its mtime put back."""
    stat = path.stat()
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def silent_flip(path: Path, column: str) -> int:
    """An offset in `column`'s pages where a flipped byte decodes without error to other values when
    the page checksums are not checked (what a reader without them serves)."""
    content = path.read_bytes()
    original = pq.read_table(pa.BufferReader(content))
    start, end = column_chunk(path, column)
    for offset in range(end - 1, start, -1):  # from the end: the values, not the page header
        flipped = bytearray(content)
        flipped[offset] ^= 0xFF
        try:
            table = pq.read_table(pa.BufferReader(bytes(flipped)), page_checksum_verification=False)
        except (pa.ArrowException, OSError):
            continue
        if not table.equals(original):
            return offset
    raise AssertionError(f"no silent flip in {column} of {path}")
