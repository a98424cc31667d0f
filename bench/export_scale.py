"""`cleaner export` at warehouse scale: rows per second and peak memory on the synthetic warehouse of
warehouse_scale.py (2,400 collection batches over 8 iterations: 4,800 parts, 1,094,400 segments).

The warehouse is built with the real schemas and part writer (warehouse_scale.build), each
segment's text replaced by the tiny chat format's (a prompt of the tiny template, a call, a tool
response); it holds no saved configs, so the tiny policy's tokenizer and template are given with
`--policy`. The token ids stay random, so every row is built, its prompt recovered, the whole
conversation rendered with the template, tokenised and compared, and it comes out not exact: the
full per-row work. Each
format is exported once by the `cleaner` console script under `/usr/bin/time -f %M` (peak resident
memory of the process, KB), one after the other, into a fresh folder:

    .venv/bin/python bench/export_scale.py --batches 2400 --iterations 8
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import warehouse_scale  # bench/, beside this script
from warehouse_scale import Shape, build

from cleaner.engine.model.chat import format_call, tool_response_text

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "cleaner" / "assets" / "tiny-policy"
FORMATS = (("sft", []), ("preference", []), ("messages", []))
PROMPT = ("<|im_start|>system\nYou solve problems with a Python tool.<|im_end|>\n<|im_start|>user\n"
          "What is 6 * 7?<|im_end|>\n<|im_start|>assistant\n")  # the tiny template's rendering
TEXTS = {"prompt": PROMPT, "assistant": "I will compute it.\n" + format_call("print(6 * 7)"),
         "tool": tool_response_text("Tool call success\nstdout: 42\n")}
_PLAIN_BATCH = warehouse_scale._batch


def _chat_batch(rng, iteration: int, batch: int, shape: Shape) -> tuple[pa.Table, pa.Table]:
    """warehouse_scale's batch with the chat format's text in every segment."""
    segments, rollouts = _PLAIN_BATCH(rng, iteration, batch, shape)
    texts = pa.array([TEXTS[kind] for kind in segments.column("kind").to_pylist()])
    return segments.set_column(segments.schema.get_field_index("text"), "text", texts), rollouts


warehouse_scale._batch = _chat_batch  # build() makes its batches with it


def export(warehouse: Path, out: Path, iterations: int, form: str, extra: list[str]) -> dict:
    """One export under /usr/bin/time: its wall seconds, peak RSS (MB) and the rows it wrote."""
    cleaner = Path(sys.executable).parent / "cleaner"
    command = ["/usr/bin/time", "-f", "peak_kb=%M wall_s=%e", str(cleaner), "export", "-w", str(warehouse),
               "--iteration", ",".join(map(str, range(iterations))), "--format", form, "--out", str(out),
               "--policy", str(POLICY), *extra]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0:
        raise SystemExit(f"export failed:\n{done.stderr[-2000:]}")
    peak = int(re.search(r"peak_kb=(\d+)", done.stderr).group(1))
    wall = float(re.search(r"wall_s=([\d.]+)", done.stderr).group(1))
    rows = int(re.search(r"([\d,]+) rows from", done.stdout).group(1).replace(",", ""))
    return {"form": form, "rows": rows, "wall_s": wall, "peak_mb": peak / 1024, "command": " ".join(command[3:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2400, help="collection batches (2 parts each)")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--rollouts-per-batch", type=int, default=24)
    parser.add_argument("--turns", type=int, default=9, help="assistant/tool pairs per rollout")
    parser.add_argument("--mean-tokens", type=int, default=28)
    parser.add_argument("--dir", type=Path, default=None, help="build here (default: a temporary directory)")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="export-scale-", dir=args.dir))
    try:
        started = time.perf_counter()
        build(base / "wh", args.batches, args.iterations, Shape(args.rollouts_per_batch, args.turns, args.mean_tokens))
        segments = args.batches * args.rollouts_per_batch * (1 + 2 * args.turns)
        print(f"built {2 * args.batches} parts, {segments:,} segments in {time.perf_counter() - started:.1f} s")
        for form, extra in FORMATS:
            result = export(base / "wh", base / form, args.iterations, form, extra)
            rollouts = args.batches * args.rollouts_per_batch
            print(f"{form}: {result['rows']:,} rows from {rollouts:,} rollouts in {result['wall_s']:.1f} s "
                  f"({rollouts / result['wall_s']:,.0f} rollouts/s, {result['rows'] / result['wall_s']:,.0f} rows/s), "
                  f"peak RSS {result['peak_mb']:,.0f} MB; shards: {len(list((base / form / 'data').iterdir()))}")
            shutil.rmtree(base / form)
        print(f"load average: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    finally:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
