"""A job's ranks (cleaner/loop/ranks.py): the place read from the launcher's environment, the
world of one that changes nothing, and agreement on two real gloo processes."""

from __future__ import annotations

import pytest
import torch

from cleaner.config import Shard
from cleaner.errors import JobError
from cleaner.loop.ranks import Ranks, RanksError, agree, from_main, gather, same_everywhere
from tests.helpers import free_port


def test_the_place_comes_from_the_launchers_environment():
    ranks = Ranks.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node-0"})
    assert ranks == Ranks(3, 4, 1) and not ranks.main and ranks.several
    assert ranks.shard == Shard(3, 4)
    assert Ranks.from_env({}) == Ranks(0, 1, 0) and Ranks().main and not Ranks().several
    assert Ranks().shard == Shard()  # a world of one collects everything
    with pytest.raises(ValueError, match="rank 2 of 2"):
        Ranks(2, 2)


def test_each_rank_serves_on_its_local_gpu_and_one_rank_keeps_the_device_given():
    assert Ranks(3, 4, 1).device("cuda") == "cuda:1"
    assert Ranks(3, 4, 1).device("cpu") == "cpu"
    assert Ranks().device("cuda") == "cuda" and Ranks().device("cuda:2") == "cuda:2"


def test_a_world_of_one_runs_each_step_as_it_is_and_keeps_its_errors():
    ranks = Ranks()
    assert gather(ranks, 7) == [7]
    assert agree(ranks, lambda: 1) == 1 and from_main(ranks, lambda: 2) == 2
    assert same_everywhere(ranks, lambda: 3) == 3

    def failing():
        raise JobError("bad input")

    for run in (agree, from_main, same_everywhere):  # the error keeps its type: no job to agree with
        with pytest.raises(JobError, match="^bad input$"):
            run(ranks, failing)


def test_an_error_the_same_on_every_rank_becomes_one_the_job_shares():
    def failing():
        raise JobError("bad input")

    with pytest.raises(RanksError, match="^bad input$"):
        same_everywhere(Ranks(1, 2), failing)


# ---------------------------------------------------------------------------------------------
# Two processes in a gloo group


def _two_ranks(rank: int, port: int, results) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = Ranks(rank, 2, rank)
    seen = {"gathered": gather(ranks, rank * 10), "from_main": from_main(ranks, lambda: f"rank {rank}'s")}

    def fail_on(failing: set[int], message: str):
        def step():
            if rank in failing:
                raise JobError(message(rank) if callable(message) else message)
            return rank
        return step

    for name, step in [("ok", fail_on(set(), "")), ("alone", fail_on({1}, "rank 1 cannot collect")),
                       ("alike", fail_on({0, 1}, "bad input")),
                       ("each", fail_on({0, 1}, lambda r: f"input {r} is bad"))]:
        try:
            seen[name] = agree(ranks, step)
        except RanksError as error:
            seen[name] = f"RanksError: {error}"
    try:
        from_main(ranks, fail_on({0}, "locked"))
    except RanksError as error:
        seen["main fails"] = f"RanksError: {error}"
    torch.distributed.destroy_process_group()
    results.put((rank, seen))


def test_two_ranks_agree_on_every_step_and_raise_alike_when_one_fails():
    """Each rank learns of a failure on the other, so neither waits for a rank that gave up."""
    context = torch.multiprocessing.get_context("spawn")
    port = free_port()
    results = context.Queue()
    processes = [context.Process(target=_two_ranks, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    seen = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert [process.exitcode for process in processes] == [0, 0]
    for rank in range(2):
        assert seen[rank] == {
            "gathered": [0, 10],
            "from_main": "rank 0's",  # rank 0's result, on both
            "ok": rank,  # each rank's own result
            "alone": "RanksError: rank 1 of 2: rank 1 cannot collect",
            "alike": "RanksError: bad input",
            "each": "RanksError: rank 0 of 2: input 0 is bad",  # the first rank's
            "main fails": "RanksError: locked",
        }
