"""Real SGLang servers and a real sglang-router on 127.0.0.1, for the `sglang` tests (`make
test-sglang`, in .venv-sglang). Each is a process group of its own, stopped with SIGTERM (then
SIGKILL if it does not end), so no test leaves one running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cleaner.engine.model.sglang_engine import CPU_ENGINE_ENV, CPU_ENGINE_OPTIONS
from tests.helpers import free_port

START_TIMEOUT_S = 600.0  # a server starts in 20-40 s alone; much longer on a busy 2-core machine


def server_flags(options: dict) -> list[str]:
    """`sglang.Engine` keyword arguments as `sglang.launch_server` flags."""
    flags = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def get_json(url: str, timeout_s: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


def post_json(url: str, body: dict, timeout_s: float = 120.0):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


@dataclass
class Process:
    """A launched server or router: its URL, process and log file."""

    url: str
    process: subprocess.Popen
    log: Path

    def wait_until(self, ready, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll `ready()` (connection errors count as not yet) until true; fail if the process ends."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.process.returncode}; log {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            try:
                if ready():
                    return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url}: {what} after {timeout_s:.0f} s; log {self.log}")

    def wait_ready(self, route: str) -> None:
        """Until GET `route` answers 200."""
        def answers() -> bool:
            with urllib.request.urlopen(self.url + route, timeout=5) as response:
                return response.status == 200

        self.wait_until(answers, f"GET {route} does not answer")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the process group, wait; SIGKILL what is left."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the engine's children, if any outlived it
        except ProcessLookupError:
            pass
        self.process.wait()


def _spawn(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def launch_server(model: Path, log: Path, seed: int = 0) -> Process:
    """`python -m sglang.launch_server` on CPU with the engine options cleaner uses there; a
    checkpoint without tokenizer files is served with --skip-tokenizer-init (cleaner sends ids)."""
    port = free_port()
    env = {**os.environ, CPU_ENGINE_ENV: "1", "OMP_NUM_THREADS": "1"}
    tokenizer = [] if (model / "tokenizer_config.json").exists() else ["--skip-tokenizer-init"]
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
               "--device", "cpu", "--dtype", "float32", "--random-seed", str(seed),
               *server_flags(CPU_ENGINE_OPTIONS), *tokenizer, "--skip-server-warmup",
               "--host", "127.0.0.1", "--port", str(port)]
    return Process(f"http://127.0.0.1:{port}", _spawn(command, log, env), log)


def start_server(model: Path, log: Path, seed: int = 0) -> Process:
    """A server, once it answers its health check."""
    server = launch_server(model, log, seed)
    try:
        server.wait_ready("/health")
    except BaseException:
        server.stop()
        raise
    return server


def launch_router(workers: list[str], log: Path) -> Process:
    """`python -m sglang_router.launch_router` in front of `workers`."""
    port = free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(port), "--worker-urls", *workers, "--policy", "round_robin",
               "--log-level", "warn"]
    return Process(f"http://127.0.0.1:{port}", _spawn(command, log, dict(os.environ)), log)


@dataclass
class Cluster:
    """Servers and a router in front of them."""

    servers: list[Process]
    router: Process

    @classmethod
    def start(cls, model: Path, n_servers: int, logs: Path) -> Cluster:
        servers: list[Process] = []
        router = None
        try:
            servers = [launch_server(model, logs / f"server-{i}.log") for i in range(n_servers)]
            for server in servers:
                server.wait_ready("/health")
            router = launch_router([server.url for server in servers], logs / "router.log")
            router.wait_ready("/health")
            router.wait_until(lambda: get_json(router.url + "/workers")["total"] == n_servers,
                              "the router has not registered its workers")
        except BaseException:
            for process in [router, *servers]:
                if process is not None:
                    process.stop()
            raise
        return cls(servers, router)

    def stop(self) -> None:
        for process in (self.router, *self.servers):
            process.stop()
