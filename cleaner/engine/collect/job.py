"""The collect job: one iteration's rollouts into the warehouse (docs/architecture.md §5).

A job loads its inputs from the warehouse, calls the stage (the agent loop: agent.py), and writes the
outputs back, together with the resolved config as JSON. Every stage's job has one shape,
`<stage>_job(warehouse, request, *, <runtime handles>) -> <Stage>Outcome`: the request (a frozen
dataclass) is what the job computes, the keyword-only handles what the caller already holds (a
loaded backend or model, rows read) and whether to show progress. The CLI builds one request from
its flags and calls one job per command; `cleaner run` (cleaner/loop/) builds the same requests and
chains the stages' jobs in each process of a run, handing the loaded model from stage to stage.

Idempotence and resume: parts of finished rollouts are committed atomically as they finish;
`resume` skips committed ids, and may schedule differently (the schedule is not the config's identity). One writer per iteration (or shard of it): the job holds the warehouse's collect
lock of the iteration from before it reads what is stored (cleaner.warehouse.lock), so a second
collect of it is refused at once instead of storing every rollout twice.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass

from cleaner.config import UNSHARDED, CollectConfig, Shard
from cleaner.config.flags import RENAMED, option_of
from cleaner.engine.collect.agent import rollout_key
from cleaner.engine.collect.datasets import load_dataset
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.summary import CollectSummary, summarize
from cleaner.engine.collect.tasks import Task, toy_tasks
from cleaner.engine.grading.programs import Grader, grader_for, is_code_source
from cleaner.engine.grading.reward_file import RewardFunction
from cleaner.engine.model import Backend, load_backend, require_backend, serving_backend
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.loading import check_device, check_model_path
from cleaner.errors import JobError
from cleaner.sandbox import make_sandbox
from cleaner.tools import Toolbox, load_tools
from cleaner.warehouse import Warehouse
from cleaner.warehouse.configs import CollectPlan
from cleaner.warehouse.gate import drop_lost, inspect_iteration
from cleaner.warehouse.queries import last_groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectRequest:
    """What a collect job computes."""

    config: CollectConfig  # the iteration to collect (config.iteration) and how
    shard: Shard = UNSHARDED  # the share of the iteration's prompts to collect
    resume: bool = False  # finish a partly collected iteration; off: its stored rollouts are an error


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
    tasks = _dataset_tasks(config)
    start = (config.iteration * config.n_prompts) % len(tasks)
    return [tasks[(start + i) % len(tasks)] for i in range(min(config.n_prompts, len(tasks)))]


def _dataset_tasks(config: CollectConfig) -> list[Task]:
    tasks = load_dataset(config.data, config.prompt_style, tools=config.multi_turn).tasks  # DatasetError names file and row
    if not tasks:
        raise JobError(f"{config.data}: the dataset has no rows")
    return tasks


# ---------------------------------------------------------------------------------------------
# The iteration's plan: its prompts, chosen from the warehouse with skip_settled_prompts


def iteration_tasks(warehouse: Warehouse, config: CollectConfig) -> tuple[list[Task], CollectPlan]:
    """The iteration's prompts and the plan collect records before its first rollout (the readers'
    gate counts the iteration against it). With skip_settled_prompts, the dataset is walked on from
    where the previous iteration stopped, passing over the prompts whose last group (before this
    iteration) was settled within the last skip_settled_prompts iterations (-1: any), and a plan
    recorded already is read back, so a resume and every shard take the same prompts. Without it:
    `load_tasks`."""
    if config.skip_settled_prompts == 0:
        tasks = load_tasks(config)
        return tasks, CollectPlan(tuple(task.prompt_id for task in tasks), config.group_size)
    tasks = _dataset_tasks(config)
    by_id = {task.prompt_id: task for task in tasks}
    plan = warehouse.plan(config.iteration) or _plan_prompts(warehouse, config, tasks)
    missing = [prompt_id for prompt_id in plan.prompt_ids if prompt_id not in by_id]
    if missing:
        raise JobError(f"{config.data}: iteration {config.iteration} recorded prompts the dataset no longer "
                       f"holds ({', '.join(missing[:5])}); collect it with the dataset it started with")
    return [by_id[prompt_id] for prompt_id in plan.prompt_ids], plan


def _last_groups(warehouse: Warehouse, iteration: int) -> dict:
    """`queries.last_groups` of the iterations before this one; none in a warehouse not yet written."""
    if not warehouse.root.is_dir():
        return {}
    connection = warehouse.connect()
    try:
        return last_groups(connection, iteration)
    finally:
        connection.close()


def _plan_prompts(warehouse: Warehouse, config: CollectConfig, tasks: list[Task]) -> CollectPlan:
    """The prompts an iteration takes, and where the next one starts (module notes: iteration_tasks)."""
    iteration, window = config.iteration, config.skip_settled_prompts
    previous = warehouse.plan(iteration - 1) if iteration > 0 else None
    start = previous.next_row if previous and previous.next_row is not None else (
        iteration * config.n_prompts) % len(tasks)
    last = _last_groups(warehouse, iteration)
    chosen, skipped, position = [], [], start
    while len(chosen) < min(config.n_prompts, len(tasks)) and position < start + len(tasks):
        task = tasks[position % len(tasks)]
        position += 1
        group = last.get(task.prompt_id)
        if group is not None and group.settled and (window == -1 or iteration - group.iteration <= window):
            skipped.append((task.prompt_id, group.iteration))
        else:
            chosen.append(task.prompt_id)
    if not chosen:
        raise JobError(f"{config.data}: every prompt's last group was settled (all correct or all wrong) within "
                       f"--skip-settled-prompts {window}: nothing is left to collect at iteration {iteration}")
    if len(chosen) < config.n_prompts:
        logger.warning("iteration %d: %d of the dataset's prompts are settled; collecting the %d others",
                       iteration, len(skipped), len(chosen))
    return CollectPlan(tuple(chosen), config.group_size, position % len(tasks), tuple(skipped))


@dataclass(frozen=True)
class UserCode:
    """The user's tools and reward function of a collection (cleaner/tools.py, grading/reward_file.py)."""

    toolbox: Toolbox  # the user's tools (none: the code interpreter alone)
    reward: RewardFunction | None  # None: the built-in grader
    multi_turn: bool = True  # off: the no-tool baseline, a template without tools, one generation

    @classmethod
    def load(cls, config) -> UserCode:
        """Import a collect or eval config's tools and reward function: every problem is one error
        line, before any model is loaded."""
        toolbox = Toolbox(load_tools(config.tools, config.tool), config.sandbox.timeout_s,
                          config.sandbox.max_output_chars)
        return cls(toolbox, RewardFunction.load(config.reward_fn) if config.reward_fn else None,
                   config.multi_turn)

    def chat(self, tokenizer) -> ChatFormat:
        """The chat format whose template shows every tool (none for the no-tool baseline, whose
        calls the agent loop then never runs)."""
        return ChatFormat(tokenizer, self.toolbox.schemas if self.multi_turn else ())

    def grading(self, tasks: list[Task], config):
        """The built-in grader's context (a grading sandbox for code tasks); none with a reward function."""
        if self.reward is not None:
            return contextlib.nullcontext(Grader())
        def struct(truth: object) -> bool:  # a dict, or a list whose first answer (the grader's) is one
            return isinstance(truth, dict) or isinstance(truth, list) and isinstance(truth[0], dict)

        unfit = next((task for task in tasks if struct(task.truth) and not is_code_source(task.data_source)), None)
        if unfit is not None:
            raise JobError(f"{unfit.prompt_id} (row {unfit.source_row}): its ground truth is a struct, which the "
                           "built-in grader cannot compare an answer with; give a reward function that reads it "
                           "(--reward-fn PATH.py:NAME, docs/byo-task.md#the-references-reward-file)")
        return grader_for(tasks, config.sandbox, config.test_timeout_s)


def collect_job(warehouse: Warehouse, request: CollectRequest, *, backend: Backend | None = None,
                progress: bool = True) -> CollectOutcome:
    """Collect one iteration, or one shard's share of it, into the warehouse; with `resume`,
    finish a partly collected one. The policy is `backend`'s, or loaded as the config says."""
    config, shard = request.config, request.shard
    started = time.monotonic()
    warehouse.check_writable()
    if backend is None:  # fail on a bad backend, model or device before anything is written
        require_backend(config.backend, config.sglang_url)
        check_device(config.device)
        check_model_path(config.model, tokenizer=True)
    user = UserCode.load(config)
    try:
        with warehouse.writer("collect", config.iteration, shard_of(shard)):  # one writer per iteration (shard)
            every, plan = iteration_tasks(warehouse, config)  # under the lock: a plan read back or made once
            tasks = [task for task in every if shard.owns(task.prompt_id)]
            return _collect(warehouse, request, tasks, plan, backend, progress, started, user)
    finally:
        user.toolbox.close()


def shard_of(shard: Shard) -> tuple[int, int] | None:
    """A shard as the warehouse's writer locks take it: (index, count), None for the whole iteration."""
    return (shard.index, shard.count) if shard.sharded else None


def _collect(warehouse: Warehouse, request: CollectRequest, tasks: list[Task], plan: CollectPlan,
             backend: Backend | None, progress: bool, started: float, user: UserCode) -> CollectOutcome:
    """The rest of `collect_job`, under the iteration's (or shard's) collect lock."""
    config, shard, resume = request.config, request.shard, request.resume
    iteration = config.iteration
    planned = frozenset(rollout_key(iteration, task.prompt_id, sample)[0]
                        for task in tasks for sample in range(config.group_size))
    # a part a killed collection of this share left uncommitted goes (we hold this share's lock)
    warehouse.remove_uncommitted(iteration, owned=planned.__contains__)
    if resume:
        _repair(warehouse, iteration, shard, planned)
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
                                 dtype=config.rollout_dtype,
                                 sglang_url=config.sglang_url, seed=iteration_seed(config),
                                 deterministic=config.deterministic_inference,
                                 mem_fraction=config.sglang_mem_fraction,
                                 request_timeout_s=config.sglang_request_timeout_s)
        with serving_backend(backend, load) as serving:
            if serving.tokenizer is None:
                raise JobError(f"model {config.model!r} has no tokenizer files; collect needs its "
                               "tokenizer for the chat format")
            warehouse.save_collect_config(iteration, config.to_json())  # the model loaded: the first write
            warehouse.save_plan(iteration, plan)
            chat = user.chat(serving.tokenizer)
            with make_sandbox(config.sandbox) as sandbox, user.grading(tasks, config) as grader:
                def write(batch) -> None:  # on the collection's writer thread
                    warehouse.write_rollouts(iteration, batch.rollouts, batch.segments)

                n_written = collect(tasks, config, serving, sandbox, chat, write=write, reward_fn=grader,
                                    skip_rollout_ids=stored, progress=progress, toolbox=user.toolbox,
                                    reward_file=user.reward).n_rollouts
    rollouts = [r for r in warehouse.read_rollouts(iteration) if r.rollout_id in planned]
    summary = summarize(rollouts, warehouse.read_segments(iteration, planned))
    return CollectOutcome(iteration, len(planned), n_written, summary, time.monotonic() - started)


def _repair(warehouse: Warehouse, iteration: int, shard: Shard, planned: frozenset[str]) -> None:
    """Before a resume: refuse what the gate finds in the iteration (warehouse/gate.py), except
    rollouts whose segments part is gone, whose rollouts part goes so that they are collected
    again (their seeds make them the same rollouts); JobError where that would drop rollouts that
    kept their segments, or another shard's."""
    state = inspect_iteration(warehouse, iteration, share=shard_of(shard), owns=shard.owns, collecting=True)
    refused = [f.line for f in state.findings if f.lost is None or not f.lost.whole]
    if refused:
        raise JobError(refused[0])
    lost = [finding.lost for finding in state.findings]
    others = [part for part in lost if not set(part.rollout_ids) <= planned]
    if others:
        raise JobError(f"{others[0].part}: its rollouts lost their segments, but some are not this shard's "
                       f"({shard}); resume the collection that wrote them (the same --shard, or none)")
    for part in lost:
        drop_lost(part)
        logger.info("%s: its %d rollouts had lost their segments; collecting them again", part.part,
                    len(part.rollout_ids))


def _check_saved_config(warehouse: Warehouse, config: CollectConfig, must_match: bool) -> None:
    """An iteration holds the rollouts of one config: resuming it, or adding a shard to rollouts
    that are already there, needs the config it was started with; a refusal names what differs."""
    saved = warehouse.collect_config(config.iteration)
    if not must_match or saved is None:
        return
    differences = config.differences(saved)
    if differences:
        named = "; ".join(f"{option_of(RENAMED.get(name, name))} {before!r} then, {now!r} now"
                          for name, before, now in differences)
        raise JobError(f"iteration {config.iteration} was collected with another config ({named}); resuming it "
                       "or collecting another shard of it needs the same options (how rollouts are scheduled may "
                       "differ: --batch-rollouts, --max-concurrent-rollouts, --schedule)")


def collected_policy(warehouse: Warehouse, iteration: int) -> str:
    """The policy that collected an iteration, from its saved collect config."""
    saved = warehouse.collect_config(iteration)
    if saved is None:
        raise JobError(f"{warehouse.root}: iteration {iteration} has no collect config; was it collected?")
    return json.loads(saved)["model"]
