"""Train step time and peak memory with and without LoRA, side by side in one run (issue #51's
point 7; docs/running.md, "LoRA").

bench/train_memory.py's probe, each in a fresh process: a Qwen3-architecture proxy with the real
151,936-token vocabulary (`--shape proxy`: hidden 256, 2 layers, untied embeddings; random weights),
one micro batch of two rows (T and T/4 tokens), forward and backward with the KL term on, then
cleaner's AdamW step, twice (the second timed, its moments already there). `full` trains every
weight: its KL reference is a second model whose log-probs are computed before the policy is built
(step.ReferenceLogProbs), and AdamW holds two moments of every weight. `lora` trains rank-8 adapters
on every linear layer: no gradient or moment for the base, and the KL reference is the same model
with the adapters disabled (no second copy). Peak = the process's maximum resident memory
(ru_maxrss, which includes Python, torch and the model); the target is a LoRA step's peak at most
0.6x the full step's.

    .venv/bin/python bench/lora_memory.py --tokens 1024,4096,16384
    .venv/bin/python bench/lora_memory.py --tokens 1024,4096,16384 --write-benchmarks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside this one
from train_memory import REAL_VOCAB, SHAPES, run_probe  # noqa: E402

TARGET_RATIO = 0.6  # a LoRA step's peak over the full step's, at most
HEADING = "## LoRA: train step time and peak memory with and without adapters"


def measure(tokens: list[int], vocab: int, shape: str, checkpointing: bool, device: str) -> list[dict]:
    """The full and the LoRA probe at each T, in that order; each a JSON row (an error is a row)."""
    base = "chunked+gc" if checkpointing else "chunked"
    results = []
    for count in tokens:
        for name, path in (("full", base), ("lora", f"{base}+lora")):
            result = {**run_probe(path, count, vocab, shape, device, repeat=2, optimizer=True, kl=True), "arm": name}
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


def table(results: list[dict]) -> str:
    by = {(r["arm"], r["tokens"]): r for r in results}
    lines = ["| T (rows T + T/4) | full peak GB | LoRA peak GB | LoRA / full | full s | LoRA s | LoRA trains | "
             "base unchanged | target (<= 0.6x) |", "| --- |" + " --- |" * 8]
    for count in sorted({r["tokens"] for r in results}):
        full, lora = by.get(("full", count), {}), by.get(("lora", count), {})
        if "peak_mb" not in full or "peak_mb" not in lora:
            lines.append(f"| {count:,} | {full.get('error', '-')} | {lora.get('error', '-')} | - | - | - | - | - | - |")
            continue
        ratio = lora["peak_mb"] / full["peak_mb"]
        lines.append(f"| {count:,} | {full['peak_mb'] / 1024:.2f} | {lora['peak_mb'] / 1024:.2f} | {ratio:.2f} | "
                     f"{full['seconds']:.1f} | {lora['seconds']:.1f} | {lora['trainable']:,} of "
                     f"{lora['parameters']:,} | {'yes' if lora.get('base_unchanged') else 'NO'} | "
                     f"{'holds' if ratio <= TARGET_RATIO else 'does not hold'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,4096,16384", help="T values, comma-separated")
    parser.add_argument("--vocab", type=int, default=REAL_VOCAB)
    parser.add_argument("--shape", choices=list(SHAPES), default="proxy")
    parser.add_argument("--no-gradient-checkpointing", dest="checkpointing", action="store_false",
                        help="both arms without --gradient-checkpointing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write-benchmarks", action="store_true", help="replace BENCHMARKS.md's section")
    args = parser.parse_args(argv)
    results = measure([int(t) for t in args.tokens.split(",")], args.vocab, args.shape, args.checkpointing,
                      args.device)
    text = table(results)
    print(text)
    if args.write_benchmarks:
        from benchmarks_md import write_section

        command = (f"    .venv/bin/python bench/lora_memory.py --tokens {args.tokens} --shape {args.shape}"
                   f"{'' if args.checkpointing else ' --no-gradient-checkpointing'} --write-benchmarks")
        setup = __doc__.split("\n\n")[1].replace("\n", " ")
        write_section(HEADING, f"{HEADING}\n\n{command}\n\n{setup}\n\n{text}\n")


if __name__ == "__main__":
    main()
