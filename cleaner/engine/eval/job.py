"""The eval job: models on benchmark files, with and without SAAR at test time (docs/architecture.md §12).

As collect, per evaluation: an evaluation is complete once its `eval_runs` row exists, and running
it again continues an interrupted one (no flag needed: its id is its whole config).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cleaner.config import CollectConfig, EvalConfig
from cleaner.engine.collect.datasets import load_dataset
from cleaner.engine.collect.job import UserCode
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import Task
from cleaner.engine.eval.metrics import eval_metrics
from cleaner.engine.eval.plan import EvalPlan, eval_plans, eval_run_row
from cleaner.engine.grading.programs import Grader
from cleaner.engine.model import Backend, load_backend, require_backend, serving_backend
from cleaner.engine.model.base import SamplingParams
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.loading import check_device, check_model_path
from cleaner.errors import JobError
from cleaner.records import EvalRunRow
from cleaner.sandbox import make_sandbox
from cleaner.warehouse import Warehouse


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
    loaded backend to use instead of loading it. The config is the job's request (the shape every
    stage's job has, collect/job.py): it holds all the job computes, so no request wraps it.
    """
    started, backends = time.monotonic(), dict(backends or {})
    warehouse.check_writable()
    if any(model not in backends for model in config.models):  # fail before anything is written
        require_backend(config.backend, config.sglang_url)
    check_device(config.device)
    for model in config.models:
        if model not in backends:
            check_model_path(model, tokenizer=True)
    user = UserCode.load(config)
    try:
        datasets = [(name, load_dataset(path, config.prompt_style, config.limit, tools=config.multi_turn))
                    for name, path in config.datasets]
        for _, loaded in datasets:
            if not loaded.tasks:
                raise JobError(f"{loaded.path}: the dataset has no rows")
        plans = [_as_stored(warehouse, plan) for plan in eval_plans(config, datasets)]
        todo = [plan for plan in plans if warehouse.read_eval_run(plan.eval_id) is None]
        if todo:
            tasks = [task for _, loaded in datasets for task in loaded.tasks]
            with make_sandbox(config.sandbox) as sandbox, user.grading(tasks, config) as grader:
                for model in dict.fromkeys(plan.model for plan in todo):  # one model served at a time
                    load = functools.partial(load_backend, config.backend, model, device=config.device,
                                             sglang_url=config.sglang_url,
                                             deterministic=config.deterministic_inference,
                                             mem_fraction=config.sglang_mem_fraction,
                                             request_timeout_s=config.sglang_request_timeout_s)
                    with serving_backend(backends.get(model), load) as serving:
                        if serving.tokenizer is None:
                            raise JobError(f"model {model!r} has no tokenizer files; eval needs its tokenizer "
                                           "for the chat format")
                        _warm_up(serving, sandbox, tasks[0])
                        for model_plan in [plan for plan in todo if plan.model == model]:
                            _evaluate(warehouse, model_plan, serving, sandbox, grader, progress, user)
    finally:
        user.toolbox.close()
    rows = [warehouse.read_eval_run(plan.eval_id) for plan in plans]
    return EvalOutcome(rows, [plan.eval_id for plan in todo], time.monotonic() - started)


def _as_stored(warehouse: Warehouse, plan: EvalPlan) -> EvalPlan:
    """The plan under the id its complete evaluation is stored by, if that is another."""
    stored = stored_evaluation(warehouse, plan.collect_config)
    return plan if stored in (None, plan.eval_id) else dataclasses.replace(plan, stored_id=stored)


def stored_evaluation(warehouse: Warehouse, config: CollectConfig) -> str | None:
    """The id a complete evaluation of `config` is stored under: its own, or in a warehouse of
    format 1 (warehouse/format.py), one an earlier version gave it, found as a stored config whose
    id now is this one's; None if none is stored."""
    if warehouse.read_eval_run(config.config_id) is not None:
        return config.config_id
    if warehouse.format_version() > 1:
        return None
    return next((stored for stored in warehouse.eval_config_ids() if warehouse.read_eval_run(stored) is not None
                 and _id_now(warehouse.eval_config(stored)) == config.config_id), None)


def _id_now(saved_json: str | None) -> str | None:
    """The id this version gives a stored collect config (None: one it refuses)."""
    try:
        return CollectConfig.from_json(saved_json).config_id if saved_json is not None else None
    except ValueError:
        return None


def _warm_up(backend: Backend, sandbox, task: Task) -> None:
    """A few tokens and one tool call before anything is timed: the first forward passes and the
    sandbox's first fork are slower, and would count against whichever setting runs first."""
    chat = ChatFormat(backend.tokenizer)
    backend.generate([chat.prompt_ids(task.messages)], SamplingParams(8, tuple(chat.stop_token_ids)), [0])
    sandbox.run_many(["print(1)"])


def _evaluate(warehouse: Warehouse, plan: EvalPlan, backend: Backend, sandbox, grader: Grader,
              progress: bool, user: UserCode) -> None:
    """Generate an evaluation's missing rollouts, committed in parts as they finish, then write its
    eval_runs row."""
    config, eval_id = plan.collect_config, plan.eval_id
    warehouse.save_eval_config(eval_id, config.to_json())
    stored = warehouse.eval_rollout_ids(eval_id)
    started = time.monotonic()
    def write(batch) -> None:  # on the collection's writer thread
        warehouse.write_eval_batch(eval_id, batch.rollouts, batch.segments)

    generated = collect(plan.data.tasks, config, backend, sandbox, user.chat(backend.tokenizer), write=write,
                        reward_fn=grader, skip_rollout_ids=stored, progress=progress,
                        rollout_prefix=plan.rollout_prefix, strict_context=False, toolbox=user.toolbox,
                        reward_file=user.reward).n_rollouts
    seconds = time.monotonic() - started
    rollouts = warehouse.read_eval_rollouts(eval_id)
    metrics = eval_metrics(rollouts, warehouse.read_eval_segments(eval_id), config.group_size)
    warehouse.write_eval_run(eval_run_row(plan, metrics, rollouts[0].policy_version, seconds, generated))
