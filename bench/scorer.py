"""Prefix-trie scorer vs naive full forwards, side by side in one run (docs/architecture.md §6).

Rows are either synthetic (groups of G rows sharing a P-token prompt; a share of the rows copy a
random-length prefix of an earlier row's response before diverging, as renderings of one rollout
do) or the purified rows of one iteration and config of a warehouse. Both scorers see the same rows
on the same model; we report tokens forwarded, wall time (best of --repeats, the two scorers
alternating within each round) and the largest absolute difference between the two. Without
--config-id, a warehouse gives every config's rows of the iteration, as one purify pass scores them.

With --sglang (in .venv-sglang, `make sglang-cpu`), the same rows are also scored once through a
real in-process SGLang engine on CPU (purify's BackendScorer: one request per radix-tree edge):
the tokens the engine says it computed (prompt tokens minus `cached_tokens`, summed over the
requests) beside the trie's, and the largest difference from the naive forward.

    .venv/bin/python bench/scorer.py --prompts 8 --group-size 8 --prompt-len 256 --response-len 256
    .venv/bin/python bench/scorer.py --warehouse runs/w --iteration 0 --config-id abc123 --model cleaner/assets/tiny-policy
    .venv-sglang/bin/python bench/scorer.py --warehouse runs/w --model cleaner/assets/tiny-policy --sglang
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.engine.model.trie_scorer import PrefixTrieScorer


@dataclass(frozen=True)
class Rows:
    sequences: list[list[int]]
    starts: list[int]


# ---------------------------------------------------------------------------- rows


def synthetic_rows(args: argparse.Namespace, vocab_size: int) -> Rows:
    rng = random.Random(args.seed)
    sequences, starts = [], []
    for _ in range(args.prompts):
        prompt = [rng.randrange(vocab_size) for _ in range(args.prompt_len)]
        responses: list[list[int]] = []
        for _ in range(args.group_size):
            length = rng.randint(max(1, args.response_len // 2), args.response_len)
            copied = []
            if responses and rng.random() < args.share:
                source = rng.choice(responses)
                copied = source[: rng.randrange(len(source))]
            response = (copied + [rng.randrange(vocab_size) for _ in range(length)])[: max(length, len(copied) + 1)]
            responses.append(response)
            sequences.append(prompt + response)
            starts.append(len(prompt))
    return Rows(sequences, starts)


def warehouse_rows(args: argparse.Namespace) -> Rows:
    from cleaner.warehouse.store import Warehouse

    warehouse = Warehouse(args.warehouse)
    config_ids = [args.config_id] if args.config_id else [
        config_id for (config_id,) in warehouse.connect().sql(
            f"SELECT DISTINCT config_id FROM purified WHERE iteration = {int(args.iteration)} ORDER BY 1").fetchall()]
    purified = [row for config_id in config_ids for row in warehouse.read_purified(args.iteration, config_id)]
    if not purified:
        raise SystemExit(f"{args.warehouse}: no purified rows for iteration {args.iteration}, config {args.config_id}")
    return Rows([list(r.token_ids) for r in purified], [max(1, r.prompt_len) for r in purified])


def tiny_model_dir(directory: Path, seed: int) -> Path:
    """A random Qwen3 with the shape of the default policy (hidden 128, 2 layers, 512 vocab)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------- measure


def interleaved_best_times(functions, repeats: int) -> tuple[list[float], list[object]]:
    """Best wall time of each function over `repeats` rounds, alternating them within a round
    so that load from other processes hits both alike."""
    best, results = [float("inf")] * len(functions), [None] * len(functions)
    for _ in range(repeats):
        for index, function in enumerate(functions):
            began = time.perf_counter()
            results[index] = function()
            best[index] = min(best[index], time.perf_counter() - began)
    return best, results


def run(args: argparse.Namespace, model_path: Path) -> None:
    backend = TorchBackend(model_path, device=args.device, max_batch_tokens=args.max_batch_tokens)
    rows = warehouse_rows(args) if args.warehouse else synthetic_rows(args, backend.model.config.vocab_size)
    scorer = PrefixTrieScorer(backend.model, args.device, max_batch_tokens=args.max_batch_tokens)
    (naive_s, trie_s), (naive, trie) = interleaved_best_times(
        [lambda: backend.score(rows.sequences, rows.starts),
         lambda: scorer.score_rows(rows.sequences, rows.starts)],
        args.repeats,
    )
    diff = max(
        (abs(a - b) for row_a, row_b in zip(naive, trie, strict=True) for a, b in zip(row_a, row_b, strict=True)),
        default=0.0,
    )
    tokens_naive = sum(len(s) for s in rows.sequences)
    tokens_trie = scorer.stats.tokens_forwarded // args.repeats
    print(f"rows {len(rows.sequences)}  tokens {tokens_naive}  model {model_path.name}  device {args.device}")
    print(f"{'':8}{'tokens forwarded':>18}{'seconds':>10}")
    print(f"{'naive':8}{tokens_naive:>18}{naive_s:>10.3f}")
    print(f"{'trie':8}{tokens_trie:>18}{trie_s:>10.3f}")
    print(f"ratio naive/trie: tokens {tokens_naive / tokens_trie:.2f}x  time {naive_s / trie_s:.2f}x")
    print(f"prefix groups {scorer.stats.n_prefix_groups // args.repeats}  "
          f"forwards {scorer.stats.n_forwards // args.repeats}  max |naive - trie| {diff:.2e}")
    if args.sglang:
        sglang_pass(args, model_path, rows, naive, tokens_naive, tokens_trie)


def sglang_pass(args: argparse.Namespace, model_path: Path, rows: Rows, naive: list[list[float]],
                tokens_naive: int, tokens_trie: int) -> None:
    """The same rows once through purify's scorer on a real SGLang engine on CPU."""
    from cleaner.engine.model.sglang_engine import SGLangBackend

    options = {"max_total_tokens": args.sglang_max_total_tokens} if args.sglang_max_total_tokens else {}
    engine = SGLangBackend(model_path, device="cpu", **options)
    try:
        scorer = engine.scorer()
        began = time.perf_counter()
        scored = scorer.score_rows(rows.sequences, rows.starts)
        seconds = time.perf_counter() - began
    finally:
        engine.close()
    diff = max((abs(a - b) for row_a, row_b in zip(naive, scored, strict=True)
                for a, b in zip(row_a, row_b, strict=True)), default=0.0)
    stats = scorer.stats
    print(f"sglang  engine computed {stats.tokens_computed} tokens (plan {stats.tokens_forwarded}, "
          f"{stats.n_forwards} requests) in {seconds:.2f} s; KV budget {engine_budget(options)} tokens")
    print(f"tokens / naive: trie {tokens_trie / tokens_naive:.3f}  sglang {stats.tokens_computed / tokens_naive:.3f}"
          f"  (plan {stats.tokens_forwarded / tokens_naive:.3f})  max |naive - sglang| {diff:.2e}")


def engine_budget(options: dict) -> int:
    from cleaner.engine.model.sglang_engine import CPU_ENGINE_OPTIONS

    return options.get("max_total_tokens", CPU_ENGINE_OPTIONS["max_total_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: a random tiny Qwen3)")
    parser.add_argument("--warehouse", type=Path, help="score this warehouse's purified rows")
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--config-id", default=None, help="default: every config of the iteration")
    parser.add_argument("--prompts", type=int, default=8, help="synthetic: GRPO groups")
    parser.add_argument("--group-size", type=int, default=8, help="synthetic: rows per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256, help="synthetic: longest new part")
    parser.add_argument("--share", type=float, default=0.5, help="synthetic: share of rows that copy an earlier row's prefix")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sglang", action="store_true", help="also score through an SGLang engine on CPU")
    parser.add_argument("--sglang-max-total-tokens", type=int, default=None,
                        help="the engine's KV budget in tokens (default: cleaner's CPU default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        run(args, args.model)
        return
    with tempfile.TemporaryDirectory() as directory:
        run(args, tiny_model_dir(Path(directory) / "random-tiny-qwen3", args.seed))


if __name__ == "__main__":
    main()
