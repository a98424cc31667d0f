"""Peak memory of one train micro batch at real shapes: the full-logits step vs cleaner's train step.

A Qwen3-architecture proxy with the real vocabulary (151,936 tokens; hidden 256, 2 layers, random
weights, tied embeddings) trains one micro batch of two rows, T and T/4 tokens, with the KL term on
(a reference model of the same shape), forward and backward. Each probe runs in a fresh process and
reports its peak resident memory (ru_maxrss), the loss and the gradient norm, so the paths are
compared side by side in one run:
  full        the plain step (`cleaner/engine/train/naive.py`): right-padded rows, (B, T, V) logits
  chunked     cleaner's step: packed rows, log-probs and entropy from hidden states in chunks
  chunked+gc  the same with --gradient-checkpointing
  chunked+bf16  the same with --compute-dtype bfloat16 (`--paths` adds it: this CPU has no
                bfloat16 matmul, so autocast there is emulated and takes many minutes per probe)
The full path grows with T x V, so it only runs up to --full-max-tokens (it needs ~8 GB per 1,024
tokens here); the others run at every T.

    .venv/bin/python bench/train_memory.py --tokens 1024,2048,4096,8192,16384 --write-benchmarks
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REAL_VOCAB = 151_936
SETUP = ("One micro batch of two rows (T and T/4 tokens) through forward and backward with the KL term on,"
         " on a Qwen3 proxy with the real 151,936-token vocabulary (hidden 256, 2 layers, float32, CPU),"
         " each probe in a fresh process; peak = its maximum resident memory, which includes the ~0.5 GB"
         " of Python, torch and the two models. `full` is the plain step (padded rows, (B, T, V) logits,"
         " `cleaner/engine/train/naive.py`); `chunked` is cleaner's (packed rows, log-probs from hidden"
         " states a 1,024-token chunk of the lm_head at a time); `+gc` adds --gradient-checkpointing. The"
         " loss and gradient norm columns show the two paths computing the same step.")
PATHS = {"full": {}, "chunked": {}, "chunked+gc": {"gradient_checkpointing": True},
         "chunked+bf16": {"compute_dtype": "bfloat16"}}


def proxy(seed: int, vocab_size: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=65536)
    return Qwen3ForCausalLM(config)


def rows(tokens: int, vocab_size: int):
    import torch

    from cleaner.records import PurifiedRow

    generator = torch.Generator().manual_seed(0)
    made = []
    for index, length in enumerate((tokens, max(tokens // 4, 2))):
        ids = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        prompt = length // 8
        made.append(PurifiedRow(
            config_id="bench", iteration=0, rollout_id=f"r{index}", group_id="g", token_ids=tuple(ids),
            prompt_len=prompt, loss_mask=(0,) * prompt + (1,) * (length - prompt),
            behavior_logprobs=(0.0,) * length, old_logprobs=(-12.0,) * length, reward=float(index),
            advantage=1.0 - 2 * index, rolled_back=False, n_shallow=0, n_deep=0, n_unrecovered=0,
            tokens_removed=0, scorer_version="bench"))
    return made


def probe(path: str, tokens: int, vocab_size: int) -> dict:
    """One micro batch forward and backward in this process; its peak memory, loss and grad norm."""
    import torch

    from cleaner.config import TrainConfig
    from cleaner.engine.train.naive import full_logits_micro_batch_loss
    from cleaner.engine.train.packing import loss_token_count, pack_rows
    from cleaner.engine.train.policy import TrainablePolicy, training
    from cleaner.engine.train.step import forward_micro_batch

    torch.set_num_threads(1)
    config = TrainConfig(kl_coef=0.1, **PATHS[path])
    model, reference = proxy(0, vocab_size), proxy(1, vocab_size).eval().requires_grad_(False)
    batch_rows = rows(tokens, vocab_size)
    total = sum(loss_token_count(row) for row in batch_rows)
    started = time.perf_counter()
    if path == "full":
        model.train()
        part = full_logits_micro_batch_loss(model, reference, batch_rows, config, total)
        part.loss.backward()
    else:
        policy = TrainablePolicy(model, config)
        with training(policy, config):
            part = forward_micro_batch(policy, TrainablePolicy(reference, config), pack_rows(batch_rows),
                                       config, total)
            part.loss.backward()
    seconds = time.perf_counter() - started
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    return {"path": path, "tokens": tokens, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": seconds, "loss": part.loss.item(), "entropy": part.entropy, "grad_norm": grad_norm}


def run_probe(path: str, tokens: int, vocab_size: int) -> dict:
    done = subprocess.run([sys.executable, __file__, "--probe", path, "--tokens", str(tokens),
                           "--vocab-size", str(vocab_size)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"path": path, "tokens": tokens, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict], tokens: list[int]) -> str:
    by = {(r["path"], r["tokens"]): r for r in results}
    paths = list(dict.fromkeys(r["path"] for r in results))
    lines = ["| T (rows T + T/4) | " + " | ".join(f"{p} peak GB" for p in paths) + " | full / chunked |"
             + " loss: full, chunked | grad norm: full, chunked |",
             "| --- |" + " --- |" * (len(paths) + 3)]
    for count in tokens:
        cells = []
        for path in paths:
            result = by.get((path, count))
            cells.append(f"{result['peak_mb'] / 1024:.2f}" if result and "peak_mb" in result else "-")
        full, chunked = by.get(("full", count)), by.get(("chunked", count))
        both = full and chunked and "peak_mb" in full and "peak_mb" in chunked
        ratio = f"{full['peak_mb'] / chunked['peak_mb']:.1f}x" if both else "-"
        losses = f"{full['loss']:.6f}, {chunked['loss']:.6f}" if both else "-"
        norms = f"{full['grad_norm']:.6f}, {chunked['grad_norm']:.6f}" if both else "-"
        lines.append(f"| {count:,} | " + " | ".join(cells) + f" | {ratio} | {losses} | {norms} |")
    return "\n".join(lines)


def growth(results: list[dict]) -> str:
    """Each path's peak growth per 1,024 tokens, between its smallest and largest T."""
    parts = []
    for path in dict.fromkeys(r["path"] for r in results):
        runs = sorted((r["tokens"], r["peak_mb"]) for r in results if r["path"] == path and "peak_mb" in r)
        if len(runs) >= 2:
            (t0, m0), (t1, m1) = runs[0], runs[-1]
            parts.append(f"{path} {(m1 - m0) / (t1 - t0) * 1024 / 1024:.3f} GB (T {t0:,} to {t1:,})")
    return "Peak growth per 1,024 tokens of T: " + "; ".join(parts) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1024,2048,4096,8192,16384", help="T values, comma-separated")
    parser.add_argument("--vocab-size", type=int, default=REAL_VOCAB)
    parser.add_argument("--full-max-tokens", type=int, default=2048, help="largest T the full-logits path runs at")
    parser.add_argument("--paths", default="full,chunked,chunked+gc")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--write-benchmarks", action="store_true", help="replace BENCHMARKS.md's section")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, int(args.tokens), args.vocab_size)))
        return
    tokens = [int(t) for t in args.tokens.split(",")]
    results = []
    for count in tokens:
        for path in args.paths.split(","):
            if path == "full" and count > args.full_max_tokens:
                continue
            result = run_probe(path, count, args.vocab_size)
            print(json.dumps(result), flush=True)
            results.append(result)
    text = table(results, tokens) + "\n\n" + growth(results)
    print(text)
    if args.write_benchmarks:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from benchmarks_md import write_section

        heading = "## Training at real shapes: peak memory of one micro batch"
        command = (f"    .venv/bin/python bench/train_memory.py --tokens {args.tokens} --paths {args.paths}"
                   f" --full-max-tokens {args.full_max_tokens} --write-benchmarks")
        write_section(heading, f"{heading}\n\n{command}\n\n{SETUP}\n\n{text}\n")


if __name__ == "__main__":
    main()
