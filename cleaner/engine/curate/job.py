"""The curate job: pass statistics from a warehouse or a file, written in the paper's format and/or
applied to a dataset as the paper's filter applies them (docs/architecture.md §16);
`curate_job(warehouse, CurateConfig)`.

    statistics (warehouse iterations + evaluations, pooled | a JSON Lines file)
        -> [--stats-out FILE]
        -> match to the dataset's rows -> per rate x (code | other): floor(count x ratio), drawn
        -> [--out DATASET] + DATASET.curate.md + DATASET.curate.json

Design decisions:
- Everything that can be refused is refused before anything is written: the ratios, the outputs
  (an existing one without --overwrite, or one curate did not write; one inside the warehouse),
  an iteration not collected, still being collected or incomplete (the check purify makes before
  it reads, `check_complete`), an evaluation without its `eval_runs` row, a statistics file, a
  dataset that is not verl's layout (collect/tasks.py's errors), statistics that match no row, a
  selection that keeps nothing. Then every file is written beside its path and renamed into place
  (outputs.atomic_files).
- The warehouse is read, never written: opened read-only, as export opens it.
- The output is the input's table, its rows taken in order: every column, the file's schema and
  metadata, nothing added (the paper's script also writes its statistics columns and a `uid`; the
  summary JSON holds the statistics instead, so collect and run read the output as they read the
  input).
- A dataset's `uid` column is its key (the paper's rule) even against a warehouse's statistics,
  whose uids are the keys collect gave the rows (extra_info.index, else the position): where the
  two differ a warning says how many rows, so `-w` and a statistics file it wrote filter alike.
- An existing --out is replaced only with --overwrite and only if its summary JSON says curate
  wrote it and records its sha256; an existing --stats-out only with --overwrite and only if it
  reads as a statistics file, so a file of anything else is never lost.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cleaner.config import UNSHARDED, CurateConfig, PromptStyle
from cleaner.engine.collect.tasks import check_verl_columns, read_parquet_table, verl_tasks
from cleaner.engine.curate import stats as statistics
from cleaner.engine.curate.filtering import Selection, match_rows, select
from cleaner.engine.curate.ratios import RatioSpec, parse_ratios
from cleaner.engine.curate.stats import PromptStats, StatsError
from cleaner.engine.curate.summary import TITLE, WRITTEN_BY, CurationFacts, page, record, stats_page
from cleaner.errors import JobError
from cleaner.outputs import OutputError, atomic_files
from cleaner.warehouse import Warehouse
from cleaner.warehouse.pass_rates import prompt_outcomes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurateOutcome:
    stats_page: str | None  # what --stats-out wrote, in words and a table (None: not asked)
    page: str | None  # the filter's summary (None: no --out)
    kept: int | None  # rows written to --out
    seconds: float


@dataclass(frozen=True)
class _Statistics:
    items: list[PromptStats]
    source: str  # where they came from, in words
    rollouts: int = 0  # the warehouse's rollouts read
    faults: int = 0  # of those, ended by an infrastructure fault
    faulted_prompts: int = 0  # prompts without a rollout the policy decided


def curate_job(warehouse: Warehouse, config: CurateConfig) -> CurateOutcome:
    """Write the statistics and/or the filtered dataset that `config` asks for (module notes)."""
    started = time.monotonic()
    spec = parse_ratios(config.success_rate_ratios)
    _check_outputs(warehouse, config)
    found = _from_warehouse(warehouse, config) if config.iterations or config.evals else _from_file(config.stats)
    ordered = statistics.ordered(found.items)
    filtered = _filtered(config, found, spec) if config.out else None
    _write(config, statistics.write_lines(ordered) if config.stats_out else None, filtered)
    text = (stats_page(ordered, found.source, found.rollouts, found.faults, found.faulted_prompts, config.stats_out)
            if config.stats_out else None)
    return CurateOutcome(text, None if filtered is None else page(filtered.facts, filtered.selection),
                         None if filtered is None else filtered.table.num_rows, time.monotonic() - started)


@dataclass(frozen=True)
class _Filtered:
    table: pa.Table  # the kept rows, in the dataset's order
    facts: CurationFacts
    selection: Selection


def _filtered(config: CurateConfig, found: _Statistics, spec: RatioSpec | None) -> _Filtered:
    """The dataset's rows the statistics and ratios keep; JobError if none has statistics or none is kept."""
    table, uids, sources = _dataset(Path(config.data), warned=bool(config.iterations or config.evals))
    decided = [item for item in found.items if item.attempts]
    ratios = {} if spec is None else spec.resolve([item.attempts for item in decided], [item.rate for item in decided])
    matched = match_rows(uids, sources, found.items)
    selection = select(matched, ratios, config.retain_code, config.seed)
    _check_selection(config, found, selection)
    used = {id(item) for item in matched if item is not None}
    facts = CurationFacts(config.data, table.num_rows, found.source, len(found.items),
                          sum(id(item) not in used for item in found.items), config.success_rate_ratios,
                          config.retain_code, config.seed, config.out)
    return _Filtered(table.take(list(selection.kept_rows)), facts, selection)


def _write(config: CurateConfig, stats_lines: str | None, filtered: _Filtered | None) -> None:
    """Every file beside its path, then all renamed into place: statistics, dataset, its summaries."""
    paths = ([config.stats_out] if stats_lines is not None else []) + (
        [config.out, summary_path(config.out, MARKDOWN), summary_path(config.out, JSON)] if filtered else [])
    with atomic_files([Path(path) for path in paths]) as temporaries:
        if stats_lines is not None:
            temporaries.pop(0).write_text(stats_lines, encoding="utf-8")
        if filtered is not None:
            data, markdown, record_json = temporaries
            pq.write_table(filtered.table, data)
            markdown.write_text(page(filtered.facts, filtered.selection), encoding="utf-8")
            record_json.write_text(record(filtered.facts, filtered.selection, _sha256(data)), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Outputs: refused before anything is read


MARKDOWN, JSON = ".curate.md", ".curate.json"  # the summaries' suffixes, after --out's name


def summary_path(out: str, suffix: str) -> str:
    """A summary's file beside --out: `<out>.curate.md`, `<out>.curate.json`."""
    return out + suffix


def _check_outputs(warehouse: Warehouse, config: CurateConfig) -> None:
    root = warehouse.root.resolve()
    for flag, path in (("--stats-out", config.stats_out), ("--out", config.out)):
        if path is not None and (Path(path) == root or root in Path(path).parents):
            raise OutputError(f"{flag} {path} is inside the warehouse {warehouse.root}, which holds only what its "
                              "writers write; choose a path outside it")
        if path is not None and Path(path).is_dir():
            raise OutputError(f"{flag} {path} is a directory; give the file to write")
    if config.stats_out and config.out and config.stats_out in (config.out, *(summary_path(config.out, s) for s in
                                                                              (MARKDOWN, JSON))):
        raise OutputError(f"--stats-out {config.stats_out} is one of --out's files; choose another path")
    if config.stats_out and Path(config.stats_out).exists():
        _check_replaceable_stats(Path(config.stats_out), config.overwrite)
    if config.out:
        _check_replaceable_out(Path(config.out), config.overwrite)


def _check_replaceable_stats(path: Path, overwrite: bool) -> None:
    if not overwrite:
        raise OutputError(f"--stats-out {path} exists; pass --overwrite to replace statistics written there, "
                          "or choose another path")
    try:
        statistics.read_stats(path)
    except StatsError as error:
        raise OutputError(f"--stats-out {path}: will not replace it: it is not a statistics file ({error}); "
                          "choose another path, or move it away yourself") from error


def _check_replaceable_out(out: Path, overwrite: bool) -> None:
    """OutputError unless --out and its summaries are absent, or (with --overwrite) curate's own."""
    summary_json, summary_md = Path(summary_path(str(out), JSON)), Path(summary_path(str(out), MARKDOWN))
    present = [path for path in (out, summary_md, summary_json) if path.exists()]
    if not present:
        return
    if not overwrite:
        raise OutputError(f"--out {out}: {present[0]} exists; pass --overwrite to replace a dataset curate wrote, "
                          "or choose another path")
    recorded = _recorded(summary_json)
    if out.exists() and (recorded is None or recorded.get("out_sha256") != _sha256(out)):
        raise OutputError(f"--out {out}: will not replace it: curate did not write it (no {summary_json.name} beside "
                          "it recording its sha256, or the file changed since); choose another path, or move it "
                          "away yourself")
    if summary_json.exists() and recorded is None:
        raise OutputError(f"--out {out}: will not replace {summary_json}: curate did not write it")
    if summary_md.exists() and summary_md.read_text(errors="replace").split("\n", 1)[0] != TITLE:
        raise OutputError(f"--out {out}: will not replace {summary_md}: curate did not write it")


def _recorded(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("written_by") == WRITTEN_BY else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Statistics


def check_complete(warehouse: Warehouse, iteration: int) -> None:
    """JobError unless `iteration` is collected, not being collected, and holds every rollout its
    collection planned: purify's check (its job's `check_collected`: the readers' gate,
    warehouse/gate.py, then an older iteration's completeness from its collect config)."""
    from cleaner.engine.purify.job import check_collected  # start-up time: purify's job loads torch

    if iteration not in warehouse.iterations_collected():
        have = ", ".join(map(str, warehouse.iterations_collected())) or "none"
        raise JobError(f"{warehouse.root}: iteration {iteration} is not collected (collected: {have})")
    check_collected(warehouse, iteration, UNSHARDED)


def _from_warehouse(warehouse: Warehouse, config: CurateConfig) -> _Statistics:
    readonly = Warehouse(warehouse.root, read_only=True)
    if not readonly.root.is_dir():
        raise JobError(f"{warehouse.root}: no such warehouse directory")
    for iteration in config.iterations:
        check_complete(readonly, iteration)
    for eval_id in config.evals:
        if readonly.read_eval_run(eval_id) is None:
            started = " (its rollouts are stored: finish it by running the same cleaner eval again)" if (
                readonly.eval_rollout_ids(eval_id)) else ""
            raise JobError(f"{warehouse.root}: evaluation {eval_id!r} has no eval_runs row: it is not stored, or not "
                           f"complete{started}; `cleaner sql -w {warehouse.root} \"SELECT eval_id, model, dataset "
                           "FROM eval_runs\"` lists the stored ones")
    connection = readonly.connect()
    try:
        outcomes = prompt_outcomes(connection, config.iterations, config.evals)
    finally:
        connection.close()
    items = [statistics.pooled(o.prompt_id, o.data_source, o.successes, o.attempts, o.reward_sum) for o in outcomes]
    named = [f"iteration {', '.join(map(str, config.iterations))}"] if config.iterations else []
    named += [f"evaluation {', '.join(config.evals)}"] if config.evals else []
    return _Statistics([item for item in items if item is not None],
                       f"warehouse {warehouse.root} ({'; '.join(named)}; pooled per prompt)",
                       sum(o.rollouts for o in outcomes), sum(o.faults for o in outcomes),
                       sum(item is None for item in items))


def _from_file(path: str) -> _Statistics:
    return _Statistics(statistics.read_stats(Path(path)), f"file {path}")


# ---------------------------------------------------------------------------------------------
# The dataset and the selection


def _dataset(path: Path, warned: bool):
    """The dataset's table, each row's uid and data source; DatasetError for a file collect would
    refuse. `warned`: say so where a `uid` column is not the key a warehouse's statistics use."""
    table = read_parquet_table(path)
    check_verl_columns(path, table)
    tasks = verl_tasks(path, table, PromptStyle.BARE)
    uid_column = table.column("uid").to_pylist() if "uid" in table.column_names else None
    uids = statistics.dataset_uids(path, [task.extra_info for task in tasks], uid_column)
    if warned and uid_column is not None:
        differ = sum(uid != statistics.uid_of(task.prompt_id, task.data_source) for uid, task in zip(uids, tasks,
                                                                                                      strict=True))
        if differ:
            logger.warning("%s: %d row(s) have a `uid` other than the key collect gave them (extra_info.index, else "
                           "the row's position), which names their statistics in the warehouse; rows are matched by "
                           "the `uid` column, as the paper's filter matches them", path, differ)
    return table, uids, [task.data_source for task in tasks]


def _check_selection(config: CurateConfig, found: _Statistics, selection: Selection) -> None:
    matched = sum(item is not None for item in selection.matched)
    if not matched:
        raise JobError(f"--data {config.data}: none of its rows has statistics in {found.source} "
                       f"({len(found.items):,} prompts); a row's uid is its `uid` column, else extra_info.index, "
                       "else its position: statistics of another dataset?")
    if not selection.kept_rows:
        raise JobError(f"--success-rate-ratios {config.success_rate_ratios!r} keeps none of the {matched:,} rows with "
                       "statistics; nothing written")
