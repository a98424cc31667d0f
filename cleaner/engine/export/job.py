"""The export job: collected iterations as a Hugging Face dataset folder for other trainers
(docs/architecture.md §15); `export_job(warehouse, ExportRequest)`.

Design decisions:
- It reads and never writes the warehouse: the warehouse is opened read-only (the validation
  manifest stays in memory), DuckDB spills into a private temporary directory, so a warehouse on
  a read-only file system exports.
- Everything that can be refused is refused before the output folder exists: the iterations (not
  collected; what the readers' gate finds, warehouse/gate.py; not purified, for `--view purified`),
  `--where` (and a selection of nothing: a folder of no rows is refused, never written), the purify
  config, each policy's tokenizer and chat template, an `--out` holding anything unless
  `--overwrite` (and then only a dataset cleaner exported: `outputs.py`). The folder is written
  beside `--out` and swapped in
  whole (`outputs.atomic_directory`), so an export that fails leaves nothing half-written.
- Rows stream (warehouse/selection.py, folder.py): memory holds a batch of rollouts and a row
  group, whatever the warehouse's size; a progress bar counts the rollouts read.
- The purified view is what the config trained: a rollout whose row trains nothing (down-sampled
  out, or masked by the void-turn filter) has no conversation there, so it is left out, and the
  card counts it.
- Chain pairs use the SAAR settings (gamma, similarity) of the purify config given, or of the
  iterations' only one (several without `--config-id` are refused), else, where none was purified,
  the defaults of `cleaner purify`; the card names which. Their number
  is checked against the documented SQL count (`selection.FIXED_CHAINS`), outcome pairs' against
  `selection.OUTCOME_PAIRS`, and the card states both.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import groupby
from pathlib import Path

from tqdm.auto import tqdm

from cleaner.config import Edit, PurifyConfig, SaarMerge
from cleaner.config.groups import group_values
from cleaner.engine.export import rows as rowing
from cleaner.engine.export.card import CardFacts, card
from cleaner.engine.export.folder import (
    MESSAGES,
    PREFERENCE,
    SFT,
    Shards,
    openai_messages,
    stored_messages,
)
from cleaner.engine.export.policy import Policy, policy_for
from cleaner.engine.saar.walk import RenderSettings
from cleaner.errors import JobError
from cleaner.interrupts import QueryStop, watched
from cleaner.outputs import DATASET, OutputError, atomic_directory, check_outside, check_replaceable
from cleaner.records import PurifyConfigRow
from cleaner.warehouse import Warehouse, selection
from cleaner.warehouse.gate import check_config, check_iteration

logger = logging.getLogger(__name__)

DUCKDB_MEMORY = "1GB"  # DuckDB's sort of the selection spills past this


class ExportFormat(StrEnum):
    SFT = SFT  # one conversation per rollout, TRL's conversational format (Parquet)
    PREFERENCE = PREFERENCE  # prompt, chosen, rejected (Parquet)
    MESSAGES = MESSAGES  # the conversations as OpenAI-style chat JSON Lines


class ExportView(StrEnum):
    RAW = "raw"  # the stored rollout, every attempt
    PURIFIED = "purified"  # SAAR's rendering, as purify stored it under a config


class Pairs(StrEnum):
    CHAIN = "chain"  # one per failure-correction chain SAAR fixed: the failed turn against the fixed one
    OUTCOME = "outcome"  # a correct against an incorrect rollout of the same group


@dataclass(frozen=True)
class ExportRequest:
    """What an export writes: which rollouts, in which format, where."""

    iterations: tuple[int, ...]  # the collected iterations to export
    form: ExportFormat  # sft | preference | messages
    out: Path  # the dataset folder
    view: ExportView = ExportView.RAW  # conversations of the stored rollout, or of its purified row
    where: str | None = None  # a SQL condition over the rollouts view's columns
    pairs: Pairs = Pairs.CHAIN  # preference: chain pairs, or outcome pairs within a group
    config_id: str | None = None  # the purify config (a unique prefix): its rows, its SAAR settings
    policy: Path | None = None  # the tokenizer and chat template (default: each iteration's collecting policy)
    rows_per_shard: int = 10_000  # rows of one shard under data/
    overwrite: bool = False  # replace a dataset cleaner exported at `out`
    batch_rows: int = 256  # rollouts read at a time

    def __post_init__(self) -> None:
        for name, kind in (("form", ExportFormat), ("view", ExportView), ("pairs", Pairs)):
            value = getattr(self, name)
            if value not in set(kind):
                raise ValueError(f"{name} must be one of {', '.join(kind)}, got {value!r}")
            object.__setattr__(self, name, kind(value))
        if not self.iterations:
            raise ValueError("iterations: give at least one")
        if self.rows_per_shard < 1 or self.batch_rows < 1:
            raise ValueError("rows_per_shard and batch_rows must be >= 1")

    @property
    def chain_pairs(self) -> bool:
        return self.form == ExportFormat.PREFERENCE and self.pairs == Pairs.CHAIN

    @property
    def purified_rows(self) -> bool:
        """Conversations come from a purify config's stored rows (chain pairs render SAAR's walk)."""
        return self.view == ExportView.PURIFIED and not self.chain_pairs


@dataclass(frozen=True)
class ExportOutcome:
    out: Path
    rows: int
    shards: int
    rollouts: int  # rollouts selected
    exact: int | None  # conversations the template renders back exactly (sft, messages)
    counted: int | None  # pairs by the documented SQL count (preference)
    seconds: float


@dataclass
class _Tally:
    rows: int = 0
    exact: int = 0
    untrained: int = 0  # purified view: rollouts whose row the config trains nothing of, left out
    kinds: Counter = field(default_factory=Counter)  # pairs by depth, or by whether exact
    errors: Counter = field(default_factory=Counter)  # chain pairs by error type


@dataclass(frozen=True)
class _ExportPlan:
    selected: int
    config: PurifyConfigRow | None  # the purify config read (its rows, or its SAAR settings)
    saar: RenderSettings  # chain pairs' SAAR settings
    policies: dict[int, Policy]
    counted: int | None


def export_job(warehouse: Warehouse, request: ExportRequest, *, progress: bool = True) -> ExportOutcome:
    """Write the dataset folder `request.out` from `warehouse` (module docstring)."""
    started = time.monotonic()
    _check_out(request, warehouse)
    readonly = Warehouse(warehouse.root, read_only=True)
    readonly.check_is_warehouse()
    for iteration in request.iterations:  # the readers' gate: whole, not being written, each rollout once
        check_iteration(readonly, iteration)
    # a Ctrl-C interrupts the query running (a long --where), and the stop comes before the swap
    stop = QueryStop("interrupting the export", f"nothing was written ({request.out} is as it was)")
    with tempfile.TemporaryDirectory(prefix="cleaner-export-") as spill:
        with stop:
            connection = readonly.connect(settings={"temp_directory": spill, "memory_limit": DUCKDB_MEMORY},
                                          warn_foreign=False)  # the gate names them
        try:
            with stop, watched(connection):
                plan = _plan(connection, readonly, request)
            with atomic_directory(request.out, DATASET) as directory, stop, watched(connection):
                shards = Shards(directory, request.form, request.rows_per_shard)
                tally = _write(connection, plan, request, shards, progress, stop)
                _check_written(tally, request)
                paths = shards.close()
                facts = _facts(warehouse, request, plan, tally, len(paths), shards.bytes)
                (directory / "README.md").write_text(card(facts))
        finally:
            connection.close()
    if plan.counted is not None and plan.counted != tally.rows:
        logger.warning("%d pairs written, but the documented SQL counts %d", tally.rows, plan.counted)
    exact = tally.exact if request.form != ExportFormat.PREFERENCE else None
    return ExportOutcome(Path(request.out), tally.rows, len(paths), plan.selected, exact, plan.counted,
                         time.monotonic() - started)


def _facts(warehouse: Warehouse, request: ExportRequest, plan: _ExportPlan, tally: _Tally, shards: int,
           data_bytes: int) -> CardFacts:
    config = plan.config
    chains = request.chain_pairs
    described = None if config is None else (
        f"{config.config_id} (gamma {config.gamma}, similarity on {config.similarity_on}, edit {config.edit})")
    if chains and config is None:
        described = f"none; SAAR at cleaner purify's defaults (gamma {plan.saar.gamma}, similarity on {plan.saar.similarity_on})"
    return CardFacts(
        warehouse=warehouse.root.resolve(), form=str(request.form),
        pairs=str(request.pairs) if request.form == ExportFormat.PREFERENCE else None,
        view="purified (SAAR's rendering)" if chains else str(request.view), iterations=request.iterations,
        where=request.where, config=described,
        policies=tuple(dict.fromkeys(policy.path for policy in plan.policies.values())),
        selected=plan.selected, rows=tally.rows, data_bytes=data_bytes, shards=shards,
        exact=tally.exact if request.form != ExportFormat.PREFERENCE else None, counted=plan.counted,
        kinds=tally.kinds, errors=tally.errors, untrained=tally.untrained)


def _check_out(request: ExportRequest, warehouse: Warehouse) -> None:
    out = Path(request.out)
    warehouse.check_is_warehouse()  # -w at a run directory or at / is named first
    check_outside(out, warehouse.root, "--out")
    if out.is_dir() and any(out.iterdir()) and not request.overwrite:
        raise OutputError(f"--out {out} is not empty; pass --overwrite to replace a dataset cleaner "
                          "exported there, or choose another folder")
    check_replaceable(out, DATASET)


# ---------------------------------------------------------------------------------------------
# What can be refused, before anything is written


def _plan(connection, warehouse: Warehouse, request: ExportRequest) -> _ExportPlan:
    collected = selection.collected_iterations(connection)
    missing = [i for i in request.iterations if i not in collected]
    if missing:
        have = ", ".join(map(str, collected)) or "none"
        raise JobError(f"{warehouse.root}: iteration {missing[0]} is not collected (collected: {have})")
    logger.debug("selecting the rollouts of iteration(s) %s", _listed(request.iterations))
    selected = selection.select(connection, request.iterations, request.where)
    if not selected:
        which = "no rollout" if request.where is None else f"no rollout for which --where {request.where!r} holds"
        raise JobError(f"iteration(s) {_listed(request.iterations)} hold {which}: nothing to export")
    config = _config(connection, warehouse, request)
    saar = RenderSettings(True, **group_values(config or PurifyConfig(), SaarMerge))  # chain pairs: merge only
    cache: dict = {}
    policies = {i: policy_for(request.policy, warehouse.collect_config(i), i, cache) for i in request.iterations}
    counted = None
    if request.form == ExportFormat.PREFERENCE:
        if request.pairs == Pairs.CHAIN:
            counted = selection.count(connection, selection.FIXED_CHAINS)
        elif request.purified_rows:  # what the config trains: a rollout whose row trains nothing is no pair
            counted = selection.count(connection, selection.OUTCOME_PAIRS_TRAINED, {"config_id": config.config_id})
        else:
            counted = selection.count(connection, selection.OUTCOME_PAIRS)
        if not counted:
            raise JobError(f"the {selected} selected rollouts hold no {request.pairs} pair (the documented SQL "
                           f"count is 0: {_NO_PAIRS[request.pairs]}): nothing to export")
    return _ExportPlan(selected, config, saar, policies, counted)


_NO_PAIRS = {Pairs.CHAIN: "no failed call that a later call of its step fixed",
             Pairs.OUTCOME: "no group with both a correct and an incorrect rollout"}


def _check_written(tally: _Tally, request: ExportRequest) -> None:
    """A folder without rows is never swapped in (what `_plan` counted said there would be some)."""
    if not tally.rows and tally.untrained:
        raise JobError(f"the purify config trains none of the {tally.untrained} rollout(s) selected (down-sampled "
                       "out, or masked by the void-turn filter), and the purified view is what it trained: "
                       "nothing to export")
    if not tally.rows:
        raise JobError(f"no {request.form} row came of the selection: nothing to export")


def _config(connection, warehouse: Warehouse, request: ExportRequest) -> PurifyConfigRow | None:
    """The purify config read: the one given, or the iterations' only one; None where the export
    needs none, or (chain pairs) where the iterations have none."""
    if not (request.purified_rows or request.chain_pairs):
        return None
    configs = selection.purify_configs(connection, request.iterations)
    config_id = warehouse.resolve_config_id(request.config_id) if request.config_id else None
    if config_id is None:
        found = sorted({c for ids in configs.values() for c in ids})
        if len(found) > 1:
            raise JobError(f"iterations {_listed(request.iterations)} are purified under several configs "
                           f"({', '.join(found)}); choose one with --config-id")
        config_id = found[0] if found else None
    if request.purified_rows:
        for iteration, ids in configs.items():
            if config_id not in ids:
                under = f" under config {config_id}" if config_id else ""
                raise JobError(f"{warehouse.root}: iteration {iteration} is not purified{under}; run cleaner purify "
                               f"-w {warehouse.root} --iteration {iteration}, or export --view raw")
    config = selection.purify_config(connection, config_id) if config_id else None
    if config_id and config is None:
        raise JobError(f"{warehouse.root}: no purify config {config_id}")
    if request.purified_rows:
        for iteration in request.iterations:
            check_config(warehouse, iteration, config.config_id)
        _check_purified(connection, warehouse, config)
    return config


def _check_purified(connection, warehouse: Warehouse, config: PurifyConfigRow) -> None:
    if config.edit == Edit.MASK:
        raise JobError(f"config {config.config_id} edits by mask: its rows are the raw conversation with the failed "
                       "calls untrained, which messages cannot say; export --view raw, or a replace config")
    missing = selection.unpurified(connection, config.config_id)
    if missing:
        raise JobError(f"{warehouse.root}: {missing} selected rollouts have no row under config {config.config_id} "
                       "(a purify still running?); run cleaner purify again")


def _listed(values) -> str:
    return ", ".join(map(str, values))


# ---------------------------------------------------------------------------------------------
# Rows


def _write(connection, plan: _ExportPlan, request: ExportRequest, shards: Shards, progress: bool,
           stop: QueryStop) -> _Tally:
    tally = _Tally()
    config_id = plan.config.config_id if request.purified_rows else None
    with tqdm(total=plan.selected, desc="export", unit="rollout", disable=not progress) as bar:
        for batch in selection.stream(connection, request.batch_rows, config_id):
            stop.check()  # a Ctrl-C between the streams' reads
            if request.form == ExportFormat.PREFERENCE and not request.chain_pairs:
                for _, group in groupby(batch, key=lambda c: c.rollout.group_id):
                    _outcome_rows(list(group), plan, request, shards, tally)
            else:
                for collected in batch:
                    _rollout_rows(collected, plan, request, shards, tally)
            bar.update(len(batch))
    return tally


def _untrained(collected) -> bool:
    """Its purified row trains nothing (down-sampling dropped it, or the void-turn filter masked
    it): the purified view is what the config trained, so it has no conversation there."""
    return not any(collected.purified.loss_mask)


def _conversation(collected, policy: Policy, purified: bool) -> rowing.Conversation:
    if purified:
        return rowing.purified_conversation(collected.segments, collected.purified, policy.template,
                                            policy.chat.decode)
    return rowing.raw_conversation(collected.segments, policy.template)


def _rollout_rows(collected, plan: _ExportPlan, request: ExportRequest, shards: Shards, tally: _Tally) -> None:
    policy = plan.policies[collected.rollout.iteration]
    if request.form == ExportFormat.PREFERENCE:
        for pair in rowing.chain_pairs(collected.segments, plan.saar, policy.template, policy.chat.decode):
            shards.add(_pair_row(pair.prompt, pair.chosen, pair.rejected, policy, collected, None, plan,
                                 ExportView.PURIFIED, step=pair.step, depth=pair.depth, error_type=pair.error_type))
            tally.rows += 1
            tally.kinds[pair.depth] += 1
            tally.errors[pair.error_type] += 1
        return
    if request.purified_rows and _untrained(collected):
        tally.untrained += 1
        return
    conversation = _conversation(collected, policy, request.purified_rows)
    rollout = collected.rollout
    row = {
        "messages": stored_messages(conversation.messages) if request.form == ExportFormat.SFT
        else openai_messages(conversation.messages),
        "tools": _tools(policy, request.form),
        "rollout_id": rollout.rollout_id, "iteration": rollout.iteration, "group_id": rollout.group_id,
        "prompt_id": rollout.prompt_id, "sample_index": rollout.sample_index, "data_source": rollout.data_source,
        "policy_version": rollout.policy_version, "collect_config_id": rollout.collect_config_id,
        "purify_config_id": plan.config.config_id if request.purified_rows else None,
        "view": str(request.view), "reward": rollout.reward, "correct": rollout.correct,
        "finish_reason": str(rollout.finish_reason), "n_failed_calls": rollout.n_failed_calls,
        "exact": conversation.exact,
    }
    shards.add(row)
    tally.rows += 1
    tally.exact += conversation.exact


def _tools(policy: Policy, form: ExportFormat) -> object:
    """The tools as the format holds them: JSON text for the Parquet formats (a Json feature), a
    list in a JSON line."""
    return list(policy.tools) if form == ExportFormat.MESSAGES else _dumps(list(policy.tools))


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _outcome_rows(group: list, plan: _ExportPlan, request: ExportRequest, shards: Shards, tally: _Tally) -> None:
    purified = request.purified_rows
    if purified:
        trained = [collected for collected in group if not _untrained(collected)]
        tally.untrained += len(group) - len(trained)
        group = trained
    for chosen, rejected in rowing.outcome_pairs(group):
        policy = plan.policies[chosen.rollout.iteration]
        good, bad = _conversation(chosen, policy, purified), _conversation(rejected, policy, purified)
        cut = good.prompt_length  # a group shares its prompt
        shards.add(_pair_row(good.messages[:cut], good.messages[cut:], bad.messages[cut:], policy, chosen,
                             rejected, plan, request.view))
        tally.rows += 1
        tally.kinds["exact" if good.exact and bad.exact else "not exact"] += 1


def _pair_row(prompt, chosen, rejected, policy: Policy, first, second, plan: _ExportPlan, view: ExportView,
              step: int | None = None, depth: str | None = None, error_type: str | None = None) -> dict:
    rollout = first.rollout
    return {
        "prompt": stored_messages(prompt), "chosen": stored_messages(chosen), "rejected": stored_messages(rejected),
        "tools": _dumps(list(policy.tools)), "pair": str(Pairs.CHAIN if second is None else Pairs.OUTCOME),
        "rollout_id": rollout.rollout_id, "rejected_rollout_id": None if second is None else second.rollout.rollout_id,
        "iteration": rollout.iteration, "group_id": rollout.group_id, "prompt_id": rollout.prompt_id,
        "policy_version": rollout.policy_version, "collect_config_id": rollout.collect_config_id,
        "purify_config_id": plan.config.config_id if plan.config is not None and (
            second is None or view == ExportView.PURIFIED) else None,
        "view": str(view), "reward": rollout.reward,
        "rejected_reward": None if second is None else second.rollout.reward,
        "step": step, "depth": depth, "error_type": error_type,
    }
