"""The ranks of a job a launcher started (torchrun, or anything that sets RANK, WORLD_SIZE and
LOCAL_RANK): what `cleaner run` needs to run its loop SPMD (docs/architecture.md §9).

Design decisions:
- A process started without a launcher is a world of one: nothing here is then collective and
  every error keeps its own type, so the single-process run is unchanged.
- The process group is DeepSpeed's (`deepspeed.init_distributed`): the backend its accelerator
  names (gloo on CPU, NCCL on CUDA) and its timeout (DEEPSPEED_TIMEOUT minutes, 30 by default), so
  the DeepSpeed engine trains in the group the loop already joined. The small Python objects the
  ranks exchange go through gloo (the job's group on CPU, a gloo group beside NCCL), so a rank
  waiting for the others holds no GPU collective. A rank that reaches a barrier waits for the
  others at most DEEPSPEED_TIMEOUT: raise it when one rank's share of an iteration may take that
  much longer than another's.
- Expected failures are agreed: each rank runs a step catching its CleanerError, then the ranks
  exchange their outcomes, which is also the step's barrier. If any rank failed, every rank raises
  the same RanksError, which rank 0 alone prints, so a job ends with one error line and no rank
  waits at a barrier for one that gave up. A step only rank 0 takes (the run directory's lock)
  hands its result or its error to every rank (`from_main`). Before the ranks have joined, only
  what is the same on every rank by construction (the command line, the installed packages) is
  checked, and its error is taken as the job's (`same_everywhere`). An error a rank meets alone
  in a step holding collectives (training) is its own: it prints it and exits 1, and torchrun
  stops the others; so does anything unexpected, with a traceback.
- A collective inside an agreed step would pair with another rank's exchange: steps that hold
  collectives are never agreed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from cleaner.config import Shard
from cleaner.errors import CleanerError

T = TypeVar("T")


class RanksError(CleanerError):
    """Raised on every rank of a job alike; rank 0 reports it, the others exit quietly."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in its job."""

    rank: int = 0  # this process, 0 <= rank < world_size; rank 0 writes and reports
    world_size: int = 1  # processes in the job (1: no launcher)
    local_rank: int = 0  # this process among those of its machine; it picks the GPU

    def __post_init__(self) -> None:
        if not (self.world_size >= 1 and 0 <= self.rank < self.world_size and self.local_rank >= 0):
            raise ValueError(f"rank {self.rank} of {self.world_size} (local rank {self.local_rank}) "
                             "is not a place in a job")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Ranks:
        """The launcher's RANK, WORLD_SIZE and LOCAL_RANK; a world of one without them."""
        return cls(int(environ.get("RANK", "0")), int(environ.get("WORLD_SIZE", "1")),
                   int(environ.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.world_size > 1

    @property
    def shard(self) -> Shard:
        """This rank's share of every iteration (whole GRPO groups, docs/architecture.md §5)."""
        return Shard(self.rank, self.world_size)

    def device(self, device: str) -> str:
        """Where this rank serves the policy: on several ranks `cuda` means its local rank's GPU."""
        import torch  # start-up time: the CLI's error path reads Ranks.from_env, and needs no torch

        if self.several and torch.device(device).type == "cuda":
            return f"cuda:{self.local_rank}"
        return device


def join(ranks: Ranks) -> None:
    """Join the job's process group (DeepSpeed's), on this rank's device; nothing for one rank."""
    if not ranks.several:
        return
    import deepspeed  # optional extra (deepspeed): several ranks train with it
    from deepspeed.accelerator import get_accelerator  # (the same optional extra)

    deepspeed.init_distributed()
    get_accelerator().set_device(ranks.local_rank)


@functools.cache
def _objects_group():
    """The group the ranks exchange Python objects in: gloo (module docstring). Created on first
    use, which every rank reaches at the same point of the loop, as `new_group` needs."""
    import torch.distributed  # start-up time (as in Ranks.device)

    if torch.distributed.get_backend() == "gloo":
        return None  # the job's own group
    return torch.distributed.new_group(backend="gloo")


def gather(ranks: Ranks, value: T) -> list[T]:
    """Every rank's `value` (picklable, small), in rank order; a barrier."""
    if not ranks.several:
        return [value]
    import torch.distributed  # start-up time (as in Ranks.device)

    gathered: list = [None] * ranks.world_size
    torch.distributed.all_gather_object(gathered, value, group=_objects_group())
    return gathered


def barrier(ranks: Ranks) -> None:
    """Wait until every rank is here."""
    gather(ranks, None)


def _message(failures: list[tuple[int, str]], world_size: int) -> str:
    """One line for the job: the first failure, naming its rank unless every rank said the same."""
    rank, message = failures[0]
    if len(failures) == world_size and all(text == message for _, text in failures):
        return message
    return f"rank {rank} of {world_size}: {message}"


def agree(ranks: Ranks, step: Callable[[], T]) -> T:
    """Run `step` on every rank, then wait for all; if it raised a CleanerError on any rank,
    every rank raises one RanksError naming it. Returns this rank's result. `step` must hold no
    collective (module docstring)."""
    if not ranks.several:
        return step()
    result, failure = None, None
    try:
        result = step()
    except CleanerError as error:
        failure = str(error)
    failures = [(rank, text) for rank, text in enumerate(gather(ranks, failure)) if text is not None]
    if failures:
        raise RanksError(_message(failures, ranks.world_size)) from None
    return result


def from_main(ranks: Ranks, step: Callable[[], T]) -> T:
    """Run `step` on rank 0 alone and hand its result (picklable, small) to every rank; if it
    raised a CleanerError, every rank raises it as a RanksError. `step` must hold no collective."""
    if not ranks.several:
        return step()
    outcome: tuple[T | None, str | None] = (None, None)
    if ranks.main:
        try:
            outcome = (step(), None)
        except CleanerError as error:
            outcome = (None, str(error))
    result, failure = gather(ranks, outcome)[0]
    if failure is not None:
        raise RanksError(failure)
    return result


def same_everywhere(ranks: Ranks, step: Callable[[], T]) -> T:
    """Run `step`, whose expected errors are the same on every rank; on several ranks such an
    error becomes a RanksError, so that rank 0 alone reports it."""
    if not ranks.several:
        return step()
    try:
        return step()
    except RanksError:
        raise
    except CleanerError as error:
        raise RanksError(str(error)) from error
