"""Helpers shared by the test modules: a tiny model, processes, assertions, a stand-in SGLang server,
TensorBoard's reader. Builders of rows and chains live in factories.py, fixtures in conftest.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.factories import lp


def tiny_qwen3(seed: int = 0, vocab_size: int = 64, num_hidden_layers: int = 2, **overrides):
    """A random-weight Qwen3ForCausalLM small enough to forward in milliseconds."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
        max_position_embeddings=512, **overrides,
    )
    return Qwen3ForCausalLM(config)


def naive_logprobs(model, tokens: list[int]) -> list[float]:
    """log pi(tokens[t] | tokens[:t]) for t >= 1, by one unpadded forward: the reference every
    scorer and backend is checked against."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()  # (T, V)
    picked = logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(tokens[1:]).unsqueeze(-1))  # (T-1, 1)
    return picked.squeeze(-1).tolist()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cli(*args: str) -> list[str]:
    """The command line that runs `cleaner ARGS` in a fresh interpreter."""
    return [sys.executable, "-m", "cleaner.cli", *args]


def leaf_commands() -> list[tuple[tuple[str, ...], object]]:
    """(command path, click command) of every leaf command of the app, e.g. ("sandbox", "run")."""
    import typer

    from cleaner.cli import app

    def walk(command, path=()):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from walk(sub, (*path, name))
        else:
            yield path, command

    return list(walk(typer.main.get_command(app)))


def wait_for(predicate, timeout_s: float, process: subprocess.Popen) -> None:
    """Poll until `predicate()`; fail if `process` ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            pytest.fail(f"process ended (rc {process.returncode}) before the kill point")
        time.sleep(0.05)
    pytest.fail("kill point not reached in time")


def ctrl_c_when(command: list[str], log: Path, said: str, settle_s: float, what: str) -> tuple[int, str, list[str]]:
    """Run `command` (stdout discarded, stderr into `log`), send one SIGINT once `log` holds `said`
    and `settle_s` more have passed (inside DuckDB by then), and reap it: its exit code, its stderr
    and the error lines of it; fail if it goes on for 30 s after, or took 10 s or more to stop."""
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
        wait_for(lambda: said in log.read_text(), 120, process)
        time.sleep(settle_s)
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"the {what} went on after its Ctrl-C")
    assert time.monotonic() - sent < 10
    text = log.read_text()
    return process.returncode, text, [line for line in text.splitlines() if line.startswith("error:")]


def sigkill_when(command: list[str], predicate, timeout_s: float, env: dict | None = None) -> None:
    """Start `command` (its output discarded), SIGKILL it once `predicate()` holds, and reap it;
    fail if it ends first or the time runs out."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wait_for(predicate, timeout_s, process)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


def tree_digest(root) -> str:
    """A hash of everything under `root`, itself included: every entry's relative path and kind,
    every file's bytes and modification time, every link's target. Equal digests: left untouched."""
    digest = hashlib.sha256()
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, root).encode() + b"\0")
            if os.path.islink(path):
                digest.update(b"link:" + os.readlink(path).encode())
            elif os.path.isfile(path):
                digest.update(b"file:%d:" % os.stat(path).st_mtime_ns)
                with open(path, "rb") as handle:
                    digest.update(hashlib.sha256(handle.read()).digest())
            else:
                digest.update(b"dir")
    if os.path.isfile(root):
        with open(root, "rb") as handle:
            digest.update(b"file:%d:" % os.stat(root).st_mtime_ns + handle.read())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------
# Assertions


def wrong_modes(root, umask: int) -> list[str]:
    """Every entry under `root` (itself included) whose permission bits are not what `mkdir` (0o777)
    or `open` (0o666) gives under `umask`, as "path: 0o700, expected 0o755"."""
    wrong = []
    for directory, _, files in os.walk(root):
        entries = [(directory, 0o777)] + [(os.path.join(directory, name), 0o666) for name in files]
        for path, default in entries:
            mode, expected = os.stat(path).st_mode & 0o777, default & ~umask
            if mode != expected:
                wrong.append(f"{os.path.relpath(path, root)}: {oct(mode)}, expected {oct(expected)}")
    return wrong



def assert_rendered(rendered, *pieces: tuple[tuple[int, ...], bool]) -> None:
    """A rendering of tests/factories.py's chains is the spans `pieces`, each (token ids, trained),
    in order: its tokens, its loss mask, and the behaviour log-prob -id / 1000 of each trained token."""
    assert rendered.token_ids == tuple(i for piece, _ in pieces for i in piece)
    assert rendered.loss_mask == tuple(int(trained) for piece, trained in pieces for _ in piece)
    assert rendered.behavior_logprobs == pytest.approx(
        tuple(lp(i) if trained else 0.0 for piece, trained in pieces for i in piece))


def assert_rows_close(got: list[list[float]], expected: list[list[float]], atol: float = 1e-4) -> None:
    """Scored rows equal, row by row, within `atol`, and none NaN."""
    assert [len(row) for row in got] == [len(row) for row in expected]
    for row_got, row_expected in zip(got, expected, strict=True):
        assert not any(math.isnan(x) for x in row_got)
        assert row_got == pytest.approx(row_expected, abs=atol)


# The torch backend decodes the rollouts waiting for a turn in one batch, whose shape depends on
# how their turns interleave; a batched forward is not batch-invariant in its last bits (measured
# up to 8e-6 in a behaviour log-prob on the tiny policy), so two collections of the same seed agree
# on every token and within this on every log-prob (docs/architecture.md §6).
BATCH_ATOL = 1e-4


def comparable(rollouts, segments) -> tuple[list, list]:
    """A collection's (rollouts, segments) as two collections of the same seeds compare: rollouts by
    id, segments by (rollout, seq), without the wall clock's fields (a row's write time, a call's
    execution time)."""
    return (sorted((dataclasses.replace(r, created_at=None) for r in rollouts), key=lambda r: r.rollout_id),
            sorted((dataclasses.replace(s, exec_ms=None) for s in segments), key=lambda s: (s.rollout_id, s.seq)))


def assert_same_collection(got: tuple[list, list], expected: tuple[list, list], atol: float = BATCH_ATOL) -> None:
    """Two collections' (rollouts, segments), each in one order: every field equal, the behaviour
    log-probs within `atol`."""
    got_rollouts, got_segments = got
    expected_rollouts, expected_segments = expected
    assert got_rollouts == expected_rollouts
    assert [dataclasses.replace(s, logprobs=None) for s in got_segments] == [
        dataclasses.replace(s, logprobs=None) for s in expected_segments]
    for segment, reference in zip(got_segments, expected_segments, strict=True):
        if reference.logprobs is not None:
            assert segment.logprobs == pytest.approx(reference.logprobs, abs=atol), segment.rollout_id


# ----------------------------------------------------------------------------------------------
# A stand-in SGLang server or router over HTTP (sglang_server and run loop tests)


class StandIn:
    """One stand-in server: its model emits last + 1 (mod 64), log-prob -0.5 per token; an input
    token t scores -t / 10. `workers` makes it a router listing those URLs."""

    def __init__(self, model_path: str, workers: list[str] | None = None, delay_s: float = 0.0,
                 port: int = 0) -> None:
        self.model_path, self.workers, self.delay_s = model_path, workers, delay_s
        self.drop_after: int | None = None  # after this many /generate requests, hang up on every request
        self.let_through = 0  # /generate requests let through while drop_after was set
        self.wedged: set[str] = set()  # paths it takes requests on and never answers (until closed)
        self.released = threading.Event()  # set at close: the wedged requests end (the connection drops)
        self.busy_after_update = False  # SGLang's "weights in, cache not flushed" answer, then a flush
        self.idle_within_timeout = True  # does a flush that waits for idle find it?
        self.requests: list[tuple[str, dict | None]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        self.http = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[int, object]:
        ids, params, start = body["input_ids"], body["sampling_params"], body["logprob_start_len"]
        if not isinstance(ids[0], int) or not isinstance(params, dict):
            return 400, {"error": {"message": "the stand-in takes single requests"}}
        if start >= len(ids):
            return 400, {"error": {"message": f"logprob_start_len, ({start}) is higher than the number of input tokens"}}
        output, finish = [], {"type": "length", "length": params["max_new_tokens"]}
        while len(output) < params["max_new_tokens"]:
            output.append((output[-1] if output else ids[-1]) + 1 & 63)
            if output[-1] in params.get("stop_token_ids", []):
                finish = {"type": "stop", "matched": output[-1]}
                break
        inputs = [[None if j == 0 else -t / 10, t, None] for j, t in enumerate(ids[start:])]
        meta = {"id": "x", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(output),
                "cached_tokens": 0, "input_token_logprobs": inputs,
                "output_token_logprobs": [[-0.5, t, None] for t in output]}
        return 200, {"text": "", "output_ids": output, "meta_info": meta}

    def answer(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        self.requests.append((path, body))
        if path == "/generate" and method == "POST":
            return self.generate(body)
        if path == "/health":
            return 200, None
        if path == "/workers" and self.workers is not None:
            return 200, {"workers": [{"id": str(i), "url": u} for i, u in enumerate(self.workers)],
                         "total": len(self.workers), "stats": {}}
        if path == "/get_model_info" and self.workers is None:
            return 200, {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}
        if path == "/update_weights_from_disk" and self.workers is None:
            if "missing" in body["model_path"]:
                return 400, {"success": False, "message": "no such checkpoint", "num_paused_requests": 0}
            self.model_path = body["model_path"]
            if self.busy_after_update:  # SGLang 0.5.23's words (weight_updater.py)
                return 400, {"success": False, "num_paused_requests": 0, "message": (
                    "Weights were updated, but the cache was not flushed because requests are still running "
                    "or queued. Retract or finish them, then call /flush_cache.")}
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        if path.startswith("/flush_cache?timeout=") and self.workers is None:
            return (200, "Cache flushed.\n") if self.idle_within_timeout else (400, "Timed out waiting for idle state.")
        return 404, {"detail": "Not Found"}

    def drops(self, path: str) -> bool:
        """Whether this request is hung up on: every one once `drop_after` /generate requests were
        let through. Counted under the lock: requests arriving together are let through one by one,
        never more than `drop_after` (the check and the count apart let 19 of 24 past a 6)."""
        with self.lock:
            if self.drop_after is None or self.let_through < self.drop_after and path != "/generate":
                return False
            if self.let_through >= self.drop_after:
                return True
            self.let_through += 1
            return False

    def _handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                if stand_in.drops(self.path):
                    self.close_connection = True  # a server that died mid-request: the connection drops
                    return
                if self.path in stand_in.wedged:  # a wedged server: the request is taken, never answered
                    stand_in.requests.append((self.path, body))
                    stand_in.released.wait(600)
                    self.close_connection = True
                    return
                with stand_in.lock:
                    stand_in.in_flight += 1
                    stand_in.most_in_flight = max(stand_in.most_in_flight, stand_in.in_flight)
                time.sleep(stand_in.delay_s)
                status, payload = stand_in.answer(method, self.path, body)
                with stand_in.lock:
                    stand_in.in_flight -= 1
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on it (a stopped collection)
                    pass

            def do_GET(self):
                self._reply("GET")

            def do_POST(self):
                self._reply("POST")

            def log_message(self, *args):
                pass

        return Handler

    def close(self) -> None:
        self.released.set()
        self.http.shutdown()
        self.http.server_close()

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def paths(self, path: str) -> list[dict | None]:
        return [body for p, body in self.requests if p == path]


# ----------------------------------------------------------------------------------------------
# TensorBoard's event files (tracking, eval and run loop tests)


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard logged under `log_dir`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,  # the dev extra
    )

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def ended_pid() -> int:
    """The id of a process of this host that has ended (a writer that is gone, as lock and
    temporary names record one)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid
