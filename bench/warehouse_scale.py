"""The warehouse at thousands of parts: `Warehouse.connect()` + a query against raw DuckDB.

Builds a synthetic warehouse with the real schemas and the real part writer (`write_part`, twin
names, fsyncs): `--batches` collection batches spread over `--iterations`, each a segments part and
its rollouts twin, segments shaped like a collected rollout (prompt, then assistant/tool turns).
Then, in one run on the same files:
- cold: the first `connect()`, which verifies every part in full (footer, every page with its
  checksum through pyarrow and through DuckDB, its CRC-32) and writes the manifest;
- warm: `connect()` + the query, `connect(verify_content=True)` (`cleaner sql --verify`: every
  part's CRC-32 compared) + the query, and a fresh `duckdb.connect()` + the same query over
  `read_parquet('<warehouse>/<dataset>/*/*.parquet')`, alternated `--repeats` times, medians;
- corrupt parts: one segments part truncated, then one with a byte flipped in its pages (same size,
  mtime put back); the error must name it (then it is restored);
- after `compact`: the same comparison over the merged parts;
- what page checksums cost: a batch's parts encoded with and without them, and read with and
  without checking them, alternated.

    .venv/bin/python bench/warehouse_scale.py --batches 2400 --iterations 8

Every connection is fresh, so DuckDB's own metadata caches never carry from one measurement to
the next; the files are in the OS page cache for both sides (the build wrote them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.warehouse import Warehouse, WarehouseError, schema
from cleaner.warehouse.compact import compact
from cleaner.warehouse.parts import list_parts, new_part_name, write_part

QUERIES = {  # name: (over the views, over raw files with {segments} and {rollouts} globs)
    "tokens by kind": (
        "SELECT kind, count(*), sum(len(token_ids)) FROM segments GROUP BY 1 ORDER BY 1",
        "SELECT kind, count(*), sum(len(token_ids)) FROM read_parquet('{segments}') GROUP BY 1 ORDER BY 1",
    ),
    "failed calls by reward": (
        "SELECT r.correct, count(*) FROM segments s JOIN rollouts r USING (rollout_id) "
        "WHERE s.kind = 'tool' AND s.tool_status <> 'ok' GROUP BY 1 ORDER BY 1",
        "SELECT r.correct, count(*) FROM read_parquet('{segments}') s JOIN read_parquet('{rollouts}') r "
        "USING (rollout_id) WHERE s.kind = 'tool' AND s.tool_status <> 'ok' GROUP BY 1 ORDER BY 1",
    ),
}


# ---------------------------------------------------------------------------------------------
# A synthetic warehouse


@dataclass(frozen=True)
class Shape:
    rollouts_per_batch: int
    turns: int  # assistant/tool pairs per rollout after the prompt
    mean_tokens: int  # per segment


def _lists(lengths: np.ndarray, values: np.ndarray, type_: pa.DataType, valid: np.ndarray | None = None) -> pa.Array:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    mask = None if valid is None else pa.array(~valid)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type_.value_type), type=type_, mask=mask)


def _batch(rng: np.random.Generator, iteration: int, batch: int, shape: Shape) -> tuple[pa.Table, pa.Table]:
    """One batch's segments and rollouts tables, in the warehouse's schemas."""
    per_rollout = 1 + 2 * shape.turns
    n_rollouts = shape.rollouts_per_batch
    n = n_rollouts * per_rollout
    ids = np.array([f"it{iteration}-b{batch}-r{r}" for r in range(n_rollouts)], dtype=object)
    seq = np.tile(np.arange(per_rollout, dtype=np.int32), n_rollouts)
    kind = np.where(seq == 0, "prompt", np.where(seq % 2 == 1, "assistant", "tool"))
    turn = np.maximum(seq - 1, 0) // 2
    lengths = rng.integers(shape.mean_tokens // 2, shape.mean_tokens * 3 // 2 + 1, n)
    tokens = _lists(lengths, rng.integers(0, 512, int(lengths.sum()), dtype=np.int32), pa.list_(pa.int32()))
    assistant, tool = kind == "assistant", kind == "tool"
    logprobs = _lists(lengths, -rng.exponential(1.0, int(lengths.sum())).astype(np.float32),
                      pa.list_(pa.float32()), valid=assistant)
    failed = tool & (rng.random(n) < 0.3)
    status = np.where(tool, np.where(failed, "error", "ok"), None)
    segments = pa.Table.from_pydict({
        "rollout_id": np.repeat(ids, per_rollout), "iteration": np.full(n, iteration, np.int32), "seq": seq,
        "kind": kind, "step": pa.array(np.where(seq == 0, None, turn), pa.int32()),
        "attempt": pa.array(np.where(seq == 0, None, 0), pa.int32()), "token_ids": tokens,
        "logprobs": logprobs, "text": np.where(assistant, "```python\nprint(6 * 7)\n```", "output"),
        "call_start": pa.array(np.where(assistant, 3, None), pa.int32()),
        "tool_code": np.where(seq > 0, "print(6 * 7)", None), "tool_status": status,
        "error_type": np.where(failed, "NameError", None),
        "exec_ms": pa.array(np.where(tool, 3.5, None), pa.float32()),
        "tool_name": np.where(seq > 0, "code_interpreter", None),
    }, schema=schema.SEGMENTS.schema)
    correct = rng.random(n_rollouts) < 0.5
    rollouts = pa.Table.from_pydict({
        "rollout_id": ids, "iteration": np.full(n_rollouts, iteration, np.int32),
        "group_id": [f"it{iteration}-b{batch}" for _ in ids], "prompt_id": [f"b{batch}" for _ in ids],
        "sample_index": np.arange(n_rollouts, dtype=np.int32), "policy_version": ["bench"] * n_rollouts,
        "data_source": ["toy"] * n_rollouts, "ground_truth": ["42"] * n_rollouts, "answer": ["42"] * n_rollouts,
        "reward": correct.astype(np.float32), "correct": correct, "finish_reason": ["answer"] * n_rollouts,
        "rollback_draw": rng.random(n_rollouts).astype(np.float32), "collect_view": ["purified"] * n_rollouts,
        "collect_config_id": ["bench"] * n_rollouts, "n_assistant_segments": np.full(n_rollouts, shape.turns, np.int32),
        "n_tool_calls": np.full(n_rollouts, shape.turns, np.int32),
        "n_failed_calls": failed.reshape(n_rollouts, per_rollout).sum(axis=1).astype(np.int32),
        "created_at": pa.array([0] * n_rollouts, pa.timestamp("us")),
        "reward_details": pa.array([None] * n_rollouts, pa.string()),
    }, schema=schema.ROLLOUTS.schema)
    return segments, rollouts


def build(root: Path, batches: int, iterations: int, shape: Shape, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for batch in range(batches):
        iteration = batch % iterations
        segments, rollouts = _batch(rng, iteration, batch, shape)
        name = new_part_name()  # the commit protocol: segments first, its rollouts twin commits it
        write_part(root / "segments" / f"iteration={iteration}", segments, name)
        write_part(root / "rollouts" / f"iteration={iteration}", rollouts, name)


# ---------------------------------------------------------------------------------------------
# Measurements


def _seconds(call: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def _ours(root: Path, query: str) -> list:
    return Warehouse(root).connect().sql(query).fetchall()


def _raw(root: Path, query: str) -> list:
    globs = {name: str(root / name / "*" / "part-*.parquet") for name in ("segments", "rollouts")}
    return duckdb.connect(":memory:").sql(query.format(**globs)).fetchall()


def _ours_verified(root: Path, query: str) -> list:
    return Warehouse(root).connect(verify_content=True).sql(query).fetchall()


@dataclass(frozen=True)
class Comparison:
    query: str
    ours_s: float  # median: Warehouse(root).connect() + the query
    verified_s: float  # median: Warehouse(root).connect(verify_content=True) + the query
    raw_s: float  # median: duckdb.connect() + the query over read_parquet globs


def compare(root: Path, repeats: int) -> list[Comparison]:
    figures = []
    for name, (ours_query, raw_query) in QUERIES.items():
        assert _ours(root, ours_query) == _raw(root, raw_query), name  # warms both, checks equality
        ours, verified, raw = [], [], []
        for _ in range(repeats):
            ours.append(_seconds(lambda q=ours_query: _ours(root, q))[0])
            raw.append(_seconds(lambda q=raw_query: _raw(root, q))[0])
            verified.append(_seconds(lambda q=ours_query: _ours_verified(root, q))[0])
        figures.append(Comparison(name, statistics.median(ours), statistics.median(verified), statistics.median(raw)))
    return figures


def corrupt_part_is_named(root: Path) -> str:
    """Truncate one committed segments part; `connect()` must name it. The part is restored."""
    part = list_parts(root, schema.SEGMENTS)[len(list_parts(root, schema.SEGMENTS)) // 2]
    return _named_by_connect(root, part, lambda content: content[: len(content) // 2], "a truncated")


def flipped_part_is_named(root: Path) -> str:
    """Flip a byte in the pages of one committed segments part, its size and mtime kept; `connect()`
    must name it. The part is restored."""
    part = list_parts(root, schema.SEGMENTS)[len(list_parts(root, schema.SEGMENTS)) // 3]
    chunk = pq.ParquetFile(part).metadata.row_group(0).column(schema.SEGMENTS.columns.index("logprobs"))
    offset = chunk.data_page_offset + chunk.total_compressed_size // 2
    return _named_by_connect(
        root, part, lambda content: content[:offset] + bytes([content[offset] ^ 0xFF]) + content[offset + 1:],
        "a byte flipped in", keep_mtime=True)


def _named_by_connect(root: Path, part: Path, corrupt, what: str, keep_mtime: bool = False) -> str:
    """Write `corrupt(content)` over `part` (its mtime put back with `keep_mtime`), and return the
    error of `connect()`, which must name the part. The part is restored."""
    content, stat = part.read_bytes(), part.stat()
    try:
        part.write_bytes(corrupt(content))
        if keep_mtime:
            os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        Warehouse(root).connect()
    except WarehouseError as error:
        if str(part) not in str(error):
            raise AssertionError(f"the error does not name {part}: {error}") from error
        return str(error)
    finally:
        part.write_bytes(content)
    raise AssertionError(f"{what} {part} was not detected")


@dataclass(frozen=True)
class ChecksumCost:
    write_s: float  # median: encode one batch's two parts with page checksums
    write_without_s: float  # the same without
    read_s: float  # median: read the two parts, checking the page checksums
    read_without_s: float  # the same without checking


def checksum_cost(shape: Shape, repeats: int) -> ChecksumCost:
    """Page checksums on the write path (into memory: the fsync and rename are the same either way)
    and on pyarrow's read path, alternated."""
    segments, rollouts = _batch(np.random.default_rng(1), 0, 0, shape)

    def write(checksums: bool) -> list[pa.Buffer]:
        buffers = []
        for table in (segments, rollouts):
            sink = pa.BufferOutputStream()
            strings = [f.name for f in table.schema if pa.types.is_string(f.type)]  # as write_part does
            pq.write_table(table, sink, compression="zstd", use_dictionary=strings, write_page_checksum=checksums)
            buffers.append(sink.getvalue())
        return buffers

    def read(buffers: list[pa.Buffer], checksums: bool) -> None:
        for buffer in buffers:
            pq.read_table(pa.BufferReader(buffer), page_checksum_verification=checksums)

    written = write(True)
    times: dict[str, list[float]] = {"write": [], "write_without": [], "read": [], "read_without": []}
    for _ in range(repeats):
        for key, call in (("write", lambda: write(True)), ("write_without", lambda: write(False)),
                          ("read", lambda: read(written, True)), ("read_without", lambda: read(written, False))):
            times[key].append(min(_seconds(call)[0] for _ in range(20)))
    return ChecksumCost(*(statistics.median(times[key]) for key in ("write", "write_without", "read", "read_without")))


def _report(title: str, figures: list[Comparison]) -> None:
    print(f"\n{title}")
    print("| query | connect() + query, s | raw DuckDB, s | ratio | connect(verify_content=True) + query, s | ratio |")
    print("|---|---|---|---|---|---|")
    for f in figures:
        print(f"| {f.query} | {f.ours_s:.3f} | {f.raw_s:.3f} | {f.ours_s / f.raw_s:.2f}x "
              f"| {f.verified_s:.3f} | {f.verified_s / f.raw_s:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2400, help="collection batches (2 parts each)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--rollouts-per-batch", type=int, default=24)
    parser.add_argument("--turns", type=int, default=9, help="assistant/tool pairs per rollout")
    parser.add_argument("--mean-tokens", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="build here (default: a temporary directory)")
    args = parser.parse_args()
    shape = Shape(args.rollouts_per_batch, args.turns, args.mean_tokens)
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="warehouse-scale-", dir=args.dir))
    root = base / "wh"
    try:
        seconds, _ = _seconds(lambda: build(root, args.batches, args.iterations, shape))
        stats = duckdb.connect().sql(
            f"SELECT count(*), sum(len(token_ids)) FROM read_parquet('{root}/segments/*/*.parquet')").fetchall()[0]
        parts = sum(len(list_parts(root, d)) for d in schema.DATASETS.values())
        print(f"built {parts} parts, {stats[0]:,} segments, {stats[1]:,} tokens in {seconds:.1f} s")
        cold, _ = _seconds(lambda: Warehouse(root).connect())
        warm, _ = _seconds(lambda: Warehouse(root).connect())
        print(f"connect(): cold (verifies every part in full, writes the manifest) {cold:.3f} s; warm {warm:.3f} s")
        _report(f"{parts} parts, warm manifest, medians of {args.repeats}", compare(root, args.repeats))
        print(f"\ncorrupt part: {corrupt_part_is_named(root)}")
        print(f"flipped byte: {flipped_part_is_named(root)}")
        Warehouse(root).connect()  # the restored parts: their CRC-32 matches, no decoding
        seconds, result = _seconds(lambda: compact(root))
        parts_after = sum(len(list_parts(root, d)) for d in schema.DATASETS.values())
        print(f"\ncompact: {sum(m.n_parts for m in result.merges)} parts into {len(result.merges)} "
              f"in {seconds:.1f} s; {parts_after} parts now")
        Warehouse(root).connect()  # validates the merged parts once
        _report(f"after compact, {parts_after} parts, medians of {args.repeats}", compare(root, args.repeats))
        cost = checksum_cost(shape, args.repeats)
        print(f"\npage checksums, one batch's two parts, medians of {args.repeats} (each the best of 20): "
              f"encode {cost.write_s * 1e3:.2f} ms with, {cost.write_without_s * 1e3:.2f} ms without "
              f"({cost.write_s / cost.write_without_s:.3f}x); read {cost.read_s * 1e3:.2f} ms checking, "
              f"{cost.read_without_s * 1e3:.2f} ms not ({cost.read_s / cost.read_without_s:.3f}x)")
        print(f"\nload average: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    finally:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
