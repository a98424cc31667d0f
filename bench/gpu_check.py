"""The train step on a lent GPU at real shapes, in one short run (`make gpu-check`, under 8 minutes).

1. Equality: cleaner's chunked step against the full-logits step on a Qwen3-0.6B-shaped random
   model in float32 (TF32 off) at a small T: loss and gradient norm.
2. Scale: the step with gradient checkpointing at T = 16,384 and 32,768 (rows T and T/4, the KL
   term's reference computed before, as the trainer does) in bfloat16 (fp32 master weights) and in
   float32, each ending with cleaner's AdamW step (fused on a GPU): peak CUDA memory split into
   static (weights and AdamW moments) and the step above it, tokens per second, timed on the second
   of two steps; beside them, the step without checkpointing at 16,384, and the full-logits step in
   bfloat16 at 16,384 where it fits (the baseline: (B, T, V) logits).
3. Co-located: collect -> train -> collect with the SGLang engine and the trainer on the one GPU
   (bench/gpu_colocated.py): peak memory of each phase, tokens/s of each collection. It needs sglang,
   duckdb and polars; where they are missing (the lent device's image) it says so in the report.
Every probe is bench/train_memory.py's, in a fresh process. The device image has torch with CUDA,
transformers and pyarrow, not polars, duckdb, deepspeed or sglang: nothing here imports them
(tests/bench/test_gpu_check.py runs this script on CPU with them hidden). Results: one JSON line per
probe on stdout, and gpu_check.json and gpu_check.md in --out ($OUT when set).

    python3 bench/gpu_check.py            # what `make gpu-check` runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside this one
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # cleaner from this checkout: no PYTHONPATH
from train_memory import REAL_VOCAB, SHAPES, run_probe  # noqa: E402

MIN_TRANSFORMERS = (5, 0)  # the packed attention registers with AttentionInterface (transformers 5)


def check_transformers() -> None:
    """One line and exit 1 where transformers is missing or older than the train step needs."""
    try:
        import transformers
    except ImportError:
        sys.exit("error: gpu check: transformers is not installed here; pip install 'transformers>=5.0'")
    found = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if found < MIN_TRANSFORMERS:
        sys.exit(f"error: gpu check: transformers {transformers.__version__} is installed; the train step "
                 f"needs {'.'.join(map(str, MIN_TRANSFORMERS))} or newer (pip install 'transformers>=5.0')")

LOSS_ATOL = 1e-4  # float32 on a GPU, 28 layers: reductions run in another order than the full path's
GRAD_NORM_RTOL = 1e-3


def plan(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(path, T, repeat) of every probe, in order."""
    probes = [("full", args.small_tokens, 1), ("chunked", args.small_tokens, 1)]
    for count in args.tokens:
        probes.append(("chunked+gc+bf16", count, 2))
    probes.append(("chunked+bf16", args.tokens[0], 2))
    for count in args.tokens:
        probes.append(("chunked+gc", count, 2))
    probes.append(("full+bf16", args.tokens[0], 2))
    return probes


def markdown(results: list[dict], args: argparse.Namespace, equal: dict) -> str:
    device = next((r["device"] for r in results if "device" in r), "?")
    lines = [f"Device: {device}; shape {args.shape} (vocabulary {args.vocab:,}); "
             f"`python bench/gpu_check.py {' '.join(sys.argv[1:])}`".rstrip(),
             "",
             f"Equality at T={args.small_tokens:,} (float32, TF32 off): loss full {equal.get('full_loss')}, "
             f"chunked {equal.get('chunked_loss')}; grad norm full {equal.get('full_grad_norm')}, chunked "
             f"{equal.get('chunked_grad_norm')}: {'equal' if equal.get('holds') else 'NOT equal'} "
             f"(loss within {LOSS_ATOL:g}, grad norm within {GRAD_NORM_RTOL:g} relative)",
             "",
             "| path | T (rows T + T/4) | AdamW step | peak CUDA GB | static GB | step above static GB | "
             "tokens/s | seconds | loss |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['path']} | {r['tokens']:,} | - | {r['error']} | - | - | - | - | - |")
            continue
        static, above = r.get("static_mb"), r.get("step_above_static_mb")
        lines.append(f"| {r['path']} | {r['tokens']:,} | {'yes' if r.get('optimizer') else 'no'} | "
                     f"{r.get('cuda_peak_mb', 0) / 1024:.2f} | {'-' if static is None else f'{static / 1024:.2f}'} | "
                     f"{'-' if above is None else f'{above / 1024:.2f}'} | {r['tokens_per_s']:,.0f} | "
                     f"{r['seconds']:.2f} | {r['loss']:.6f} |")
    return "\n".join(lines) + "\n"


def colocated(args: argparse.Namespace) -> str:
    """bench/gpu_colocated.py in a process of its own; its report, or why it failed."""
    import subprocess

    script = Path(__file__).resolve().parent / "gpu_colocated.py"
    try:
        done = subprocess.run([sys.executable, str(script), "--device", args.device, "--out", str(args.out)],
                              capture_output=True, text=True, timeout=args.colocated_timeout_s)
    except subprocess.TimeoutExpired:
        return f"Co-located collect -> train -> collect: timed out after {args.colocated_timeout_s:.0f} s.\n"
    report = Path(args.out) / "gpu_colocated.md"
    if done.returncode != 0 or not report.exists():
        return f"Co-located collect -> train -> collect: failed ({done.returncode}): {done.stderr[-1500:]}\n"
    return report.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--vocab", type=int, default=REAL_VOCAB)
    parser.add_argument("--tokens", default="16384,32768", help="T of the bfloat16 probes, comma-separated")
    parser.add_argument("--small-tokens", type=int, default=512, help="T of the equality check")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="per probe")
    parser.add_argument("--colocated-timeout-s", type=float, default=240.0, help="the co-located run")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-check"))
    args = parser.parse_args()
    check_transformers()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    started = time.perf_counter()
    results = []
    for path, count, repeat in plan(args):
        optimizer = path not in ("full", "chunked")  # the equality pair compares gradients, not a step
        result = run_probe(path, count, args.vocab, args.shape, args.device, repeat, timeout_s=args.timeout_s,
                           optimizer=optimizer)
        print(json.dumps(result), flush=True)
        results.append(result)
    full, chunked = results[0], results[1]
    equal = {"holds": False}
    if "loss" in full and "loss" in chunked:
        equal = {"full_loss": full["loss"], "chunked_loss": chunked["loss"],
                 "full_grad_norm": full["grad_norm"], "chunked_grad_norm": chunked["grad_norm"],
                 "holds": abs(full["loss"] - chunked["loss"]) <= LOSS_ATOL
                 and abs(full["grad_norm"] - chunked["grad_norm"]) <= GRAD_NORM_RTOL * abs(full["grad_norm"])}
    text = markdown(results, args, equal)
    text += "\n" + colocated(args)
    text += f"\nWall time of the check: {time.perf_counter() - started:.0f} s\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"probes": results, "equality": equal}, indent=1) + "\n")
    (out / "gpu_check.md").write_text(text)
    failed = [r for r in results if "error" in r and not r["path"].startswith("full+")]  # the baseline may not fit
    if failed or not equal["holds"]:
        sys.exit(f"error: gpu check failed: {len(failed)} probe(s) failed, equality {equal['holds']}")


if __name__ == "__main__":
    main()
