"""The real engines of bench/collect_throughput.py: SGLang on this CPU (engine and server) and the
torch backend on the toy. Imported by it only when asked (sglang lives in .venv-sglang).

Workload (the knobs turned, so that turns and tools vary as an agent's do): the committed tiny policy
on the toy tasks at temperature 1 (its turns are 20-160 tokens), every tool call slowed by a delay
drawn per call, lognormal with median 0.3 s and sigma 1, capped at the 4 s timeout, on top of the
real sandbox (8 workers). Lock step is run first, then async, on the same warm engine; the
engine's raw throughput is then measured on the very requests the async run made (its contexts,
each asked for exactly as many tokens as it generated, EOS ignored), sent all at once, no tools.
On CPU SGLang ignores per-request seeds, so the two schedules sample different rollouts of the
same distribution: the tables count what each generated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cleaner.config import DEFAULT_POLICY, CollectConfig
from cleaner.engine.collect.schedule import collect
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.model.chat import ChatFormat
from cleaner.sandbox import SandboxConfig, make_sandbox

TOY = CollectConfig(n_prompts=16, group_size=8, sandbox=SandboxConfig(workers=8))
TOOL_MEDIAN_S, TOOL_SIGMA, TOOL_TIMEOUT_S = 0.3, 1.0, 4.0


class SlowTools:
    """The real sandbox with every call delayed (module notes); `run_async` as the sandbox's."""

    def __init__(self, sandbox) -> None:
        self.sandbox, self.config = sandbox, sandbox.config

    def run(self, code: str, stdin: str | None = None):
        digest = hashlib.sha256(code.encode()).digest()
        u1, u2 = (int.from_bytes(digest[i:i + 8], "big") / 2**64 for i in (0, 8))
        z = math.sqrt(-2 * math.log(max(u1, 1e-300))) * math.cos(2 * math.pi * u2)
        time.sleep(min(TOOL_TIMEOUT_S, TOOL_MEDIAN_S * math.exp(TOOL_SIGMA * z)))
        return self.sandbox.run(code, stdin)

    async def run_async(self, code: str, stdin: str | None = None):
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._executor(), self.run, code, stdin)

    def _executor(self):
        from concurrent.futures import ThreadPoolExecutor

        if not hasattr(self, "_pool"):
            self._pool = ThreadPoolExecutor(max_workers=self.config.workers)
        return self._pool


@dataclass(frozen=True)
class Run:
    name: str
    rollouts: int
    tokens: int
    seconds: float

    @property
    def rollouts_per_min(self) -> float:
        return 60 * self.rollouts / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _collect(backend, schedule: str, seed: int, requests: list | None = None) -> Run:
    chat = ChatFormat(backend.tokenizer)
    config = dataclasses.replace(TOY, schedule=schedule, seed=seed)
    contexts: list[tuple[str, list[int]]] = []
    with make_sandbox(config.sandbox) as sandbox:
        tools = SlowTools(sandbox)
        started = time.monotonic()
        parts = []
        collect(toy_tasks(config.n_prompts, seed=seed), config, backend, tools, chat, write=parts.append,
                progress=False, on_context=lambda rollout_id, ids: contexts.append((rollout_id, list(ids))))
        seconds = time.monotonic() - started
    assistants = {}
    for part in parts:
        for segment in part.segments:
            if segment.kind == "assistant":
                assistants.setdefault(segment.rollout_id, []).append(len(segment.token_ids))
    if requests is not None:  # (context, tokens generated after it), in the order they were asked
        turn = {}
        for rollout_id, context in contexts:
            index = turn.get(rollout_id, 0)
            turn[rollout_id] = index + 1
            requests.append((context, assistants[rollout_id][index]))
    tokens = sum(sum(lengths) for lengths in assistants.values())
    return Run(f"{schedule}", sum(len(p.rollouts) for p in parts), tokens, seconds)


def _raw(backend, requests: list) -> Run:
    """The same requests at once, each for exactly its length, no tools (SGLang's batch API)."""
    from cleaner.engine.model.base import SamplingParams
    from cleaner.engine.model.sglang_wire import generate_body

    bodies = []
    for context, length in requests:
        body = generate_body(context, SamplingParams(max_new_tokens=length, stop_token_ids=()), 0)
        body["sampling_params"]["ignore_eos"] = True
        bodies.append(body)
    started = time.monotonic()
    responses = backend._send(bodies)
    seconds = time.monotonic() - started
    tokens = sum(len(r["meta_info"]["output_token_logprobs"]) for r in responses)
    return Run("raw engine, no tools", len(bodies), tokens, seconds)


def _table(title: str, runs: list[Run], setup: str) -> str:
    lockstep = next(run for run in runs if run.name == "lockstep")
    raw = next((run for run in runs if run.name.startswith("raw")), None)
    lines = [f"### {title}", "", setup, "", "| schedule | rollouts | generated tokens | seconds | rollouts/min | "
             "tokens/s | x lock step | of raw |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        share = f"{run.tokens_per_s / raw.tokens_per_s:.0%}" if raw is not None else "-"
        per_min = f"{run.rollouts_per_min:,.0f}" if not run.name.startswith("raw") else "-"
        lines.append(f"| {run.name} | {run.rollouts} | {run.tokens:,} | {run.seconds:.1f} | {per_min} | "
                     f"{run.tokens_per_s:,.0f} | {run.tokens_per_s / lockstep.tokens_per_s:.2f} | {share} |")
    return "\n".join(lines) + "\n"


SETUP = ("{what}, the committed tiny policy on {rollouts} toy rollouts ({prompts} prompts x {group}) at "
         "temperature 1, default collect settings (batch 64, up to 1,024 in flight) and SGLang's CPU options "
         "(cleaner/engine/model/sglang_engine.py: at most 8 running requests, OMP_NUM_THREADS=1); each tool call "
         "delayed by a lognormal draw (median 0.3 s, sigma 1, at most 4 s) on 8 sandbox workers.")


def _sglang_runs(backend, what: str) -> str:
    _collect(backend, "async", seed=99)  # warm the engine, the sandbox's fork server and the caches
    requests: list = []
    runs = [_collect(backend, "lockstep", seed=1), _collect(backend, "async", seed=1, requests=requests)]
    runs.append(_raw(backend, requests))
    for run in runs:
        print(json.dumps({"bench": what, "run": run.name, "rollouts": run.rollouts, "tokens": run.tokens,
                          "seconds": run.seconds}), file=sys.stderr, flush=True)
    setup = SETUP.format(what=what, rollouts=TOY.n_prompts * TOY.group_size, prompts=TOY.n_prompts,
                         group=TOY.group_size)
    return _table(f"{what}, on this CPU", runs, setup)


def engine_section() -> str:
    from cleaner.engine.model.sglang_engine import SGLangBackend

    backend = SGLangBackend(DEFAULT_POLICY, device="cpu", seed=0)
    try:
        return _sglang_runs(backend, "The SGLang engine")
    finally:
        backend.close()


def server_section() -> str:
    from cleaner.engine.model.sglang_engine import CPU_ENGINE_ENV, CPU_ENGINE_OPTIONS
    from cleaner.engine.model.sglang_server import SGLangServerBackend

    port = 30000 + os.getpid() % 2000
    flags = []
    for key, value in CPU_ENGINE_OPTIONS.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [] if value is False else [flag, str(value)]
    log = Path(tempfile.mkdtemp()) / "server.log"
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(DEFAULT_POLICY), "--device", "cpu",
               "--dtype", "float32", *flags, "--skip-server-warmup", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, CPU_ENGINE_ENV: "1", "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(url, server, log)
        return _sglang_runs(SGLangServerBackend(url, DEFAULT_POLICY), "One SGLang server")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the server did not answer within {timeout_s} s; {log}")


# ---------------------------------------------------------------------------------------------
# The torch backend on the toy, against the loop before


TORCH_PROBE = """
import inspect, json, sys, time, torch
from cleaner.config import DEFAULT_POLICY, CollectConfig
from cleaner.engine.collect.tasks import toy_tasks
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.sandbox import make_sandbox
try:
    from cleaner.engine.collect.schedule import collect
except ImportError:  # the loop before: agent.collect
    from cleaner.engine.collect.agent import collect
import cleaner
schedule, repeats = sys.argv[1], int(sys.argv[2])
print(json.dumps({"source": cleaner.__file__.rsplit("/", 1)[0]}), flush=True)
fields = {} if schedule == "before" else {"schedule": schedule}
backend = TorchBackend(DEFAULT_POLICY)
chat = ChatFormat(backend.tokenizer)
config = CollectConfig(n_prompts=32, group_size=8, **fields)

def parts_of(*args, **kwargs):  # the parts a collection writes: `collect` takes `write`, or yields them (older trees)
    if "write" in inspect.signature(collect).parameters:
        parts = []
        collect(*args, write=parts.append, **kwargs)
        return parts
    return list(collect(*args, **kwargs))


with make_sandbox(config.sandbox) as sandbox:
    parts_of(toy_tasks(8, seed=99), CollectConfig(n_prompts=8, group_size=8, **fields), backend, sandbox, chat,
             progress=False)  # warm up
    for repeat in range(repeats):
        started = time.monotonic()
        parts = parts_of(toy_tasks(32, seed=repeat), config, backend, sandbox, chat, progress=False)
        seconds = time.monotonic() - started
        tokens = sum(len(s.token_ids) for p in parts for s in p.segments if s.kind == "assistant")
        print(json.dumps({"schedule": schedule, "rollouts": sum(len(p.rollouts) for p in parts), "tokens": tokens,
                          "seconds": seconds}), flush=True)
"""


def torch_section(baseline_src: Path | None, repeats: int = 3) -> str:
    here = Path(__file__).resolve().parents[1]
    probes = [("async", here), ("lockstep", here)] + ([("before", baseline_src.resolve())] if baseline_src else [])
    rows = []
    for schedule, source in probes:
        env = {**os.environ, "PYTHONPATH": str(source)}
        # cwd: a directory without a `cleaner` of its own (`python -c` puts the cwd first on sys.path)
        done = subprocess.run([sys.executable, "-c", TORCH_PROBE, schedule, str(repeats)], env=env,
                              capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
        assert json.loads(done.stdout.splitlines()[0])["source"] == str(source / "cleaner"), "the wrong tree ran"
        results = [json.loads(line) for line in done.stdout.splitlines()[1:] if line.startswith("{")]
        seconds = sorted(r["seconds"] for r in results)[len(results) // 2]  # the median repeat
        rows.append((schedule, results[0]["rollouts"], sum(r["tokens"] for r in results) / len(results), seconds))
    lines = ["### The torch backend on the toy", "",
             "The committed tiny policy, 32 toy prompts x 8 samples (what `make demo` collects per iteration), "
             "default settings, torch's default threads, the real sandbox (2 workers), no delay added; the median "
             f"of {repeats} collections after a warm-up, each schedule in a process of its own. `before`: the "
             "lock-step loop of the previous commit (--baseline-src).", "",
             "| loop | rollouts | generated tokens | seconds | rollouts/min |", "| --- | --- | --- | --- | --- |"]
    for schedule, rollouts, tokens, seconds in rows:
        lines.append(f"| {schedule} | {rollouts} | {tokens:,.0f} | {seconds:.2f} | {60 * rollouts / seconds:,.0f} |")
    return "\n".join(lines) + "\n"


def real_sections(args) -> list[str]:
    sections = []
    if args.engine:
        sections.append(engine_section())
    if args.server:
        sections.append(server_section())
    if args.torch:
        sections.append(torch_section(args.baseline_src))
    return sections
