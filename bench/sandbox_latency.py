"""Sandbox latency and throughput: the warm pool against a fresh `python -c` per call, side by side.

For each method, in the same run: the median and p95 latency of `print(1)` called one at a time,
and executions per second with `--workers` concurrent callers (the pool's `run_many`; for the
baseline, that many threads each starting `python -c "print(1)"`). The baseline has no isolation
at all, so it is a lower bound on what a non-warm sandbox would cost.

    .venv/bin/python bench/sandbox_latency.py --calls 200 --workers 2 --write-benchmarks

`--write-benchmarks` replaces the "## Sandbox" section of BENCHMARKS.md (other sections untouched).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks_md import write_section  # bench/, beside this script
from rich.console import Console
from rich.table import Table

from cleaner.sandbox import SandboxConfig, make_sandbox

SNIPPET = "print(1)"
SYMPY_SNIPPET = "import sympy\nprint(1)"
SYMPY_CALLS = 10
HEADING = "## Sandbox"


@dataclass(frozen=True)
class Figures:
    method: str
    median_ms: float  # print(1), one call at a time
    p95_ms: float
    executions_per_s: float  # print(1), `workers` concurrent callers
    sympy_median_ms: float  # `import sympy; print(1)`, one call at a time


def _latencies_ms(call: Callable[[], None], calls: int) -> list[float]:
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        latencies.append((time.perf_counter() - started) * 1000.0)
    return latencies


def _throughput(call_many: Callable[[int], None], calls: int) -> float:
    started = time.perf_counter()
    call_many(calls)
    return calls / (time.perf_counter() - started)


def _figures(method: str, latencies_ms: list[float], executions_per_s: float,
             sympy_latencies_ms: list[float]) -> Figures:
    p95_ms = statistics.quantiles(latencies_ms, n=20)[-1]
    return Figures(method, statistics.median(latencies_ms), p95_ms, executions_per_s,
                   statistics.median(sympy_latencies_ms))


def measure_pool(calls: int, workers: int, preload_scientific: bool) -> Figures:
    config = SandboxConfig(workers=workers, preload_scientific=preload_scientific)
    with make_sandbox(config) as sandbox:
        def run(code: str) -> None:
            assert sandbox.run(code).stdout == "1\n"

        for _ in range(10):  # warm-up
            run(SNIPPET)
        latencies_ms = _latencies_ms(lambda: run(SNIPPET), calls)
        rate = _throughput(lambda n: sandbox.run_many([SNIPPET] * n), calls * 2)
        sympy_ms = _latencies_ms(lambda: run(SYMPY_SNIPPET), SYMPY_CALLS)
    preload = "stdlib + numpy + sympy (default)" if preload_scientific else "stdlib"
    return _figures(f"warm pool, {workers} workers, preload {preload}", latencies_ms, rate, sympy_ms)


def measure_subprocess(calls: int, workers: int) -> Figures:
    command = [sys.executable, "-c", SNIPPET]

    def run_one(_: int = 0) -> None:
        assert subprocess.run(command, capture_output=True, check=True).stdout == b"1\n"

    run_one()
    latencies_ms = _latencies_ms(run_one, calls)

    def run_many(n: int) -> None:
        with ThreadPoolExecutor(max_workers=workers) as executor:
            list(executor.map(run_one, range(n)))

    rate = _throughput(run_many, calls)
    sympy_command = [sys.executable, "-c", SYMPY_SNIPPET]
    sympy_ms = _latencies_ms(lambda: subprocess.run(sympy_command, capture_output=True, check=True),
                             SYMPY_CALLS)
    return _figures(f"fresh `python -c`, {workers} threads", latencies_ms, rate, sympy_ms)


def render(figures: list[Figures], command: str) -> str:
    ratio = figures[-1].median_ms / figures[1].median_ms
    load = os.getloadavg()[0]
    lines = [
        HEADING, "",
        f"`print(1)`, measured side by side in one run on {os.cpu_count()} CPU cores (1-minute load "
        f"average {load:.1f} at the end: the machine is shared, so absolute figures are pessimistic):",
        "", "```", command, "```", "",
        "| method | print(1) median ms | p95 ms | executions/s | `import sympy` median ms |",
        "|---|---|---|---|---|",
        *[f"| {f.method} | {f.median_ms:.1f} | {f.p95_ms:.1f} | {f.executions_per_s:.0f} | "
          f"{f.sympy_median_ms:.0f} |" for f in figures],
        "", f"Median print(1) latency ratio, fresh interpreter / warm pool with the default preload: "
        f"{ratio:.1f}x. The pool's figures include the whole confinement (uid drop, limits, workdir, "
        "kill of the uid's processes); the baseline has none. The default "
        "(`preload_scientific=True`) pays for a larger fork on every execution and gets a fast "
        "`import sympy` (last column), which model-written math code does all the time; "
        "`preload_scientific=False` gives the cheapest fork. Target (issue #6): median <= 10 ms "
        "and >= 100 executions/s with 2 workers.", "",
    ]
    return "\n".join(lines)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per method")
    parser.add_argument("--workers", type=int, default=2, help="pool workers / baseline threads")
    parser.add_argument("--write-benchmarks", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    figures = [measure_pool(args.calls, args.workers, preload_scientific=False),
               measure_pool(args.calls, args.workers, preload_scientific=True),
               measure_subprocess(args.calls, args.workers)]
    table = Table("method", "median ms", "p95 ms", "executions/s", "import sympy ms", title="sandbox: print(1)")
    for f in figures:
        table.add_row(f.method, f"{f.median_ms:.1f}", f"{f.p95_ms:.1f}", f"{f.executions_per_s:.0f}",
                      f"{f.sympy_median_ms:.0f}")
    Console().print(table)
    if args.write_benchmarks:
        command = ".venv/bin/python bench/sandbox_latency.py " + shlex.join(sys.argv[1:])
        write_section(HEADING, render(figures, command))


if __name__ == "__main__":
    main()
