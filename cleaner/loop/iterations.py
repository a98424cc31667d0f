"""`cleaner run`: collect -> purify -> train, iteration after iteration, in one process or SPMD on
the ranks a launcher started.

One backend serves the policy for the whole run: collect samples from it, purify scores with its
scorer, and after training it adopts the new checkpoint. With the torch backend the trainer
updates the backend's own in-memory model in place before saving it, so no phase reloads weights.
Another backend (SGLang) serves from its own processes: the trainer then keeps a model of its own,
loaded once from the checkpoint and trained from iteration to iteration, and the backend reloads
each saved checkpoint from disk. One optimiser lives for the whole run: each iteration's training
continues the previous one's AdamW and lr schedule, and every checkpoint carries that state
(cleaner.engine.train.optim).
Every phase is idempotent (see each stage's `job.py`), so `resume` after a crash, even a SIGKILL, redoes
only the unfinished part of the unfinished iteration, and continues from the saved optimiser. An
iteration is complete once its `iterations` row is written; its trained policy is
`<run_dir>/checkpoints/iteration-<i+1>`.

On several ranks (`torchrun --nproc-per-node N cleaner run --engine deepspeed ...`,
docs/architecture.md §9) every rank runs this loop: it collects and purifies its share of each
iteration (`Shard(rank, N)`: whole GRPO groups) with a backend of its own (on its GPU, or on the
shared servers of --sglang-url), then all ranks train together with DeepSpeed on the whole
iteration's rows, read back from the warehouse, and every rank serves the new checkpoint before
the next collection. The DeepSpeed engine loads each checkpoint itself, so the torch backend is
never trained in place there. Rank 0 alone writes the run's config, the checkpoint, the
`iterations` row (collect summary, merges and premise over the whole iteration, read back from
every shard's rows) and the metrics, and prints. Shared servers load each checkpoint once, from
rank 0. Every step where one rank may fail alone is agreed (cleaner.loop.ranks), so an expected
failure ends every rank, with one error line.

A metrics logger (cleaner.report.tracking) gets each iteration this job completes, once its row is
written: its optimiser steps as the warehouse holds them, then its row. Iterations a previous job
completed were logged by that job, so a resumed run logs no step twice.

One job at a time drives a run directory (an exclusive lock on `<run_dir>/.run.lock`, held by
rank 0 and released by the kernel if it dies): a second `cleaner run` on it, resumed or not, fails
at once on every rank instead of collecting the same iteration twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cleaner.config import CollectConfig, RunConfig, TrainConfig
from cleaner.engine.collect.job import CollectOutcome, CollectRequest, collect_job
from cleaner.engine.model import load_backend, require_backend
from cleaner.engine.model.loading import check_device, check_model_path
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.engine.purify.job import (
    PurifyOutcome,
    PurifyRequest,
    StoredIteration,
    check_whole_batch,
    purify_job,
    stored_iteration,
)
from cleaner.engine.train.deepspeed_config import (
    check_deepspeed_setup,
    deepspeed_config_for,
    require_deepspeed,
)
from cleaner.engine.train.deepspeed_engine import saved_optimizer_step
from cleaner.engine.train.job import TrainRequest, train_job
from cleaner.engine.train.lora import check_setup as check_lora
from cleaner.engine.train.lora import saved_adapter
from cleaner.errors import JobError
from cleaner.loop.ranks import Ranks, agree, barrier, from_main, gather, join, same_everywhere
from cleaner.outputs import CHECKPOINT, check_replaceable
from cleaner.records import IterationRow
from cleaner.report.tracking import MetricsLogger, NullLogger
from cleaner.warehouse import Warehouse
from cleaner.warehouse.lock import (
    RUN_LOCK,
    exclusive,
    missing_directories,
    remove_directories,
    run_lock,
)

if TYPE_CHECKING:
    from cleaner.engine.model import Backend
    from cleaner.engine.saar.premise import PremiseStats
    from cleaner.engine.train.optim import Optimization
    from cleaner.engine.train.trainer import TrainResult

logger = logging.getLogger(__name__)


def checkpoint_dir(run_dir: Path, iteration: int) -> Path:
    """Where the policy trained on `iteration` goes (the policy of iteration + 1)."""
    return run_dir / "checkpoints" / f"iteration-{iteration + 1}"


def _load_backend(config: RunConfig, policy: str, ranks: Ranks) -> Backend:
    collect = config.collect
    return load_backend(collect.backend, policy, device=ranks.device(collect.device), dtype=collect.rollout_dtype,
                        sglang_url=collect.sglang_url,
                        seed=collect.seed, deterministic=collect.deterministic_inference,
                        mem_fraction=collect.sglang_mem_fraction,
                        request_timeout_s=collect.sglang_request_timeout_s)


def _policy_to_train(backend: Backend, kept: torch.nn.Module | None, config: TrainConfig) -> torch.nn.Module | None:
    """The in-memory model training updates: the torch backend's own (trained in place, so the
    next collection needs no reload), else the model trained last iteration (None: the trainer
    loads the checkpoint). DeepSpeed always loads it: ZeRO-3 would partition a model it is handed.
    With LoRA the backend's model is trained in place only as the base of the adapters trained last
    (or to be put on it first); a LoRA checkpoint the backend loaded holds merged weights, so the
    trainer then loads the base and the adapter (and the backend reloads what it saves)."""
    if config.engine == "deepspeed":
        return None
    if not isinstance(backend, TorchBackend):
        return kept
    if config.lora_rank == 0:
        return backend.train_in_place()
    if kept is not None and kept.get_base_model() is not backend.model:
        return kept
    if kept is None and saved_adapter(backend.model_path) is not None:
        return None
    served = backend.train_in_place()
    return kept if kept is not None else served


@contextlib.contextmanager
def _engine_aside(backend: Backend, train_device: str, kept: torch.nn.Module | None,
                  optimization: Optimization | None) -> Iterator[list[TrainResult]]:
    """While training, an engine on the trainer's GPU gives its memory up (docs/architecture.md §9).

    Where the backend holds memory on `train_device` (an SGLang engine in this process on that GPU),
    it is released before training and resumed after it; the model the trainer keeps from iteration
    to iteration, and its optimiser's state, wait on the host meanwhile, so the engine's weights and
    KV cache and the trainer's weights, gradients and AdamW moments never share the GPU. The caller
    appends what it trained to the list it gets, to go to the host with it. Elsewhere, nothing."""
    trained: list[TrainResult] = []
    if not backend.occupies(train_device):
        yield trained
        return
    backend.release_memory()
    if kept is not None:
        move_training_state(kept, optimization, train_device)
    try:
        yield trained
    finally:
        for result in trained:
            move_training_state(result.model, result.optimization, "cpu")
        if kept is not None and not trained:
            move_training_state(kept, optimization, "cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the allocator's cache goes back to the device for the engine
        backend.resume_memory()


def move_training_state(model: torch.nn.Module, optimization: Optimization | None, device: str) -> None:
    """The model's parameters and its optimiser's state tensors to `device`, in place (the optimiser
    keeps its references to the same parameters)."""
    model.to(device)
    if optimization is None:
        return
    for state in optimization.optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:  # the step counter stays where AdamW wants it
                state[key] = value.to(device)


# What a run directory holds: the lock, the warehouse, the checkpoints, the demo's report and the
# default one of `cleaner report -w <run>/warehouse`, the logs.
RUN_ENTRIES = frozenset({RUN_LOCK, "warehouse", "checkpoints", "report", "warehouse-report", "tensorboard",
                         "wandb"})


def check_run_dir(run_dir: Path) -> None:
    """JobError unless `run_dir` is absent or a run directory `cleaner run` wrote (it holds the
    run's lock file and nothing but what a run writes): the only kind `clear_run` empties."""
    if not run_dir.exists():
        return
    entries = sorted(entry.name for entry in run_dir.iterdir()) if run_dir.is_dir() else None
    if entries is None or (entries and RUN_LOCK not in entries) or set(entries) - RUN_ENTRIES:
        what = "a file" if entries is None else f"holds {', '.join(entries[:4])}"
        raise JobError(f"{run_dir}: not a run directory cleaner wrote ({what}); the demo starts by "
                       "deleting its --run-dir, so give it a new path or a previous demo's")


def clear_run(run_dir: Path) -> None:
    """Delete what a previous run wrote in `run_dir` (`check_run_dir` first), keeping the lock
    file, which the caller holds: deleting it would let another job lock a new one meanwhile."""
    run_dir = Path(run_dir)
    check_run_dir(run_dir)
    for entry in run_dir.iterdir() if run_dir.exists() else ():
        if entry.name == RUN_LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def run_loop(config: RunConfig, *, resume: bool = False, fresh: bool = False, progress: bool = True,
             on_iteration: Callable[[IterationRow], None] | None = None,
             metrics: MetricsLogger | None = None, ranks: Ranks | None = None) -> list[IterationRow]:
    """Run `config.iterations` iterations; returns the iteration rows of the whole run.

    `fresh` first deletes what a previous run left in the run directory (`clear_run`, the demo),
    once this job holds its lock. `ranks` is this process's place in its job (default: the
    launcher's environment, a world of one without a launcher). `metrics` and `on_iteration` get
    every iteration completed here, on rank 0 only (module docstring); the caller closes `metrics`."""
    ranks = ranks or Ranks.from_env()
    metrics = metrics or NullLogger()
    same_everywhere(ranks, lambda: _check_launch(config, ranks))
    join(ranks)
    # a bad backend, device or model fails on every rank before anything is written
    agree(ranks, lambda: _check_inputs(config, ranks))
    run_dir = Path(config.run_dir)
    with _run_lock(run_dir, ranks, fresh):
        return _run_iterations(config, run_dir, resume, progress and ranks.main, on_iteration, metrics, ranks)


def _check_launch(config: RunConfig, ranks: Ranks) -> None:
    """What the command line and the installed packages decide, the same on every rank (a job runs
    one environment), checked before the ranks can agree on anything."""
    if not ranks.several:
        return
    if config.train.engine != "deepspeed":
        raise JobError(f"cleaner run was launched on {ranks.world_size} ranks, which train together with "
                       "DeepSpeed: pass --engine deepspeed --deepspeed-config FILE, or start one process")
    if config.collect.device.startswith("cuda:"):
        raise JobError(f"--device {config.collect.device}: on several ranks each rank takes the GPU of its "
                       "LOCAL_RANK; pass --device cuda")
    check_whole_batch([config.purify], ranks.shard, f"cleaner run on {ranks.world_size} ranks (each purifies its shard)")
    require_deepspeed()  # the ranks join DeepSpeed's process group


def _check_inputs(config: RunConfig, ranks: Ranks) -> None:
    """The files and devices each rank needs (each node has its own view of them)."""
    if config.train.engine == "deepspeed":
        check_deepspeed_setup(config.train)
    require_backend(config.collect.backend, config.collect.sglang_url)
    check_device(ranks.device(config.collect.device))
    check_model_path(config.collect.model, tokenizer=True)
    check_lora(config.collect.model, config.train)  # before the first collection
    Warehouse(Path(config.run_dir) / "warehouse").check_writable()  # a file at --run-dir is one error line


@contextlib.contextmanager
def _run_lock(run_dir: Path, ranks: Ranks, fresh: bool = False) -> Iterator[None]:
    """Rank 0 holds the run directory's lock for the whole job; if another job holds it, every rank
    fails at once. With `fresh`, what a previous run left is deleted once the lock is held (never
    before: that would delete the files of a run still going). A job that fails before writing
    anything removes the directories it created."""
    created: list[Path] = []
    with contextlib.ExitStack() as held:
        def take() -> None:
            if fresh:
                check_run_dir(run_dir)  # before a lock file is created in someone's directory
            created.extend(missing_directories(run_dir))
            run_dir.mkdir(parents=True, exist_ok=True)
            held.enter_context(exclusive(*run_lock(run_dir)))
            if fresh:
                clear_run(run_dir)

        from_main(ranks, take)
        try:
            yield
        except BaseException:
            if ranks.main:
                _remove_if_unused(run_dir, created)
            raise


def _remove_if_unused(run_dir: Path, created: list[Path]) -> None:
    """Remove the directories this job created for a run that failed before writing anything
    (the run directory holds only its lock), so an early failure leaves nothing behind."""
    if not created or [entry.name for entry in run_dir.iterdir()] != [RUN_LOCK]:
        return
    (run_dir / RUN_LOCK).unlink()
    remove_directories(created)


def _start(config: RunConfig, warehouse: Warehouse, resume: bool, ranks: Ranks) -> dict[int, str]:
    """Rank 0: the output policy of every iteration already complete; each checkpoint still to
    train must have a free place (nothing is written here: the run's config follows the first load)."""
    exists = warehouse.root.exists()
    done = {row.iteration: row.policy_out for row in warehouse.read_iterations()} if exists else {}
    if exists and not resume and (done or warehouse.iterations_collected()):
        raise JobError(f"{config.run_dir} already holds a run; pass --resume to continue it or choose another --run-dir")
    if config.train.engine == "deepspeed":  # fail now rather than after collecting an iteration
        policy = done[max(done)] if done else config.collect.model
        saved_optimizer_step(policy, deepspeed_config_for(config.train, ranks.world_size,
                                                          ranks.device(config.train.device).split(":")[0]), ranks.world_size)
    for iteration in range(config.iterations):  # before any work: each checkpoint's place is free
        if iteration not in done:
            check_replaceable(checkpoint_dir(Path(config.run_dir), iteration), CHECKPOINT)
    return done


def _run_iterations(config: RunConfig, run_dir: Path, resume: bool, progress: bool,
                    on_iteration: Callable[[IterationRow], None] | None,
                    metrics: MetricsLogger, ranks: Ranks) -> list[IterationRow]:
    """The body of `run_loop`, under the run directory's lock."""
    warehouse = Warehouse(run_dir / "warehouse")
    done = from_main(ranks, lambda: _start(config, warehouse, resume, ranks))
    policy, backend = config.collect.model, None
    kept, optimization = None, None  # the model training updates and its optimiser, across iterations
    try:
        for iteration in range(config.iterations):
            if iteration in done:
                policy = done[iteration] or policy
                continue
            if backend is None:  # the first write follows the load: a model that cannot load leaves nothing
                backend = _open_backend(config, policy, ranks)
                from_main(ranks, lambda: warehouse.save_config("run", config.to_json()))
            row, trained = _one_iteration(config, warehouse, iteration, policy, backend, kept, optimization,
                                          progress, ranks)
            policy = str(checkpoint_dir(run_dir, iteration))
            backend = _adopt(backend, policy, config, ranks)
            if trained is not None:  # the trained model and its optimiser equal the saved checkpoint
                kept, optimization = trained.model, trained.optimization
            else:  # trained before a crash: the next training loads the checkpoint and its optimiser
                kept, optimization = None, None
            if row is not None:  # rank 0
                _report(warehouse, row, trained, metrics, on_iteration)
        barrier(ranks)  # no rank returns before rank 0 has written the last row
    finally:
        if backend is not None:
            backend.close()
    return warehouse.read_iterations()


def _report(warehouse: Warehouse, row: IterationRow, trained: TrainResult | None, metrics: MetricsLogger,
            on_iteration: Callable[[IterationRow], None] | None) -> None:
    """An iteration completed here, to the metrics logger and the caller."""
    # the steps as stored: in memory if trained here, else trained before a crash
    for step in trained.steps if trained is not None else warehouse.read_train_steps(row.iteration):
        metrics.log_step(step)
    metrics.log_iteration(row)
    if on_iteration is not None:
        on_iteration(row)


# ---------------------------------------------------------------------------------------------
# Serving the policy on every rank


def _shared_servers(config: RunConfig, ranks: Ranks) -> bool:
    """Whether the ranks generate and score on the same SGLang servers (--sglang-url)."""
    return ranks.several and config.collect.sglang_url is not None


def _open_backend(config: RunConfig, policy: str, ranks: Ranks) -> Backend:
    """This rank's backend serving `policy`. Shared servers are moved to it by rank 0 alone; the
    other ranks connect once it is done and find them serving it."""
    shared = _shared_servers(config, ranks)
    opened = agree(ranks, lambda: _load_backend(config, policy, ranks) if ranks.main or not shared else None)
    if shared:
        first = opened
        opened = agree(ranks, lambda: first if ranks.main else _load_backend(config, policy, ranks))
    return opened


def _adopt(backend: Backend, policy: str, config: RunConfig, ranks: Ranks) -> Backend:
    """Every rank serves the new checkpoint before the next collection; shared servers load it once."""
    shared = _shared_servers(config, ranks)
    agree(ranks, lambda: backend.adopt(policy) if ranks.main or not shared else None)
    if not shared:
        return backend

    def reconnect() -> Backend:
        backend.close()
        return _load_backend(config, policy, ranks)

    return agree(ranks, lambda: backend if ranks.main else reconnect())


def _premise_columns(premise: PremiseStats | None) -> dict[str, float]:
    """The iterations row's premise columns (clean_rollouts, clean_accuracy, ..., the failed-call credit)."""
    if premise is None:
        return {}
    credit = premise.credit
    return {f"{name}_{field}": getattr(getattr(premise, name), key)
            for name in ("clean", "recovered", "unrecovered")
            for field, key in (("rollouts", "rollouts"), ("accuracy", "accuracy"), ("advantage", "mean_advantage"))} | {
        "failed_call_tokens": credit.tokens, "failed_call_advantage": credit.mean_advantage,
        "failed_call_positive_share": credit.positive_share}


def _one_iteration(config: RunConfig, warehouse: Warehouse, iteration: int, policy: str, backend: Backend,
                   kept: torch.nn.Module | None, optimization: Optimization | None, progress: bool,
                   ranks: Ranks) -> tuple[IterationRow | None, TrainResult | None]:
    """One iteration; returns its row (None but on rank 0, which writes it) and the training result
    if a model was trained here (None if a previous job had already trained and saved it)."""
    collect_config = dataclasses.replace(config.collect, iteration=iteration, model=str(policy))
    out = checkpoint_dir(Path(config.run_dir), iteration)
    collected, purified = agree(ranks, lambda: _collect_and_purify(warehouse, collect_config, config, backend,
                                                                   progress, ranks))
    # the barrier after every share; rank 0 decides whether the iteration still needs training
    shares = gather(ranks, (collected.seconds, purified.seconds if purified else 0.0,
                            ranks.main and not (warehouse.has_train_steps(iteration) and out.exists())))
    needs_training = shares[0][2]
    whole = _whole_iteration(warehouse, config, iteration, (collected, purified), needs_training, ranks)
    trained, train_s = None, 0.0
    if needs_training:
        request = TrainRequest(iteration, config.purify.config_id, policy, out, config.train)
        with _engine_aside(backend, ranks.device(config.train.device), kept, optimization) as trained_here:
            outcome = train_job(warehouse, request, model=_policy_to_train(backend, kept, config.train),
                                rows=whole.result.rows, optimization=optimization, progress=progress)
            trained_here.append(outcome.result)
        trained, train_s = outcome.result, outcome.seconds
    if not ranks.main:
        return None, trained
    row = _iteration_row(config, collect_config, out, whole, (max(s[0] for s in shares),
                                                               max(s[1] for s in shares), train_s))
    warehouse.write_iteration(row)
    return row, trained


def _collect_and_purify(warehouse: Warehouse, collect_config: CollectConfig, config: RunConfig, backend: Backend,
                        progress: bool, ranks: Ranks) -> tuple[CollectOutcome, PurifyOutcome | None]:
    """This rank's share of the iteration, collected and purified (None: the share holds no prompt)."""
    collected = collect_job(warehouse, CollectRequest(collect_config, ranks.shard, resume=True), backend=backend,
                            progress=progress)
    if collected.n_planned == 0:
        return collected, None
    purify = config.purify  # its backend, server and device are collect's (RunConfig): the backend handed in
    request = PurifyRequest(collect_config.iteration, (purify,), ranks.shard, backend_kind=purify.backend,
                            sglang_url=purify.sglang_url, device=purify.device,
                            scorer_memory_gb=purify.scorer_memory_gb)
    purified = purify_job(warehouse, request, backend=backend, progress=progress)
    return collected, purified


def _whole_iteration(warehouse: Warehouse, config: RunConfig, iteration: int,
                     share: tuple[CollectOutcome, PurifyOutcome | None], needs_training: bool,
                     ranks: Ranks) -> StoredIteration | None:
    """The whole iteration, as one process would have collected and purified it, where it is
    needed: on rank 0 for its row and, to train, on every rank (None elsewhere). One process holds
    it already; on several ranks each reads every shard back from the warehouse."""
    collected, purified = share
    if not ranks.several:
        return StoredIteration(collected.summary, purified.results[0])
    wanted = ranks.main or needs_training
    return agree(ranks, lambda: stored_iteration(warehouse, iteration, config.purify) if wanted else None)


def _iteration_row(config: RunConfig, collect_config: CollectConfig, out: Path, whole: StoredIteration,
                   seconds: tuple[float, float, float]) -> IterationRow:
    """The iterations row: collect and purify over the whole iteration; each phase's seconds are
    its slowest rank's."""
    summary, stats = whole.summary, whole.result.stats
    collect_s, purify_s, train_s = seconds
    return IterationRow(
        iteration=collect_config.iteration, policy_in=collect_config.model, policy_out=str(out),
        collect_config_json=collect_config.to_json(), purify_config_json=config.purify.to_json(),
        train_config_json=config.train.to_json(), collect_s=collect_s, purify_s=purify_s,
        train_s=train_s, accuracy=summary.accuracy, first_attempt_error_rate=summary.first_attempt_error_rate,
        failures_per_trajectory=summary.failed_calls_per_rollout,
        n_shallow=stats.n_shallow, n_deep=stats.n_deep, n_gated=stats.n_gated,
        **_premise_columns(stats.premise),
    )
