"""`cleaner ui` on the 1.1M-segment warehouse of bench/warehouse_scale.py: how long its pages take.

Builds (or reuses, with --dir) the synthetic warehouse of `warehouse_scale.py` (2,400 collection
batches over 8 iterations: 4,800 parts, about 1.1M segments), purifies its iteration 0 under the
default config with the real renderer (`render_iteration`: one part, as `cleaner purify` writes),
then serves it with the app in process (Starlette's TestClient: routing, the reads and the
templates, without a socket) and times, each `--repeats` times, medians and maxima:
- the snapshot: `Browser(...)`, i.e. `connect()` of the read-only warehouse plus the rollout index:
  with no manifest on disk (every footer validated: a read-only reader never writes one), with the
  manifest a writing reader (`cleaner sql`) leaves, and `refresh()` of a running browser (its
  manifest kept in memory);
- the rollout list's first page, unfiltered; a deep page filtered by error type; a class filter;
- a rollout page (raw beside its purified row), of a different rollout each time.

    .venv/bin/python bench/ui_latency.py

The target is under 1 s for the list's first page and for a rollout page.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from starlette.testclient import TestClient
from warehouse_scale import Shape, build  # bench/, beside this script

from cleaner.config import PurifyConfig
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.records import PurifyConfigRow
from cleaner.ui.app import create_app
from cleaner.warehouse import Warehouse
from cleaner.warehouse.browse import Browser, RolloutFilter

TARGET_S = 1.0


def purify_iteration_0(root: Path) -> int:
    """Iteration 0's rows under the default config, rendered by the real pipeline, in one part."""
    warehouse = Warehouse(root)
    rollouts = warehouse.read_rollouts(0)
    config = PurifyConfig()
    rows, _ = render_iteration(rollouts, warehouse.read_segments(0), config, None)
    warehouse.write_purified(0, PurifyConfigRow(config.config_id, config.gamma, config.rollback_prob,
                                                config.similarity_on, config.purify_when, config.to_json()), rows)
    return len(rows)


def seconds(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def timed(client: TestClient, url: str) -> float:
    started = time.perf_counter()
    response = client.get(url)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise AssertionError(f"{url}: {response.status_code} {response.text[:300]}")
    return seconds


def line(name: str, seconds: list[float], target: float | None = None) -> str:
    verdict = "" if target is None else (" | yes" if max(seconds) < target else " | NO")
    return f"| {name} | {statistics.median(seconds):.3f} | {max(seconds):.3f} | {len(seconds)}{verdict} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2400)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=None, help="an existing warehouse_scale warehouse to reuse")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = None
    if args.dir is None:
        base = Path(tempfile.mkdtemp(prefix="ui-latency-"))
        root = base / "wh"
        build(root, args.batches, args.iterations, Shape(24, 9, 28))
    else:
        root = args.dir
    try:
        if not (root / "purified").exists():
            print(f"purified iteration 0: {purify_iteration_0(root)} rows")
        had_manifest = (root / ".manifest").exists()
        cold = seconds(lambda: Browser(Warehouse(root, read_only=True)).close())
        Warehouse(root).connect().close()  # what any writing reader leaves: the manifest
        with_manifest = [seconds(lambda: Browser(Warehouse(root, read_only=True)).close()) for _ in range(3)]
        connect_only = [seconds(lambda: Warehouse(root, read_only=True).connect().close()) for _ in range(3)]
        browser = Browser(Warehouse(root, read_only=True))
        refreshes = [seconds(browser.refresh) for _ in range(3)]
        client = TestClient(create_app(browser), base_url="http://127.0.0.1")
        total = browser.count(RolloutFilter())
        errors = browser.facets().error_types
        ids = [row.rollout_id for row in browser.list_rollouts(RolloutFilter(iteration=0), 0, 7200).rows]
        rng = random.Random(args.seed)
        timings: dict[str, list[float]] = {"list": [], "error": [], "class": [], "rollout": []}
        for _ in range(args.repeats):  # interleaved, so load changes hit every page alike
            timings["list"].append(timed(client, "/rollouts"))
            timings["error"].append(timed(client, f"/rollouts?error_type={errors[0]}&offset={rng.randrange(0, 20000)}"))
            timings["class"].append(timed(client, "/rollouts?class=unrecovered&iteration=3"))
            timings["rollout"].append(timed(client, f"/rollouts/{rng.choice(ids)}"))
        print(f"\n{total:,} rollouts indexed. Snapshot (connect + index): {cold:.2f} s "
              f"{'(a manifest was on disk)' if had_manifest else 'with no manifest on disk'}; "
              f"{statistics.median(with_manifest):.2f} s with one (median of 3; connect() alone "
              f"{statistics.median(connect_only):.2f} s); refresh() {statistics.median(refreshes):.2f} s")
        print("\n| page | median s | max s | requests | max < 1 s |")
        print("|---|---|---|---|---|")
        print(line("rollout list, first page (`/rollouts`)", timings["list"], TARGET_S))
        print(line("rollout page (`/rollouts/<id>`, raw + purified row)", timings["rollout"], TARGET_S))
        print(line(f"list filtered by error type ({errors[0]}), a deep page", timings["error"]))
        print(line("list filtered by class and iteration", timings["class"]))
        print(f"\nload average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        browser.close()
    finally:
        if base is not None:
            shutil.rmtree(base)


if __name__ == "__main__":
    main()
