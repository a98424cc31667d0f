"""Rewards off the event loop, each under a timeout (grading/runner.py): the built-in grader in a
reward worker process, a callable on a thread, a coroutine on its own loop; past the timeout, one
line naming the reward and the rollout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time

import pytest

from cleaner.engine.grading import workers
from cleaner.engine.grading.answers import compute_reward
from cleaner.engine.grading.reward_file import RewardFunction, RewardFunctionError
from cleaner.engine.grading.runner import Rewards, RewardTimeout


@pytest.mark.parametrize(("text", "truth"), [("so \\boxed{1/2}", "0.5"), ("\\boxed{42}", "41"), ("none", "1")])
def test_the_built_in_grader_runs_in_a_worker_and_grades_as_it_does_here(text, truth):
    got = asyncio.run(Rewards().grade("r0", text, truth, "math"))
    assert got == compute_reward(text, truth, "math")
    busy = [worker for worker in workers.reward_workers()._all if worker.process is not None]
    assert busy and all(worker.process.poll() is None for worker in busy)  # it ran in a worker, still warm


def test_a_hanging_callable_is_one_line_naming_it_and_the_rollout():
    def slow_grader(text, truth, source):
        time.sleep(30)

    started = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"^reward slow_grader did not return within 0.3 s on rollout r7 "
                                            r"\(--reward-timeout-s\); the parts committed stay"):
        asyncio.run(Rewards(slow_grader, timeout_s=0.3).grade("r7", "x", "1", "toy"))
    assert time.monotonic() - started < 5


def test_a_coroutine_reward_function_past_its_timeout_and_one_that_kills_its_worker(tmp_path):
    async def judge(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(30)

    with pytest.raises(RewardTimeout, match=r"^reward function judge \(judge.py:judge\) did not return within 0.2 s "
                                            r"on rollout r1"):
        asyncio.run(Rewards(reward_file=RewardFunction("judge.py:judge", judge), timeout_s=0.2)
                    .verl("r1", "toy", "x", "1", {}))
    path = tmp_path / "dies.py"
    path.write_text("import os\ndef compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    os._exit(3)\n")
    with pytest.raises(RewardFunctionError, match=r"raised on rollout r2: WorkerLost: its worker process died \(exit "
                                                  r"code 3\)"):
        asyncio.run(Rewards(reward_file=RewardFunction.load(str(path))).verl("r2", "toy", "x", "1", {}))
    # the pool replaced the worker: the next reward is computed
    assert asyncio.run(Rewards().grade("r3", "\\boxed{2}", "2", "math")).correct


@pytest.mark.parametrize("kind", ["thread", "coroutine", "score"])
def test_each_reward_call_gets_its_own_copy_of_the_rows_values(kind):
    """A reward function that changes the ground truth and extra_info it is handed (in this
    process: on a thread, on its loop, or through `score`): the next call, and the row, see them
    as they were."""
    truth, extra = {"answers": ["7"]}, {"index": 3, "table": {"x": [1]}}
    seen = []

    def judge(data_source, solution_str, ground_truth, extra_info):
        seen.append(json.dumps([ground_truth, extra_info], sort_keys=True))
        ground_truth["answers"].append("changed")
        extra_info["table"]["x"].append(2)
        return 1.0

    async def coroutine_judge(**arguments):
        return judge(**arguments)

    function = RewardFunction("judge.py:judge", coroutine_judge if kind == "coroutine" else judge)
    rewards = Rewards(reward_file=function)
    for rollout_id in ("r0", "r1"):
        if kind == "score":
            asyncio.run(function.score(rollout_id, "toy", "x", truth, extra))
        else:
            asyncio.run(rewards.verl(rollout_id, "toy", "x", truth, extra))
    rewards.close()
    assert seen == [json.dumps([{"answers": ["7"]}, {"index": 3, "table": {"x": [1]}}], sort_keys=True)] * 2
    assert (truth, extra) == ({"answers": ["7"]}, {"index": 3, "table": {"x": [1]}})


def test_a_coroutine_reward_that_blocks_its_loop_is_a_timeout_for_every_call_it_holds_up(monkeypatch):
    """A coroutine reward doing synchronous work for good: the call blocking its loop, and the one
    its loop never gets to, each end in the reward's one timeout line."""
    from cleaner.tools import calls as calls_module

    monkeypatch.setattr(calls_module, "LOOP_GRACE_S", 0.3)
    release = threading.Event()

    async def judge(data_source, solution_str, ground_truth, extra_info):
        release.wait(30)
        return 1.0

    rewards = Rewards(reward_file=RewardFunction("judge.py:judge", judge), timeout_s=0.2)

    async def both():
        return await asyncio.gather(*[rewards.verl(f"r{i}", "toy", "x", "1", {}) for i in range(2)],
                                    return_exceptions=True)

    try:
        outcomes = asyncio.run(both())
    finally:
        release.set()
        rewards.close()
    assert [type(outcome) for outcome in outcomes] == [RewardTimeout, RewardTimeout]
    assert str(outcomes[1]).startswith("reward function judge (judge.py:judge) did not return within 0.2 s on rollout r1")


def test_a_script_that_collects_at_its_top_level_needs_no_main_guard(tmp_path):
    """Reward workers are processes of cleaner's own: they never import the caller's script again
    (multiprocessing's spawn would, and run a top-level collection once per worker)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text("import asyncio\n"
                      "from cleaner.engine.grading.runner import Rewards\n"
                      "print('graded', asyncio.run(Rewards().grade('r', '\\\\boxed{4}', '4', 'math')).correct)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["graded True"]


# ---------------------------------------------------------------------------------------------
# A reward's processes and streams


@pytest.fixture
def fresh_workers(monkeypatch):
    """A pool of one worker of this test's own, started under its streams and descriptors."""
    pool = workers.RewardWorkers(1)
    monkeypatch.setattr(workers, "_workers", pool)
    yield pool
    pool.close()


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_a_reward_past_its_timeout_takes_every_process_it_started_with_it(tmp_path, fresh_workers):
    """A reward starts a long-lived child (a code judge, a shell) and hangs: at its timeout the
    worker's whole process group is killed, so no process of it survives."""
    started = tmp_path / "started.txt"
    path = tmp_path / "judge.py"
    path.write_text("import os, subprocess, time\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    child = subprocess.Popen(['sleep', '600'])\n"
                    f"    open({str(started)!r}, 'w').write(f'{{os.getpgid(0)}} {{child.pid}}')\n"
                    "    time.sleep(60)\n")
    with pytest.raises(RewardTimeout, match=r"^reward function compute_score \(.*judge.py\) did not return within 2 s"):
        asyncio.run(Rewards(reward_file=RewardFunction.load(str(path)), timeout_s=2.0).verl("r1", "toy", "x", "1", {}))
    group, child = map(int, started.read_text().split())
    try:
        deadline = time.monotonic() + 5
        while (_alive(child) or _group(group)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child) and _group(group) == []
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)  # left by the bug this test guards against


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_a_sigkilled_collection_takes_its_rewards_processes_with_it(tmp_path):
    """The collection's process is SIGKILLed (no exit handler runs) while a reward hangs beside the
    long-lived child it started: the worker notices its parent gone and kills its whole group, so
    neither it nor the child is left behind."""
    import subprocess
    import sys

    started = tmp_path / "started.txt"
    judge = tmp_path / "judge.py"
    judge.write_text("import os, subprocess, time\n"
                     "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                     "    child = subprocess.Popen(['sleep', '600'])\n"
                     f"    open({str(started)!r}, 'w').write(f'{{os.getpgid(0)}} {{child.pid}}')\n"
                     "    time.sleep(600)\n")
    script = tmp_path / "collection.py"
    script.write_text("import asyncio\n"
                      "from cleaner.engine.grading.reward_file import RewardFunction\n"
                      "from cleaner.engine.grading.runner import Rewards\n"
                      f"reward = RewardFunction.load({str(judge)!r})\n"
                      "asyncio.run(Rewards(reward_file=reward, timeout_s=600.0).verl('r1', 'toy', 'x', '1', {}))\n")
    collection = subprocess.Popen([sys.executable, str(script)])
    group = child = None
    try:
        deadline = time.monotonic() + 120
        while not started.exists() or not started.read_text():
            assert collection.poll() is None and time.monotonic() < deadline, "the reward never started"
            time.sleep(0.05)
        group, child = map(int, started.read_text().split())
        collection.kill()
        collection.wait()
        deadline = time.monotonic() + 10  # the watchdog looks once a second
        while (_alive(child) or _group(group)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child) and _group(group) == []
    finally:
        if collection.poll() is None:
            collection.kill()
        for pid in [] if group is None else [*_group(group), child]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # left by the bug this test guards against


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_a_shell_job_a_reward_started_holds_none_of_its_workers_pipes(tmp_path, fresh_workers):
    """A reward starts a background job through a shell (`os.system` passes on every descriptor that
    is inheritable), then kills its worker: the job holds neither of the worker's pipes, so the death
    is read at once, not after the 20 s timeout, and the job goes with the worker's process group."""
    job_file = tmp_path / "job.txt"
    path = tmp_path / "judge.py"
    path.write_text("import os\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    f"    os.system('sleep 60 & echo $! > {job_file}')\n"
                    "    os._exit(3)\n")
    started = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"raised on rollout r1: WorkerLost: its worker process died \(exit "
                                                  r"code 3\)"):
        asyncio.run(Rewards(reward_file=RewardFunction.load(str(path)), timeout_s=20.0).verl("r1", "toy", "x", "1", {}))
    assert time.monotonic() - started < 10
    job = int(job_file.read_text())
    try:
        deadline = time.monotonic() + 5
        while _alive(job) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(job)
    finally:
        if _alive(job):
            os.kill(job, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from /proc")
def test_a_worker_that_died_idle_is_replaced_with_its_pipes_closed_and_its_group_killed(tmp_path, fresh_workers):
    """A reward leaves a child running and returns; then its worker dies between calls (the OOM
    killer, a stray signal). The next call gets a new worker, and the dead one's pipes are closed
    and the child it left is killed with its group, as at a timeout."""
    child_file = tmp_path / "child.txt"
    path = tmp_path / "judge.py"
    path.write_text("import subprocess\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    child = subprocess.Popen(['sleep', '600'])\n"
                    f"    open({str(child_file)!r}, 'w').write(str(child.pid))\n"
                    "    return 0.25\n")
    rewards = Rewards(reward_file=RewardFunction.load(str(path)), timeout_s=20.0)
    assert asyncio.run(rewards.verl("r1", "toy", "x", "1", {})).reward == 0.25
    child = int(child_file.read_text())
    worker = fresh_workers._all[0]
    pipes = {fd: os.fstat(fd).st_ino for fd in (worker.requests, worker.replies)}
    try:
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
        assert _alive(child)  # the worker alone died
        assert asyncio.run(rewards.verl("r2", "toy", "x", "1", {})).reward == 0.25
        for fd, inode in pipes.items():  # closed (or the number reused for another file)
            with contextlib.suppress(OSError):
                assert os.fstat(fd).st_ino != inode, f"the dead worker's pipe {fd} is still open"
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        for pid in (child, int(child_file.read_text())):  # the first call's child, and the second's
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_reward_whose_subprocess_writes_to_stdout_returns_and_its_output_reaches_stderr(tmp_path, fresh_workers,
                                                                                           capfd):
    """A reward's subprocess writes to the stdout it inherits: no reply is corrupted (the reward is
    its value at once, not a hang), and what it and the reward printed is on the collection's stderr."""
    path = tmp_path / "judge.py"
    path.write_text("import subprocess\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                    "    subprocess.run(['echo', 'the judge says hi'])\n"
                    "    print('the reward says hi')\n"
                    "    return 0.5\n")
    started = time.monotonic()
    got = asyncio.run(Rewards(reward_file=RewardFunction.load(str(path)), timeout_s=10.0).verl("r1", "toy", "x", "1", {}))
    assert got.reward == 0.5 and time.monotonic() - started < 10
    out, err = capfd.readouterr()
    assert "the judge says hi\n" in err and "the reward says hi\n" in err and "says hi" not in out


def test_a_worker_answers_on_descriptors_above_1024(fresh_workers):
    """With more than 1,024 descriptors open (a collection's sockets and files), the workers' pipes
    get descriptors select() cannot watch: a reward is computed all the same."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        timed = fresh_workers.call(workers.function_ref(compute_reward), ("\\boxed{2}", "2", "math"), 30.0)
        assert fresh_workers._all[0].replies >= 1024
    finally:
        for fd in held:
            os.close(fd)
    assert timed.error is None and timed.value == compute_reward("\\boxed{2}", "2", "math")
