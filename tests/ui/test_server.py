"""`cleaner ui` as a process, over HTTP: a runaway query in the SQL box holds up no page.

The acceptance test of the browser's concurrency: a real `cleaner ui` (uvicorn, its thread pool,
the two DuckDB databases), one request running a query that would take hours, and the pages a user
opens meanwhile, each timed.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from cleaner.warehouse import Warehouse
from tests.factories import make_rollout, make_segments
from tests.helpers import cli

RUNAWAY = "SELECT count(*) FROM range(1000000000000) t(a) WHERE a % 7 = 3"  # hours on one thread


def _get(url: str, timeout_s: float = 60) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def server(tmp_path):
    """A `cleaner ui` process on a free port over a two-rollout warehouse; its base URL."""
    warehouse = Warehouse(tmp_path / "wh")
    warehouse.write_rollouts(0, [make_rollout("r0"), make_rollout("r1", reward=0.0)],
                             make_segments("r0") + make_segments("r1"))
    process = subprocess.Popen(cli("ui", "-w", str(warehouse.root), "--port", "0"), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    assert line.startswith("serving "), line
    url = line.split(" at ")[1].strip().rstrip("/")
    deadline = time.monotonic() + 30
    while True:  # the port is bound when the line is printed; uvicorn accepts a moment later
        try:
            _get(url + "/static/style.css", timeout_s=5)
            break
        except urllib.error.URLError:
            assert time.monotonic() < deadline and process.poll() is None, "cleaner ui never answered"
            time.sleep(0.1)
    yield url
    os.kill(process.pid, signal.SIGKILL)  # the runaway query would hold a graceful shutdown 30 s
    process.wait()
    process.stdout.close()


def _run_runaway(url: str) -> None:
    """The runaway request; the fixture kills the server while it waits, which ends it."""
    with contextlib.suppress(ConnectionError, http.client.HTTPException, urllib.error.URLError):
        _get(url)


def _start_runaway(server: str) -> threading.Thread:
    runaway = threading.Thread(target=_run_runaway, args=(f"{server}/sql?" + urllib.parse.urlencode({"q": RUNAWAY}),),
                               daemon=True)
    runaway.start()
    return runaway


def test_pages_are_served_at_once_while_a_runaway_query_runs(server):
    runaway = _start_runaway(server)
    deadline = time.monotonic() + 30
    while True:  # until the box says it is busy: the runaway query runs
        time.sleep(0.2)
        status, body = _get(f"{server}/sql?q=SELECT+1")
        if status == 429:
            break
        assert status == 200 and time.monotonic() < deadline, (status, body)
        if not runaway.is_alive():  # this probe held the box when it arrived: it was refused
            runaway = _start_runaway(server)
    assert "another query is running" in body
    for page, says in (("/rollouts/r0", "r0"), ("/", "overview"), ("/rollouts", "r1"), ("/rollouts/r1", "r1")):
        started = time.monotonic()
        status, body = _get(server + page, timeout_s=10)
        seconds = time.monotonic() - started
        assert status == 200 and says in body, (page, status)
        assert seconds < 5, f"{page} took {seconds:.1f} s while the runaway query ran"  # it runs 30 s
    started = time.monotonic()
    assert _get(f"{server}/sql.csv?q=SELECT+2")[0] == 429  # not queued behind it
    assert time.monotonic() - started < 5
    assert runaway.is_alive()  # it was running all along
