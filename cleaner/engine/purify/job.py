"""The purify job: an iteration's rollouts rendered under purify configs, scored and stored
(docs/architecture.md §4, §6, §7).

Idempotence and resume: a rollout that already has rows under a config is skipped (whole groups are
written together), so each shard of an iteration resumes on its own. One writer per iteration (or
shard of it): the job holds the warehouse's purify lock of the iteration while it reads what is
stored and writes, so two purifies of it never both compute and store the same rows.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cleaner.config import UNSHARDED, CollectConfig, Edit, PurifyConfig, Shard
from cleaner.engine.collect.agent import rollout_key
from cleaner.engine.collect.job import collected_policy, load_tasks, shard_of
from cleaner.engine.collect.summary import CollectSummary, summarize
from cleaner.engine.model import Backend, load_backend, require_backend, serving_backend
from cleaner.engine.model.answers import refusal, row_value_faults, stored_value_faults
from cleaner.engine.model.base import ScorerStats
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.loading import check_device, vocab_size_of
from cleaner.engine.purify.pipeline import (
    PurifyResult,
    errors_by_type,
    iteration_premise,
    masked_tokens,
    purify_iteration,
    stats_from_rows,
)
from cleaner.errors import CleanerError, JobError
from cleaner.records import PurifyConfigRow, Rollout, Segment
from cleaner.warehouse import Warehouse
from cleaner.warehouse.gate import check_config, check_iteration

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PurifyRequest:
    """What a purify job computes: an iteration's rows under every config, in one scorer pass."""

    iteration: int  # the collected iteration to purify
    configs: tuple[PurifyConfig, ...]  # the configs to purify it under (ablate's grid; a run's one)
    shard: Shard = UNSHARDED  # the share of the iteration's groups to purify
    backend_kind: str = "torch"  # the backend loaded when the job is handed none: torch | sglang
    sglang_url: str | None = None  # a running SGLang server or router (backend_kind sglang); none: in-process
    device: str = "cpu"  # the torch device of a loaded backend
    scorer_memory_gb: float | None = None  # the torch scorer's cache budget on a GPU; None: half a naive pass's

    def __post_init__(self) -> None:
        # a tuple, so the request stays immutable; a config given twice (a grid's repeated value) is one
        distinct: dict[str, PurifyConfig] = {}
        for config in self.configs:
            distinct.setdefault(config.config_id, config)
        object.__setattr__(self, "configs", tuple(distinct.values()))


@dataclass(frozen=True)
class PurifyOutcome:
    results: list[PurifyResult]  # per requested config, in request order
    computed: list[str]  # config ids purified by this call (the rest were already stored)
    scorer_stats: ScorerStats | None  # the one scorer pass's; None if nothing was scored
    seconds: float


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector; it runs again when the block ends.

    A purify job allocates hundreds of thousands of small acyclic objects (token tuples, floats),
    which reference counting frees anyway; their allocation only triggers collections that scan the
    whole heap, a noticeable share of an ablation in a process that has just collected (measured
    in BENCHMARKS.md, "Purify").
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@_cyclic_gc_paused()
def purify_job(warehouse: Warehouse, request: PurifyRequest, *, backend: Backend | None = None,
               progress: bool = True) -> PurifyOutcome:
    """Purify an iteration, or one shard's share of it, under every config in ONE scorer pass,
    and store the rows.

    The rows are scored by the scorer of `backend`, which must serve the policy that collected the
    iteration; without one, the request's backend is loaded with that policy. Rollouts that already
    have rows under a config are not recomputed (idempotent per rollout, so each shard resumes on
    its own); results are rebuilt from the stored rows so a comparison always covers every
    requested config. A share is whole GRPO groups, so its advantages equal those of an unsharded
    purify. Python's cyclic garbage collector is paused while it runs (`_cyclic_gc_paused`).
    """
    started = time.monotonic()
    check_whole_batch(request.configs, request.shard)
    warehouse.check_writable()
    warehouse.check_is_warehouse()  # before its lock file would make a run directory look like one
    if backend is None:
        require_backend(request.backend_kind, request.sglang_url)
        check_device(request.device)
    with warehouse.writer("purify", request.iteration, shard_of(request.shard)):  # one writer per iteration (shard)
        return _purify(warehouse, request, backend, progress, started)


def check_whole_batch(configs: Sequence[PurifyConfig], shard: Shard, what: str | None = None) -> None:
    """JobError when a config's advantages need the whole iteration (reinforce_plus_plus_baseline
    whitens over it) and the job sees only a share of it; `what` says who shards (--shard i/N)."""
    needs = next((config for config in configs if config.whole_batch), None)
    if needs is not None and shard.sharded:
        raise JobError(f"{what or f'--shard {shard}'}: adv_estimator {needs.adv_estimator.value} whitens the "
                       "advantages over the whole iteration, which a shard does not see; purify unsharded (one "
                       "process), or use adv_estimator grpo or rloo")


def _check_all_or_none(warehouse: Warehouse, iteration: int, configs: Sequence[PurifyConfig],
                       missing: dict[str, frozenset[str]], ids: frozenset[str]) -> None:
    """JobError when a whole-batch config has rows for part of the iteration (its collection was
    resumed after it was purified): rows added now would be whitened over the new rollouts alone."""
    for config in configs:
        if config.whole_batch and 0 < len(missing[config.config_id]) < len(ids):
            raise JobError(f"{warehouse.root}: iteration {iteration} has rows under purify config "
                           f"{config.config_id} for {len(ids) - len(missing[config.config_id])} of its {len(ids)} "
                           f"rollouts, and adv_estimator {config.adv_estimator.value} whitens over the whole "
                           "iteration: rows added now would be whitened apart; purify the iteration into another "
                           "warehouse, or use adv_estimator grpo or rloo")


def _purify(warehouse: Warehouse, request: PurifyRequest, backend: Backend | None, progress: bool,
            started: float) -> PurifyOutcome:
    """The rest of `purify_job`, under the iteration's (or shard's) purify lock."""
    iteration, configs = request.iteration, request.configs
    check_collected(warehouse, iteration, request.shard)
    check_down_sampling(warehouse, iteration, configs)
    rollouts, segments = _share(warehouse, iteration, request.shard)
    check_stored_values(warehouse, iteration, segments)
    for config in configs:  # rows stored already are results too: one a rollout, in the warehouse's parts
        check_config(warehouse, iteration, config.config_id)
    ids = frozenset(rollout.rollout_id for rollout in rollouts)
    missing = {c.config_id: ids - warehouse.purified_rollout_ids(iteration, c.config_id) for c in configs}
    _check_all_or_none(warehouse, iteration, configs, missing, ids)
    todo = [c for c in configs if missing[c.config_id]]
    computed, scorer_stats = {}, None
    if todo:
        # whole groups, so a group's advantages see all of it; rows already stored are not rewritten
        groups = {r.group_id for r in rollouts if any(r.rollout_id in missing[c.config_id] for c in todo)}
        work = [r for r in rollouts if r.group_id in groups]
        work_ids = {r.rollout_id for r in work}
        load = functools.partial(load_backend, request.backend_kind, collected_policy(warehouse, iteration),
                                 device=request.device, sglang_url=request.sglang_url)
        purified, scorer_stats = _purify_with(warehouse, iteration, backend, load, work,
                                              [s for s in segments if s.rollout_id in work_ids], todo, progress,
                                              request.scorer_memory_gb)
        _store_purified(warehouse, iteration, purified)
        computed = {result.config.config_id: result for result in purified if len(work) == len(rollouts)}
    errors = errors_by_type(segments) if len(computed) < len(configs) else ()  # once, for the stored configs
    results = [computed[config.config_id] if config.config_id in computed
               else _stored_result(warehouse, iteration, config, ids, rollouts, segments, errors) for config in configs]
    return PurifyOutcome(results, [c.config_id for c in todo], scorer_stats, time.monotonic() - started)


def check_collected(warehouse: Warehouse, iteration: int, shard: Shard) -> None:
    """JobError with the gate's finding (warehouse/gate.py) unless the iteration's collection (the
    shard's share of it) has ended, holds every rollout it planned, each once with its segments, in
    parts the warehouse wrote: a purify of what a running or interrupted collection has committed
    so far would train on part of the iteration, and differ from a purify of the whole. An
    iteration an older cleaner collected records no plan: what it planned is read from its collect
    config."""
    check_iteration(warehouse, iteration, share=shard_of(shard), owns=shard.owns)  # Refused: its one line
    saved = warehouse.collect_config(iteration)
    if saved is None or warehouse.plan(iteration) is not None:
        return
    root = warehouse.root
    where = f"iteration {iteration}" + (f" shard {shard}" if shard.sharded else "")
    try:
        config = CollectConfig.from_json(saved)
        planned = {rollout_key(iteration, task.prompt_id, sample)[0] for task in load_tasks(config)
                   if shard.owns(task.prompt_id) for sample in range(config.group_size)}
    except (CleanerError, ValueError, TypeError) as error:  # the dataset moved: completeness cannot be known
        raise JobError(f"{root}: cannot tell whether {where} is complete: the prompts its collection planned "
                       f"cannot be read ({error}); purify where its collect config's paths are readable, so "
                       "the rows cover the whole iteration") from error
    stored = len(warehouse.rollout_ids(iteration) & planned)
    if stored < len(planned):
        raise JobError(f"{root}: {where} holds {stored} of the {len(planned)} rollouts its collection planned: it "
                       f"was interrupted; finish it with `cleaner collect --iteration {iteration} --resume` (and "
                       "its other options) before purifying, so the rows cover the whole iteration")


def check_down_sampling(warehouse: Warehouse, iteration: int, configs: Sequence[PurifyConfig]) -> None:
    """JobError unless every down-sampling config keeps fewer rows than the iteration's groups hold:
    at the group's size or above there is nothing to choose (GRPO-RoC collects 2N to keep N)."""
    saved = warehouse.collect_config(iteration)
    wanted = [config for config in configs if config.down_sample_to is not None]
    if saved is None or not wanted:
        return
    group_size = CollectConfig.from_json(saved).group_size
    too_large = next((config for config in wanted if config.down_sample_to >= group_size), None)
    if too_large is not None:
        raise JobError(f"invalid option: --down-sample-to {too_large.down_sample_to} must be smaller than iteration "
                       f"{iteration}'s group size ({group_size}): nothing to choose; collect larger groups "
                       f"(--group-size {2 * too_large.down_sample_to}, as GRPO-RoC collects 2N to keep N)")


def check_stored_values(warehouse: Warehouse, iteration: int, segments: Sequence[Segment]) -> None:
    """JobError, naming the rollouts, when stored segments hold what no policy produced (ids past
    the collecting policy's vocabulary, behaviour log-probs that are not finite or above 0): an
    older cleaner stored engines' answers unchecked (docs/architecture.md §5)."""
    faults = stored_value_faults(segments, vocab_size_of(collected_policy(warehouse, iteration)))
    if faults:
        raise JobError(f"{warehouse.root}: iteration {iteration}: {refusal(faults, 'tokens or log-probs')}; an "
                       "older cleaner stored its engine's answers unchecked: collect the iteration again (into "
                       "another warehouse or --iteration) before purifying")


def _stored_result(warehouse: Warehouse, iteration: int, config: PurifyConfig, ids: frozenset[str],
                   rollouts: list[Rollout], segments: list[Segment],
                   errors: tuple[tuple[str, int], ...]) -> PurifyResult:
    """A config's result over these rollouts (`ids`), rebuilt from its stored rows; `errors` is
    errors_by_type(segments)."""
    rows = warehouse.read_purified(iteration, config.config_id, ids)
    premise = iteration_premise(rollouts, segments, rows)
    masked = masked_tokens(rows, segments) if config.edit == Edit.MASK else 0
    stats = stats_from_rows(config.config_id, rows, errors, premise, masked)
    return PurifyResult(config, rows, stats)


@dataclass(frozen=True)
class StoredIteration:
    summary: CollectSummary  # over every rollout of the iteration, whichever shard wrote it
    result: PurifyResult  # the config's rows and stats over every rollout


def stored_iteration(warehouse: Warehouse, iteration: int, config: PurifyConfig) -> StoredIteration:
    """An iteration whose shards have all been collected and purified under `config`, read back
    whole: what one unsharded collect and purify would have reported."""
    rollouts, segments = _share(warehouse, iteration, UNSHARDED)
    ids = frozenset(r.rollout_id for r in rollouts)
    unpurified = ids - warehouse.purified_rollout_ids(iteration, config.config_id)
    if unpurified:
        raise JobError(f"{warehouse.root}: {len(unpurified)} rollouts of iteration {iteration} have no rows "
                       f"under purify config {config.config_id}; purify every shard first")
    return StoredIteration(summarize(rollouts, segments),
                           _stored_result(warehouse, iteration, config, ids, rollouts, segments, errors_by_type(segments)))


def _purify_with(warehouse: Warehouse, iteration: int, backend: Backend | None, load: Callable[[], Backend],
                 rollouts: list[Rollout], segments: list[Segment], configs: list[PurifyConfig],
                 progress: bool, scorer_memory_gb: float | None = None) -> tuple[list[PurifyResult], ScorerStats]:
    """Render and score the rollouts under the configs with the collecting policy's scorer."""
    policy = collected_policy(warehouse, iteration)
    if backend is not None and Path(backend.model_path).resolve() != Path(policy).resolve():  # one stored resolved
        raise JobError(f"iteration {iteration} was collected by {policy}, but the backend serves "
                       f"{backend.model_path}; purify scores with the policy that collected")
    with serving_backend(backend, load) as serving:
        memory = None if scorer_memory_gb is None else int(scorer_memory_gb * 1e9)
        scorer = serving.scorer(progress=progress, **({"memory_bytes": memory} if memory is not None else {}))
        decode = ChatFormat(serving.tokenizer).decode
        purified = purify_iteration(rollouts, segments, configs, scorer, decode,
                                    scorer_version=f"{scorer.version}:{serving.policy_version}")
    faults = row_value_faults((row for result in purified for row in result.rows), vocab_size_of(policy))
    if faults:  # nothing is stored: a NaN old log-prob would train as one
        raise JobError(f"{warehouse.root}: iteration {iteration}: the scorer of {policy} gave "
                       f"{refusal(faults, 'rows')}; score with a checkpoint whose forward is finite")
    return purified, scorer.stats


def _share(warehouse: Warehouse, iteration: int, shard: Shard) -> tuple[list[Rollout], list[Segment]]:
    """The rollouts of an iteration in the shard's share, and their segments."""
    rollouts = warehouse.read_rollouts(iteration)
    if not rollouts:
        raise JobError(f"{warehouse.root}: iteration {iteration} has no rollouts; run `cleaner collect` first")
    rollouts = [rollout for rollout in rollouts if shard.owns(rollout.prompt_id)]
    if not rollouts:
        raise JobError(f"{warehouse.root}: shard {shard} of iteration {iteration} holds no rollouts "
                       "(more shards than prompts?)")
    return rollouts, warehouse.read_segments(iteration, {rollout.rollout_id for rollout in rollouts})


def _store_purified(warehouse: Warehouse, iteration: int, results: Sequence[PurifyResult]) -> None:
    """The rows of every config in one write, then each config's resolved parameters as JSON."""
    configs = [(result.config, result.config.to_json()) for result in results]
    warehouse.write_purified_many(iteration, [
        (PurifyConfigRow(config_id=config.config_id, gamma=config.gamma, rollback_prob=config.rollback_prob,
                         similarity_on=config.similarity_on, purify_when=config.purify_when, params_json=params,
                         edit=config.edit),
         result.rows)
        for (config, params), result in zip(configs, results, strict=True)
    ])
    for config, params in configs:
        warehouse.save_config(f"purify-iteration={iteration}-config={config.config_id}", params)
