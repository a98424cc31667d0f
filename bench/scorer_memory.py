"""Peak memory and time of purify's prefix-trie scorer at real shapes, one probe per process.

The issue's proxy (Qwen3 architecture, hidden 256, intermediate 768, 2 layers, 4 heads, 2 KV heads,
head_dim 64, untied, the real 151,936-token vocabulary, float32, random weights made in memory)
scores `--rows` rows of `--tokens` tokens that share a 512-token prompt, every position after it
scored, with the scorer's GPU sizes (8,192-token attention batches, 2,048-token pieces, 4 batches a
forward) or its CPU sizes (2,048 and 64). Peak = the process's maximum resident memory (ru_maxrss),
which includes ~0.6 GB of Python, torch and the model. `--source DIR` runs the scorer of another
source tree (the one before this change: its head materialised every needed position's logits in
one float32 tensor), so the two are measured side by side in one run.

    .venv/bin/python bench/scorer_memory.py --rows 4 --tokens 8192 --sizes gpu
    .venv/bin/python bench/scorer_memory.py --rows 4 --tokens 8192 --sizes gpu --source /tmp/cleaner-before
    .venv/bin/python bench/scorer_memory.py --rows 1 --tokens 16384 --sizes cpu
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """
import json, random, resource, sys, time, torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from cleaner.engine.model.trie_scorer import PrefixTrieScorer
import cleaner
rows, tokens, sizes, vocab, check = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
torch.manual_seed(0)
config = Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
                     max_position_embeddings=65536, attn_implementation="sdpa")
model = Qwen3ForCausalLM(config).eval()
rng = random.Random(0)
prompt = [rng.randrange(vocab) for _ in range(512)]
sequences = [prompt + [rng.randrange(vocab) for _ in range(tokens - 512)] for _ in range(rows)]
batch, edge = (8192, 2048) if sizes == "gpu" else (2048, 64)
scorer = PrefixTrieScorer(model, max_batch_tokens=batch, max_edge_tokens=edge)
started = time.perf_counter()
scored = scorer.score_rows(sequences, [512] * rows)
seconds = time.perf_counter() - started
peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
out = {"tree": cleaner.__file__.rsplit("/", 2)[0], "rows": rows, "tokens": tokens, "sizes": sizes, "peak_gib": peak_gib, "seconds": seconds,
       "scored": sum(len(r) for r in scored), "first": scored[0][:3], "last": scored[-1][-3:]}
if check:  # a naive forward of the last row, its logits whole (only where that fits)
    with torch.inference_mode():
        ids = torch.tensor([sequences[-1]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        naive = (logits.gather(-1, ids[0, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1))[511:]
    out["max_diff_vs_naive"] = max(abs(a - b) for a, b in zip(scored[-1], naive.tolist()))
print(json.dumps(out))
"""


def probe(rows: int, tokens: int, sizes: str, vocab: int, source: Path | None, check: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source or Path(__file__).resolve().parents[1])}
    # cwd: a directory without a `cleaner` of its own (`python -c` puts the cwd first on sys.path)
    done = subprocess.run([sys.executable, "-c", PROBE, str(rows), str(tokens), sizes, str(vocab), str(int(check))],
                          env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        return {"rows": rows, "tokens": tokens, "sizes": sizes, "error": done.stderr.strip().splitlines()[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--sizes", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--source", type=Path, help="another source tree's scorer (the one before)")
    parser.add_argument("--check", action="store_true", help="also a naive forward of the last row")
    args = parser.parse_args(argv)
    result = probe(args.rows, args.tokens, args.sizes, args.vocab, args.source, args.check)
    result["source"] = str(args.source) if args.source else "this tree"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
