"""Jobs: each phase of an iteration as one function over a Warehouse.

The engine stages are pure (records in, records out); a job loads its inputs from the warehouse,
calls the stage, and writes the outputs back, together with the resolved config as JSON. The CLI
calls exactly one job per command, and `run_loop` chains them in each process of a run so the model
is loaded once per device and handed from phase to phase.

Idempotence and resume, phase by phase:
- collect: batches of complete rollouts are committed atomically; `resume` skips committed ids.
- purify: a rollout that already has rows under a config is skipped (whole groups are written
  together), so each shard of an iteration resumes on its own.
- train: the checkpoint is swapped in atomically, then its train_steps are written; an iteration
  is complete once its `iterations` row exists.
- eval: as collect, per evaluation; an evaluation is complete once its `eval_runs` row exists, and
  running it again continues an interrupted one (no flag needed: its id is its whole config).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cleaner.config import (
    UNSHARDED,
    CollectConfig,
    Edit,
    EvalConfig,
    PurifyConfig,
    Shard,
    TrainConfig,
)
from cleaner.engine.collect.datasets import load_dataset
from cleaner.engine.collect.loop import collect, rollout_key
from cleaner.engine.collect.summary import CollectSummary, summarize
from cleaner.engine.collect.tasks import Task, toy_tasks
from cleaner.engine.eval.metrics import eval_metrics
from cleaner.engine.eval.plan import EvalPlan, eval_plans, eval_run_row
from cleaner.engine.grading.programs import Grader, grading_sandbox_config, is_code_source
from cleaner.engine.model import Backend, load_backend, require_backend
from cleaner.engine.model.base import SamplingParams, ScorerStats
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.loading import check_device, check_model_path
from cleaner.engine.purify.pipeline import (
    PurifyResult,
    errors_by_type,
    iteration_premise,
    masked_tokens,
    purify_iteration,
    stats_from_rows,
)
from cleaner.engine.train.deepspeed_config import check_deepspeed_setup
from cleaner.engine.train.optim import Optimization
from cleaner.engine.train.trainer import TrainResult, train_iteration
from cleaner.errors import CleanerError
from cleaner.outputs import CHECKPOINT, check_replaceable
from cleaner.records import EvalRunRow, PurifiedRow, PurifyConfigRow, Rollout, Segment
from cleaner.sandbox import SandboxConfig, make_sandbox
from cleaner.warehouse import Warehouse, WarehouseError

logger = logging.getLogger(__name__)


class JobError(CleanerError):
    """A job cannot start or finish; the message says why and what to do."""


@contextlib.contextmanager
def _serving(backend: Backend | None, load: Callable[[], Backend]) -> Iterator[Backend]:
    """The caller's backend, or one loaded for this job and closed when it ends."""
    if backend is not None:
        yield backend
        return
    loaded = load()
    try:
        yield loaded
    finally:
        loaded.close()


# ---------------------------------------------------------------------------------------------
# Collect


@dataclass(frozen=True)
class CollectOutcome:
    iteration: int
    n_planned: int  # rollouts the iteration (the shard's share of it) should hold
    n_written: int  # rollouts written by this call (less than planned on resume)
    summary: CollectSummary  # over the whole iteration (the shard's share of it)
    seconds: float


def iteration_seed(config: CollectConfig) -> int:
    """A 32-bit seed of (seed, iteration): the toy tasks' and an SGLang engine's random seed."""
    return int.from_bytes(hashlib.sha256(f"{config.seed}:{config.iteration}".encode()).digest()[:4], "big")


def load_tasks(config: CollectConfig) -> list[Task]:
    """The iteration's prompts: toy tasks seeded by (seed, iteration), or a slice of the dataset."""
    if config.data is None:
        return toy_tasks(config.n_prompts, seed=iteration_seed(config))
    tasks = load_dataset(config.data, config.prompt_style).tasks  # DatasetError names file and row
    if not tasks:
        raise JobError(f"{config.data}: the dataset has no rows")
    start = (config.iteration * config.n_prompts) % len(tasks)
    return [tasks[(start + i) % len(tasks)] for i in range(min(config.n_prompts, len(tasks)))]


def collect_job(warehouse: Warehouse, config: CollectConfig, *, resume: bool = False, shard: Shard = UNSHARDED,
                backend: Backend | None = None, progress: bool = True) -> CollectOutcome:
    """Collect one iteration, or one shard's share of it, into the warehouse; with `resume`,
    finish a partly collected one."""
    started = time.monotonic()
    warehouse.check_writable()
    if backend is None:  # fail on a bad backend, model or device before anything is written
        require_backend(config.backend, config.sglang_url)
        check_device(config.device)
        check_model_path(config.model, tokenizer=True)
    iteration = config.iteration
    tasks = [task for task in load_tasks(config) if shard.owns(task.prompt_id)]
    planned = frozenset(rollout_key(iteration, task.prompt_id, sample)[0]
                        for task in tasks for sample in range(config.group_size))
    stored_anywhere = warehouse.rollout_ids(iteration)
    stored = stored_anywhere & planned  # this share's; other shards' rollouts are theirs to resume
    where = f"iteration {iteration}" + (f" shard {shard}" if shard.sharded else "")
    if stored and not resume:
        raise JobError(
            f"{warehouse.root}: {where} already holds {len(stored)} rollouts; "
            "pass --resume to finish it, or collect another --iteration"
        )
    _check_saved_config(warehouse, config, resume or bool(stored_anywhere))
    n_written = 0
    if len(stored) < len(planned):
        load = functools.partial(load_backend, config.backend, config.model, device=config.device,
                                 sglang_url=config.sglang_url, seed=iteration_seed(config))
        with _serving(backend, load) as serving:
            if serving.tokenizer is None:
                raise JobError(f"model {config.model!r} has no tokenizer files; collect needs its "
                               "tokenizer for the chat format")
            warehouse.save_collect_config(iteration, config.to_json())  # the model loaded: the first write
            chat = ChatFormat(serving.tokenizer)
            grading = _grader(tasks, config.sandbox, config.test_timeout_s)
            with make_sandbox(config.sandbox) as sandbox, grading as grader:
                for batch in collect(tasks, config, serving, sandbox, chat, reward_fn=grader,
                                     skip_rollout_ids=stored, progress=progress):
                    warehouse.write_rollouts(iteration, batch.rollouts, batch.segments)
                    n_written += len(batch.rollouts)
    rollouts = [r for r in warehouse.read_rollouts(iteration) if r.rollout_id in planned]
    summary = summarize(rollouts, warehouse.read_segments(iteration, planned))
    return CollectOutcome(iteration, len(planned), n_written, summary, time.monotonic() - started)


def _check_saved_config(warehouse: Warehouse, config: CollectConfig, must_match: bool) -> None:
    """An iteration holds the rollouts of one config: resuming it, or adding a shard to rollouts
    that are already there, needs the config it was started with."""
    saved = warehouse.collect_config(config.iteration)
    if must_match and saved is not None and json.loads(saved) != json.loads(config.to_json()):
        raise JobError(f"iteration {config.iteration} was collected with another config; "
                       "resuming it or collecting another shard of it needs the same options")


@contextlib.contextmanager
def _grader(tasks: Sequence[Task], tool: SandboxConfig, test_timeout_s: float) -> Iterator[Grader]:
    """The reward function of these tasks; a grading sandbox runs only if a task is a program."""
    if not any(is_code_source(task.data_source) for task in tasks):
        yield Grader()
        return
    try:
        grading = grading_sandbox_config(tool, test_timeout_s, tasks)
    except ValueError as error:
        raise JobError(f"a code task's ground truth is not stdin/stdout tests: {error}") from error
    with make_sandbox(grading) as sandbox:
        yield Grader(sandbox)


def collected_policy(warehouse: Warehouse, iteration: int) -> str:
    """The policy that collected an iteration, from its saved collect config."""
    saved = warehouse.collect_config(iteration)
    if saved is None:
        raise JobError(f"{warehouse.root}: iteration {iteration} has no collect config; was it collected?")
    return json.loads(saved)["model"]


# ---------------------------------------------------------------------------------------------
# Evaluate


@dataclass(frozen=True)
class EvalOutcome:
    rows: list[EvalRunRow]  # one per (model, dataset, SAAR setting), in that order
    computed: list[str]  # eval ids completed by this call (the others were already stored)
    seconds: float


def eval_job(warehouse: Warehouse, config: EvalConfig, *, backends: Mapping[str, Backend] | None = None,
             progress: bool = True) -> EvalOutcome:
    """Evaluate every model on every dataset under every SAAR setting; store rollouts and metrics.

    An evaluation whose `eval_runs` row exists is not run again; one with committed rollouts but no
    row (it was interrupted) generates only the rollouts it lacks. `backends` maps a model to a
    loaded backend to use instead of loading it.
    """
    started, backends = time.monotonic(), dict(backends or {})
    warehouse.check_writable()
    if any(model not in backends for model in config.models):  # fail before anything is written
        require_backend(config.backend, config.sglang_url)
    check_device(config.device)
    for model in config.models:
        if model not in backends:
            check_model_path(model, tokenizer=True)
    datasets = [(name, load_dataset(path, config.prompt_style, config.limit)) for name, path in config.datasets]
    for _, loaded in datasets:
        if not loaded.tasks:
            raise JobError(f"{loaded.path}: the dataset has no rows")
    plans = eval_plans(config, datasets)
    todo = [plan for plan in plans if warehouse.read_eval_run(plan.eval_id) is None]
    if todo:
        tasks = [task for _, loaded in datasets for task in loaded.tasks]
        grading = _grader(tasks, config.sandbox, config.test_timeout_s)
        with make_sandbox(config.sandbox) as sandbox, grading as grader:
            for model in dict.fromkeys(plan.model for plan in todo):  # one model served at a time
                load = functools.partial(load_backend, config.backend, model, device=config.device,
                                         sglang_url=config.sglang_url)
                with _serving(backends.get(model), load) as serving:
                    if serving.tokenizer is None:
                        raise JobError(f"model {model!r} has no tokenizer files; eval needs its tokenizer "
                                       "for the chat format")
                    _warm_up(serving, sandbox, tasks[0])
                    for model_plan in [plan for plan in todo if plan.model == model]:
                        _evaluate(warehouse, model_plan, serving, sandbox, grader, progress)
    rows = [warehouse.read_eval_run(plan.eval_id) for plan in plans]
    return EvalOutcome(rows, [plan.eval_id for plan in todo], time.monotonic() - started)


def _warm_up(backend: Backend, sandbox, task: Task) -> None:
    """A few tokens and one tool call before anything is timed: the first forward passes and the
    sandbox's first fork are slower, and would count against whichever setting runs first."""
    chat = ChatFormat(backend.tokenizer)
    backend.generate([chat.prompt_ids(task.messages)], SamplingParams(8, tuple(chat.stop_token_ids)), [0])
    sandbox.run_many(["print(1)"])


def _evaluate(warehouse: Warehouse, plan: EvalPlan, backend: Backend, sandbox, grader: Grader,
              progress: bool) -> None:
    """Generate an evaluation's missing rollouts in committed batches, then write its eval_runs row."""
    config, eval_id = plan.collect_config, plan.eval_id
    warehouse.save_eval_config(eval_id, config.to_json())
    stored = warehouse.eval_rollout_ids(eval_id)
    started, generated = time.monotonic(), 0
    for batch in collect(plan.data.tasks, config, backend, sandbox, ChatFormat(backend.tokenizer),
                         reward_fn=grader, skip_rollout_ids=stored, progress=progress,
                         rollout_prefix=plan.rollout_prefix, strict_context=False):
        warehouse.write_eval_batch(eval_id, batch.rollouts, batch.segments)
        generated += len(batch.rollouts)
    seconds = time.monotonic() - started
    rollouts = warehouse.read_eval_rollouts(eval_id)
    metrics = eval_metrics(rollouts, warehouse.read_eval_segments(eval_id), config.group_size)
    warehouse.write_eval_run(eval_run_row(plan, metrics, rollouts[0].policy_version, seconds, generated))


# ---------------------------------------------------------------------------------------------
# Purify


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
def purify_job(warehouse: Warehouse, iteration: int, configs: Sequence[PurifyConfig], *, shard: Shard = UNSHARDED,
               backend: Backend | None = None, backend_kind: str = "torch", sglang_url: str | None = None,
               device: str = "cpu", progress: bool = True) -> PurifyOutcome:
    """Purify an iteration, or one shard's share of it, under every config in ONE scorer pass,
    and store the rows.

    The rows are scored by the scorer of `backend`, which must serve the policy that collected the
    iteration; without one, a `backend_kind` backend (at `sglang_url`, if given) is loaded with that
    policy. Rollouts that already have rows under a config are not recomputed (idempotent per
    rollout, so each shard resumes on its own); results are rebuilt from the stored rows so a
    comparison always covers every requested config. A share is whole GRPO groups, so its
    advantages equal those of an unsharded purify. Python's cyclic garbage collector is paused
    while it runs (`_cyclic_gc_paused`).
    """
    started = time.monotonic()
    warehouse.check_writable()
    if backend is None:
        require_backend(backend_kind, sglang_url)
        check_device(device)
    rollouts, segments = _share(warehouse, iteration, shard)
    ids = frozenset(rollout.rollout_id for rollout in rollouts)
    missing = {c.config_id: ids - warehouse.purified_rollout_ids(iteration, c.config_id) for c in configs}
    todo = [c for c in configs if missing[c.config_id]]
    computed, scorer_stats = {}, None
    if todo:
        # whole groups, so a group's advantages see all of it; rows already stored are not rewritten
        groups = {r.group_id for r in rollouts if any(r.rollout_id in missing[c.config_id] for c in todo)}
        work = [r for r in rollouts if r.group_id in groups]
        work_ids = {r.rollout_id for r in work}
        load = functools.partial(load_backend, backend_kind, collected_policy(warehouse, iteration),
                                 device=device, sglang_url=sglang_url)
        purified, scorer_stats = _purify_with(warehouse, iteration, backend, load, work,
                                              [s for s in segments if s.rollout_id in work_ids], todo, progress)
        _store_purified(warehouse, iteration, purified)
        computed = {result.config.config_id: result for result in purified if len(work) == len(rollouts)}
    results = [computed[config.config_id] if config.config_id in computed
               else _stored_result(warehouse, iteration, config, rollouts, segments) for config in configs]
    return PurifyOutcome(results, [c.config_id for c in todo], scorer_stats, time.monotonic() - started)


def _stored_result(warehouse: Warehouse, iteration: int, config: PurifyConfig, rollouts: list[Rollout],
                   segments: list[Segment]) -> PurifyResult:
    """A config's result over these rollouts, rebuilt from its stored rows."""
    rows = warehouse.read_purified(iteration, config.config_id, {rollout.rollout_id for rollout in rollouts})
    premise = iteration_premise(rollouts, segments, rows)
    masked = masked_tokens(rows, segments) if config.edit == Edit.MASK else 0
    stats = stats_from_rows(config.config_id, rows, errors_by_type(segments), premise, masked)
    return PurifyResult(config, rows, stats)


@dataclass(frozen=True)
class StoredIteration:
    summary: CollectSummary  # over every rollout of the iteration, whichever shard wrote it
    result: PurifyResult  # the config's rows and stats over every rollout


def stored_iteration(warehouse: Warehouse, iteration: int, config: PurifyConfig) -> StoredIteration:
    """An iteration whose shards have all been collected and purified under `config`, read back
    whole: what one unsharded collect and purify would have reported."""
    rollouts, segments = _share(warehouse, iteration, UNSHARDED)
    unpurified = {r.rollout_id for r in rollouts} - warehouse.purified_rollout_ids(iteration, config.config_id)
    if unpurified:
        raise JobError(f"{warehouse.root}: {len(unpurified)} rollouts of iteration {iteration} have no rows "
                       f"under purify config {config.config_id}; purify every shard first")
    return StoredIteration(summarize(rollouts, segments),
                           _stored_result(warehouse, iteration, config, rollouts, segments))


def _purify_with(warehouse: Warehouse, iteration: int, backend: Backend | None, load: Callable[[], Backend],
                 rollouts: list[Rollout], segments: list[Segment], configs: list[PurifyConfig],
                 progress: bool) -> tuple[list[PurifyResult], ScorerStats]:
    """Render and score the rollouts under the configs with the collecting policy's scorer."""
    policy = collected_policy(warehouse, iteration)
    if backend is not None and Path(backend.model_path) != Path(policy):
        raise JobError(f"iteration {iteration} was collected by {policy}, but the backend serves "
                       f"{backend.model_path}; purify scores with the policy that collected")
    with _serving(backend, load) as serving:
        scorer = serving.scorer(progress=progress)
        decode = ChatFormat(serving.tokenizer).decode
        purified = purify_iteration(rollouts, segments, configs, scorer, decode,
                                    scorer_version=f"{scorer.version}:{serving.policy_version}")
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


# ---------------------------------------------------------------------------------------------
# Train


@dataclass(frozen=True)
class TrainOutcome:
    result: TrainResult  # the checkpoint, the step rows, the trained model and its optimiser
    seconds: float


def train_job(warehouse: Warehouse, iteration: int, config_id: str, policy: str | Path, out: str | Path,
              config: TrainConfig, *, model=None, rows: Sequence[PurifiedRow] | None = None,
              optimization: Optimization | None = None, progress: bool = True) -> TrainOutcome:
    """Train on one purified config of an iteration; write the checkpoint and the step metrics.

    `rows` are that config's purified rows when the caller has already read them; `optimization`
    is the run's optimiser bound to `model` (without it, the one saved with `policy` is resumed).
    """
    started = time.monotonic()
    check_replaceable(out, CHECKPOINT)  # before any training: `out` must be absent or a checkpoint
    warehouse.check_writable()
    check_device(config.device)
    if config.engine == "deepspeed":
        check_deepspeed_setup(config)
    if model is None:
        check_model_path(policy)
    if rows is None:
        config_id = warehouse.resolve_config_id(config_id)  # a unique prefix, as purify prints it
        try:
            rows = warehouse.read_purified(iteration, config_id)
        except WarehouseError as exc:
            raise JobError(f"{exc}; run `cleaner purify` first") from exc
    result = train_iteration(rows, policy, out, config, iteration, model=model, progress=progress,
                             optimization=optimization)
    if result.main_process:  # DeepSpeed's ranks all train; one writes, so each step is one row
        warehouse.write_train_steps(iteration, result.steps)
        warehouse.save_config(f"train-iteration={iteration}", config.to_json())
    return TrainOutcome(result, time.monotonic() - started)
