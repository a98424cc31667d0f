"""What `cleaner export` reads (docs/architecture.md §15): the rollouts of some iterations that a
`--where` selects, streamed in group order with their segments (and purified rows), and the counts
its dataset card states.

Design decisions:
- The selection is a table of the connection's in-memory database (every cursor sees it) of (rollout_id, iteration, group_id, sample_index),
  made once from `rollouts` over `Warehouse.connect()`'s views; `--where` is one SQL condition over
  that view's columns (a subquery may read any view). DuckDB's parser decides that it is one:
  `SELECT 1 WHERE <condition>` must parse as one statement whose tree, its WHERE clause aside, is
  `SELECT 1 WHERE TRUE`'s, so a closing parenthesis that escapes (`true) OR (true`), a second
  statement, a set operation, ORDER BY, LIMIT or GROUP BY is refused, and a comment is fine (the
  condition is spliced between newlines, in parentheses). DuckDB then binds it before anything is
  written, so an unknown column or bad syntax is one error line.
- Streaming: one query per dataset, each ordered by (iteration, group_id, sample_index,
  rollout_id[, seq]), read in record batches from a cursor of its own, so a group's rollouts come
  together (outcome pairs need whole groups) and the output's order is the plan's. DuckDB sorts
  out of core under the connection's `memory_limit`, spilling into the caller's temporary
  directory, never into the warehouse; Python holds one batch and one group at a time.
- The counts are SQL over the same views, so a user can check a folder against its warehouse:
  `FIXED_CHAINS` counts the failure-correction chains SAAR purifies (a step whose failed calls a
  later call of the same step fixed, with no unrecovered step before it in its rollout, and no
  infrastructure fault among its calls), which is the number of chain pairs;
  `OUTCOME_PAIRS` counts min(correct, incorrect) per group over the rollouts no infrastructure
  fault decided, the number of outcome pairs; `OUTCOME_PAIRS_TRAINED`, the purified view's, only
  over the rollouts whose row the config trains (not dropped by down-sampling, not masked by the
  void-turn filter).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from cleaner.interrupts import watched
from cleaner.records import PurifiedRow, PurifyConfigRow, Rollout, Segment
from cleaner.warehouse import schema
from cleaner.warehouse.parts import WarehouseError
from cleaner.warehouse.views import cursor_of

SELECTED = "export_selected"  # the table of the selection
_ORDER = "x.iteration, x.group_id, x.sample_index, x.rollout_id"

# Per selected rollout and step: whether a call failed, whether the last attempt's call succeeded,
# whether any call met an infrastructure fault.
_STEPS = f"""
    SELECT s.rollout_id, s.step,
           bool_or(s.tool_status <> 'ok') AS failed,
           arg_max(s.tool_status, s.attempt) = 'ok' AS fixed,
           bool_or(s.tool_status = 'infra_error') AS infra
    FROM segments s SEMI JOIN {SELECTED} x ON s.rollout_id = x.rollout_id
    WHERE s.kind = 'tool' AND s.step IS NOT NULL
    GROUP BY s.rollout_id, s.step"""

FIXED_CHAINS = f"""
    WITH steps AS ({_STEPS}),
    first_unrecovered AS (
        SELECT rollout_id, min(step) AS step FROM steps WHERE failed AND NOT fixed GROUP BY rollout_id)
    SELECT count(*) FROM steps s LEFT JOIN first_unrecovered u USING (rollout_id)
    WHERE s.failed AND s.fixed AND NOT s.infra AND (u.step IS NULL OR s.step < u.step)"""

_OUTCOME_PAIRS = """
    WITH eligible AS (
        SELECT r.group_id, r.correct FROM rollouts r SEMI JOIN {selected} x ON r.rollout_id = x.rollout_id
        WHERE r.finish_reason <> 'error' AND r.rollout_id NOT IN (
            SELECT rollout_id FROM segments WHERE kind = 'tool' AND tool_status = 'infra_error'){trained})
    SELECT coalesce(sum(least(n_correct, n_incorrect)), 0)::BIGINT FROM (
        SELECT count(*) FILTER (WHERE correct) AS n_correct, count(*) FILTER (WHERE NOT correct) AS n_incorrect
        FROM eligible GROUP BY group_id)"""
OUTCOME_PAIRS = _OUTCOME_PAIRS.format(selected=SELECTED, trained="")
# the purified view's: a rollout whose row under the config ($config_id) trains nothing takes no part
OUTCOME_PAIRS_TRAINED = _OUTCOME_PAIRS.format(selected=SELECTED, trained="""
        AND r.rollout_id IN (SELECT rollout_id FROM purified WHERE config_id = $config_id
                             AND list_contains(loss_mask, 1))""")


@dataclass(frozen=True)
class SelectedRollout:
    """One selected rollout with its segments in seq order (and its purified row, when asked)."""

    rollout: Rollout
    segments: tuple[Segment, ...]
    purified: PurifiedRow | None = None


def collected_iterations(connection: duckdb.DuckDBPyConnection) -> list[int]:
    return [row[0] for row in connection.execute("SELECT DISTINCT iteration FROM rollouts ORDER BY 1").fetchall()]


def select(connection: duckdb.DuckDBPyConnection, iterations: Sequence[int], where: str | None) -> int:
    """Make the selection: the rollouts of `iterations` for which `where` holds; how many."""
    condition = "TRUE" if where is None else where
    query = (f"SELECT rollout_id, iteration, group_id, sample_index FROM rollouts WHERE iteration IN "
             f"({_ints(iterations)}) AND (\n{condition}\n)")  # newlines: a trailing -- comment ends there
    if where is not None:
        _check_condition(connection, where, query)
    try:
        connection.execute(f"CREATE TABLE {SELECTED} AS {query}")
    except duckdb.Error as error:
        raise WarehouseError(f"--where {where!r}: {_first_line(error)}") from error
    ((count,),) = connection.execute(f"SELECT count(*) FROM {SELECTED}").fetchall()
    return count


def _check_condition(connection: duckdb.DuckDBPyConnection, where: str, query: str) -> None:
    """One expression over the rollouts view, or WarehouseError saying what is wrong (module
    docstring)."""
    probe = f"SELECT 1 WHERE\n{where}\n"
    try:
        statements = connection.extract_statements(probe)  # not the module's: its default database lives on
    except duckdb.Error as error:
        raise WarehouseError(f"--where {where!r} is not valid SQL: {_first_line(error)}") from error
    if len(statements) != 1 or _shape(connection, probe) != _shape(connection, "SELECT 1 WHERE\nTRUE\n"):
        raise WarehouseError(f"--where {where!r}: expected one condition over the rollouts view's columns (no "
                             "second statement, set operation, ORDER BY, LIMIT or GROUP BY, and no parenthesis "
                             "closing what it did not open), e.g. \"correct and n_failed_calls = 0\"")
    try:
        connection.execute(f"EXPLAIN {query}")  # binds every name without running it
    except duckdb.Error as error:
        raise WarehouseError(f"--where {where!r}: {_first_line(error)}") from error


def _shape(connection: duckdb.DuckDBPyConnection, query: str) -> object:
    """DuckDB's parse tree of the one SELECT `query`, without its WHERE clause and the places in
    the text (None where it cannot be serialised: not a SELECT)."""
    ((serialized,),) = connection.execute("SELECT json_serialize_sql(?)", [query]).fetchall()
    tree = json.loads(serialized)
    if tree.get("error") or len(tree["statements"]) != 1:
        return None
    node = dict(tree["statements"][0]["node"])
    node.pop("where_clause", None)
    return _without_locations(node)


def _without_locations(value: object) -> object:
    if isinstance(value, dict):
        return {key: _without_locations(item) for key, item in value.items() if not key.startswith("query_location")}
    if isinstance(value, list):
        return [_without_locations(item) for item in value]
    return value


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def _ints(values: Sequence[int]) -> str:
    return ", ".join(str(int(value)) for value in values)


# ---------------------------------------------------------------------------------------------
# Purify configs


def purify_configs(connection: duckdb.DuckDBPyConnection, iterations: Sequence[int]) -> dict[int, list[str]]:
    """Per iteration, the purify configs with rows of it."""
    rows = connection.execute(f"SELECT DISTINCT iteration, config_id FROM purified WHERE iteration IN "
                              f"({_ints(iterations)}) ORDER BY 1, 2").fetchall()
    found: dict[int, list[str]] = {iteration: [] for iteration in iterations}
    for iteration, config_id in rows:
        found[iteration].append(config_id)
    return found


def purify_config(connection: duckdb.DuckDBPyConnection, config_id: str) -> PurifyConfigRow | None:
    table = connection.sql("SELECT * FROM purify_configs WHERE config_id = ? LIMIT 1", params=[config_id]).to_arrow_table()
    rows = schema.from_table(schema.PURIFY_CONFIGS, table)
    return rows[0] if rows else None


def unpurified(connection: duckdb.DuckDBPyConnection, config_id: str) -> int:
    """Selected rollouts without a row under `config_id`."""
    ((count,),) = connection.execute(
        f"SELECT count(*) FROM {SELECTED} x ANTI JOIN (SELECT rollout_id FROM purified WHERE config_id = ? "
        "AND negative_seq IS NULL) p ON p.rollout_id = x.rollout_id", [config_id]).fetchall()
    return count


# ---------------------------------------------------------------------------------------------
# Streaming


def stream(connection: duckdb.DuckDBPyConnection, batch_rows: int,
           config_id: str | None = None) -> Iterator[list[SelectedRollout]]:
    """The selection in group order, a group never split across two lists; each rollout with its
    segments, and its purified row under `config_id` if given (every selected rollout has one:
    check `unpurified` first)."""
    rollouts = _batches(connection, f"SELECT r.* FROM rollouts r JOIN {SELECTED} x USING (rollout_id) "
                                    f"ORDER BY {_ORDER}", batch_rows)
    segments = _rows_of(schema.SEGMENTS, _batches(
        connection, f"SELECT s.* FROM segments s JOIN {SELECTED} x USING (rollout_id) ORDER BY {_ORDER}, s.seq",
        batch_rows))
    purified = None if config_id is None else _rows_of(schema.PURIFIED, _batches(
        connection, f"SELECT p.* FROM purified p JOIN {SELECTED} x USING (rollout_id) WHERE p.config_id = ? "
                    f"AND p.negative_seq IS NULL ORDER BY {_ORDER}", batch_rows, [config_id]))
    pending: list[SelectedRollout] = []
    following = None
    for table in rollouts:
        for rollout in schema.from_table(schema.ROLLOUTS, table):
            if pending and rollout.group_id != pending[-1].rollout.group_id and len(pending) >= batch_rows:
                yield pending
                pending = []
            own, following = _take(segments, rollout.rollout_id, following)
            row = next(purified) if purified is not None else None
            if row is not None and row.rollout_id != rollout.rollout_id:  # one row per rollout: `unpurified` said so
                raise WarehouseError(f"purified rows of config {config_id} out of step at rollout {rollout.rollout_id} "
                                     f"(got {row.rollout_id}): two rows for one rollout?")
            pending.append(SelectedRollout(rollout, tuple(own), row))
    if pending:
        yield pending


def _take(segments: Iterator[Segment], rollout_id: str, following: Segment | None) -> tuple[list[Segment], Segment | None]:
    """The segments of `rollout_id` from the ordered stream (`following`: the first one read past
    the previous rollout), and the first one past them."""
    own = []
    segment = following if following is not None else next(segments, None)
    while segment is not None and segment.rollout_id == rollout_id:
        own.append(segment)
        segment = next(segments, None)
    return own, segment


def _batches(connection: duckdb.DuckDBPyConnection, query: str, batch_rows: int,
             params: list | None = None) -> Iterator[pa.Table]:
    cursor = cursor_of(connection)  # a result of its own: the streams are read side by side
    try:
        with watched(cursor):  # a Ctrl-C interrupts its sort (a connection of its own)
            reader = cursor.sql(query, params=params or None).to_arrow_reader(batch_rows)
            for batch in reader:
                yield pa.Table.from_batches([batch])
    finally:
        cursor.close()


def _rows_of(dataset: schema.Dataset, tables: Iterator[pa.Table]) -> Iterator:
    for table in tables:
        yield from schema.from_table(dataset, table)


def count(connection: duckdb.DuckDBPyConnection, query: str, parameters: dict | None = None) -> int:
    """One of the documented counts (FIXED_CHAINS, OUTCOME_PAIRS, OUTCOME_PAIRS_TRAINED) over the selection."""
    ((value,),) = connection.execute(query, parameters).fetchall()
    return int(value)
