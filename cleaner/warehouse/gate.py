"""The one gate every reader passes before it reads an iteration (docs/architecture.md §3, "Own
parts and the gate"): purify, ablate, train, export and `collect --resume` refuse what it finds, in its words;
show, report and the browser, which only display, say it in one line beside what they show.

What it checks of an iteration, in this order (the first finding is the refusal):
1. every visible rollouts and segments part is the warehouse's own (ownership.py), and so is every
   segments part no rollouts part commits: a copied or foreign part is named, with the commands
   that adopt or remove it;
2. no collection is writing it (its collect lock, lock.py), or the shard asked for;
3. no rollout id is stored twice (both parts named);
4. every rollout's segments are there exactly once: seq 0..n-1, each once; a rollouts part whose
   segments part is gone is named (`LostSegments`: `collect --resume` collects them again);
5. it is complete: the rollouts its collection planned (the plan `collect` records, configs.py)
   are all stored (an iteration left with none is incomplete too). An iteration an older cleaner
   collected has no plan; purify then counts from its collect config (the warehouse layer cannot
   load datasets).
A config's rows (`inspect_config`, for purify, train and the export of purified rows): every part of
the config's partition (and of purify_configs) is the warehouse's own, no rollout has two rows, and
every row's rollout is the iteration's.

Design decisions:
- One function decides and words every finding, so a refusal reads the same in every command.
- The counts are DuckDB over the parts the manifest verified (the columns they need only), the
  same verified file lists as the SQL views', so the gate costs one scan of two small columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow as pa

from cleaner.warehouse import schema
from cleaner.warehouse.lock import collect_refusal
from cleaner.warehouse.ownership import foreign_line, foreign_part
from cleaner.warehouse.parts import WarehouseError, fsync_dir, list_parts
from cleaner.warehouse.store import Warehouse

MANY = 3  # rollouts a line names before "..."
# The datasets no iteration's or config's gate reads
OTHER_DATASETS = (schema.ITERATIONS, schema.TRAIN_STEPS, schema.EVAL_ROLLOUTS, schema.EVAL_SEGMENTS, schema.EVAL_RUNS)


class Refused(WarehouseError):
    """A reader refuses an iteration or a config: the message is the gate's finding."""


@dataclass(frozen=True)
class LostSegments:
    """A rollouts part some of whose rollouts have no segments at all."""

    part: Path
    rollout_ids: tuple[str, ...]
    whole: bool  # every rollout of the part: its segments part is gone, so the part can go and be collected again


@dataclass(frozen=True)
class Finding:
    """One thing the gate found, as the line a reader says."""

    line: str
    lost: LostSegments | None = None  # rollouts whose segments are gone (what `collect --resume` repairs)


@dataclass(frozen=True)
class IterationState:
    """What the gate found of an iteration: nothing (ok), or its findings in order."""

    iteration: int
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def line(self, root: Path) -> str | None:
        """The first finding, and how many follow (one line); None when there is none."""
        return first_line([finding.line for finding in self.findings], root)

    def check(self, root: Path) -> None:
        line = self.line(root)
        if line is not None:
            raise Refused(line)


def inspect_iteration(warehouse: Warehouse, iteration: int, *, share: tuple[int, int] | None = None,
                      owns: Callable[[str], bool] | None = None, collecting: bool = False) -> IterationState:
    """The gate's findings for an iteration (module docstring); of one shard's share of it with
    `share` (index, count) and `owns` (whether a prompt id is the shard's). `collecting`: the
    caller holds the iteration's collect lock and is about to finish it (`collect --resume`), so
    neither the lock nor completeness is a finding."""
    warehouse.check_is_warehouse()
    root = warehouse.root
    rollouts, foreign = warehouse.parts_of(schema.ROLLOUTS, iteration=iteration)
    segments, foreign_segments = warehouse.parts_of(schema.SEGMENTS, iteration=iteration)
    # a collection part's segments twin goes with its rollouts part (adopt and remove settle both)
    twins = {path.name for path in foreign}
    foreign.update({path: reason for path, reason in foreign_segments.items() if path.name not in twins})
    foreign.update(_uncommitted_foreign(warehouse, iteration))
    lines = [foreign_line(root, path, reason, f"every reader refuses iteration {iteration}")
             for path, reason in foreign.items()]
    running = None if collecting else collect_refusal(root, iteration, share,
                                                      "wait for the collection to end, then run this again")
    lines += [running] if running else []
    findings = [Finding(line) for line in lines]
    connection = duckdb.connect(":memory:")
    try:
        _load(connection, rollouts, segments)
        findings += [Finding(line) for line in _twice(connection, root, iteration)]
        findings += [Finding(_lost_line(root, iteration, part), part) for part in _lost(connection)]
        findings += [Finding(line) for line in _misfit(connection, root, iteration)]
        if not collecting and running is None:  # while it is collected it is incomplete, of course
            findings += [Finding(line) for line in _incomplete(connection, warehouse, iteration, share, owns)]
    finally:
        connection.close()
    return IterationState(iteration, tuple(findings))


def check_iteration(warehouse: Warehouse, iteration: int, **options) -> None:
    """Refused with the gate's first finding for the iteration, if any (`inspect_iteration`)."""
    inspect_iteration(warehouse, iteration, **options).check(warehouse.root)


def _load(connection: duckdb.DuckDBPyConnection, rollouts: Sequence[Path], segments: Sequence[Path]) -> None:
    """Tables `r` (rollout, prompt, its part) and `s` (per rollout: segments, distinct seqs, lowest
    and highest seq)."""
    if rollouts:
        connection.execute(
            "CREATE TABLE r AS SELECT rollout_id, prompt_id, filename AS part "
            "FROM read_parquet(?, hive_partitioning = false, filename = true)", [[str(p) for p in rollouts]])
    else:
        connection.execute("CREATE TABLE r (rollout_id VARCHAR, prompt_id VARCHAR, part VARCHAR)")
    if segments:
        connection.execute(
            "CREATE TABLE s AS SELECT rollout_id, count(*) AS n, count(DISTINCT seq) AS seqs, min(seq) AS low, "
            "max(seq) AS high FROM read_parquet(?, hive_partitioning = false) GROUP BY rollout_id",
            [[str(p) for p in segments]])
    else:
        connection.execute("CREATE TABLE s (rollout_id VARCHAR, n BIGINT, seqs BIGINT, low INT, high INT)")


def _named(ids: Sequence[str], total: int) -> str:
    return ", ".join(ids[:MANY]) + (f", ... ({total} in all)" if total > MANY else "")


def _twice(connection: duckdb.DuckDBPyConnection, root: Path, iteration: int) -> list[str]:
    rows = connection.execute(
        "SELECT rollout_id, count(*), list(DISTINCT part ORDER BY part), count(*) OVER () FROM r "
        "GROUP BY rollout_id HAVING count(*) > 1 ORDER BY rollout_id LIMIT 1").fetchall()
    if not rows:
        return []
    ((rollout_id, times, parts, total),) = rows
    return [f"{root}: iteration {iteration}: rollout {rollout_id} is stored {times} times (in {', '.join(parts)})"
            f"{f', and {total - 1} more rollouts are stored more than once' if total > 1 else ''}: two collections "
            "wrote it; delete the iteration's rollouts and segments parts and collect it again"]


def _lost(connection: duckdb.DuckDBPyConnection) -> list[LostSegments]:
    rows = connection.execute(
        "SELECT part, list(rollout_id ORDER BY rollout_id) FILTER (WHERE s.rollout_id IS NULL), count(*) "
        "FROM r LEFT JOIN s USING (rollout_id) GROUP BY part "
        "HAVING count(*) FILTER (WHERE s.rollout_id IS NULL) > 0 ORDER BY part").fetchall()
    return [LostSegments(Path(part), tuple(ids), len(ids) == total) for part, ids, total in rows]


def _lost_line(root: Path, iteration: int, lost: LostSegments) -> str:
    twin = root / schema.SEGMENTS.name / lost.part.relative_to(root / schema.ROLLOUTS.name)
    where = (f"its rollouts part {lost.part} has no segments part {twin}" if not twin.exists()
             else f"its segments part {twin} does not hold them")
    fix = (f"`cleaner collect -w {root} --iteration {iteration} --resume` (and its other options) collects them "
           "again" if lost.whole else
           "the part's other rollouts kept theirs, so they cannot be collected again without storing those twice: "
           "restore the segments part from a copy of the warehouse, or collect the iteration again (another --iteration)")
    return (f"{root}: iteration {iteration}: {len(lost.rollout_ids)} rollouts have no segments "
            f"({_named(lost.rollout_ids, len(lost.rollout_ids))}): {where}; {fix}")


def _uncommitted_foreign(warehouse: Warehouse, iteration: int) -> dict[Path, str]:
    """The segments parts of an iteration that no rollouts part commits (invisible to every reader)
    and that the warehouse did not write, judged by their footer's stamp: a copy waiting for a
    rollouts part of its name is named too, and no writer removes it as a killed collection's."""
    owner, found = warehouse.ownership(), {}
    committed = warehouse.root / schema.ROLLOUTS.name / f"iteration={iteration}"
    for part in list_parts(warehouse.root, schema.SEGMENTS, {"iteration": iteration}):
        if not (committed / part.name).exists() and (reason := foreign_part(owner, part)) is not None:
            found[part] = reason
    return found


def drop_lost(lost: LostSegments) -> None:
    """Remove a rollouts part whose rollouts all lost their segments (`collect --resume`, holding
    the iteration's collect lock): they are then missing, which a resume collects again; a crash
    after it leaves them missing, which the next resume collects."""
    if not lost.whole:
        raise ValueError(f"{lost.part}: some of its rollouts kept their segments")
    lost.part.unlink(missing_ok=True)
    fsync_dir(lost.part.parent)


def _misfit(connection: duckdb.DuckDBPyConnection, root: Path, iteration: int) -> list[str]:
    """Rollouts whose segments are there but not exactly once each."""
    rows = connection.execute(
        "SELECT rollout_id, n, seqs, low, high, count(*) OVER () FROM r JOIN s USING (rollout_id) "
        "WHERE seqs <> n OR low <> 0 OR high <> n - 1 ORDER BY rollout_id LIMIT 1").fetchall()
    if not rows:
        return []
    ((rollout_id, n, seqs, low, high, total),) = rows
    return [f"{root}: iteration {iteration}: rollout {rollout_id} has {n} segments with {seqs} distinct seqs from "
            f"{low} to {high}, not seq 0 to {n - 1} once each{f' ({total} such rollouts)' if total > 1 else ''}: its "
            "segments were changed after it was committed; restore its parts from a copy of the warehouse, or "
            "collect the iteration again (another --iteration)"]


def _incomplete(connection: duckdb.DuckDBPyConnection, warehouse: Warehouse, iteration: int,
                share: tuple[int, int] | None, owns: Callable[[str], bool] | None) -> list[str]:
    plan = warehouse.plan(iteration)
    if plan is None:
        return []
    prompts = [p for p in plan.prompt_ids if owns is None or owns(p)]
    planned = len(prompts) * plan.group_size
    connection.register("planned", pa.table({"prompt_id": pa.array(prompts, pa.string())}))
    ((stored,),) = connection.execute(
        "SELECT count(DISTINCT rollout_id) FROM r SEMI JOIN planned USING (prompt_id)").fetchall()
    if stored >= planned:
        return []
    where = f"iteration {iteration}" + (f" shard {share[0]}/{share[1]}" if share else "")
    return [f"{warehouse.root}: {where} holds {stored} of the {planned} rollouts its collection planned: it was "
            f"interrupted; finish it with `cleaner collect --iteration {iteration} --resume` (and its other options) "
            "before reading it, so what is read covers the whole iteration"]


# ---------------------------------------------------------------------------------------------
# A purify config's rows


def inspect_config(warehouse: Warehouse, iteration: int, config_id: str) -> tuple[str, ...]:
    """The gate's findings for a config's rows of an iteration (module docstring)."""
    root = warehouse.root
    parts, foreign = warehouse.parts_of(schema.PURIFIED, iteration=iteration, config=config_id)
    _, foreign_configs = warehouse.parts_of(schema.PURIFY_CONFIGS)
    findings = [foreign_line(root, path, reason, f"every reader refuses purify config {config_id}")
                for path, reason in {**foreign, **foreign_configs}.items()]
    if not parts:
        return tuple(findings)
    rollouts = warehouse.parts_of(schema.ROLLOUTS, iteration=iteration)[0]
    connection = duckdb.connect(":memory:")
    try:
        connection.execute("CREATE TABLE p AS SELECT rollout_id, negative_seq, filename AS part FROM "
                           "read_parquet(?, hive_partitioning = false, filename = true)", [[str(p) for p in parts]])
        _load(connection, rollouts, [])
        twice = connection.execute(
            "SELECT rollout_id, count(*), list(DISTINCT part ORDER BY part), count(*) OVER () FROM p "
            "GROUP BY rollout_id, negative_seq HAVING count(*) > 1 ORDER BY rollout_id LIMIT 1").fetchall()
        orphans = connection.execute("SELECT DISTINCT rollout_id FROM p ANTI JOIN r USING (rollout_id) "
                                     "ORDER BY 1").fetchall()
    finally:
        connection.close()
    directory = parts[0].parent
    for rollout_id, times, files, total in twice:
        findings.append(
            f"{root}: purify config {config_id} of iteration {iteration} holds {times} rows for rollout {rollout_id} "
            f"(in {', '.join(files)}){f', and {total - 1} more rollouts have more than one' if total > 1 else ''}: "
            f"an older cleaner stored a repeated grid value once per repeat, and training would count each row; "
            f"delete {directory} and purify the iteration under the config again")
    if orphans:
        ids = [rollout_id for (rollout_id,) in orphans]
        findings.append(
            f"{root}: purify config {config_id} of iteration {iteration} holds rows of {len(ids)} rollouts the "
            f"iteration does not hold ({_named(ids, len(ids))}): their rollouts part is gone or not the warehouse's; "
            f"restore it (or adopt it), or delete {directory} and purify the iteration again")
    return tuple(findings)


def check_config(warehouse: Warehouse, iteration: int, config_id: str) -> None:
    """Refused with the first finding for the config's rows of the iteration, if any."""
    line = first_line(inspect_config(warehouse, iteration, config_id), warehouse.root)
    if line is not None:
        raise Refused(line)


def first_line(lines: Sequence[str], root: Path) -> str | None:
    """The first of the gate's lines, and how many follow (one line); None without any."""
    if not lines:
        return None
    more = len(lines) - 1
    return lines[0] + (f" (and {more} more: `cleaner warehouse -w {root}` lists every one)" if more else "")


def collected_iteration(connection: duckdb.DuckDBPyConnection, rollout_id: str) -> int | None:
    """The iteration of a collected rollout over one of `Warehouse.connect()`'s connections, if it
    has a row."""
    rows = connection.execute("SELECT iteration FROM rollouts WHERE rollout_id = ? LIMIT 1", [rollout_id]).fetchall()
    return rows[0][0] if rows else None


def findings_of(warehouse: Warehouse, iteration: int) -> list[str]:
    """Every finding of an iteration and of each config's rows of it, in order (what `cleaner
    show` says of a rollout's iteration)."""
    lines = [finding.line for finding in inspect_iteration(warehouse, iteration).findings]
    configs = sorted({part.parent.name.split("=", 1)[1]
                      for part in list_parts(warehouse.root, schema.PURIFIED, {"iteration": iteration})})
    for config_id in configs:
        lines += [line for line in inspect_config(warehouse, iteration, config_id) if line not in lines]
    return lines


def every_finding(warehouse: Warehouse) -> list[str]:
    """Every finding of every iteration the warehouse knows of (collected, planned or purified) and
    of every config's rows, in order (`cleaner warehouse`, the report, the browser)."""
    warehouse.check_is_warehouse()
    lines: list[str] = []
    for iteration in known_iterations(warehouse):
        lines += [line for line in findings_of(warehouse, iteration) if line not in lines]
    for dataset in OTHER_DATASETS:  # read by the report, train's resume and eval: left out of them, named here
        lines += [foreign_line(warehouse.root, path, reason) for path, reason in warehouse.parts_of(dataset)[1].items()]
    return lines


def known_iterations(warehouse: Warehouse) -> list[int]:
    """The iterations with rollouts parts, a recorded plan, or purified rows (file names only)."""
    purified = {int(part.parent.parent.name.split("=", 1)[1]) for part in list_parts(warehouse.root, schema.PURIFIED)}
    return sorted({*warehouse.iterations_collected(), *warehouse.planned_iterations(), *purified})
