"""What purification costs, on one collected toy iteration, measured side by side in one run.

1. collect one iteration (default 64 prompts x 8) with the committed tiny policy: the reference cost;
2. render the iteration under a grid of purify configs (default 6: gamma 0.3/0.5/0.7 x p 0.7/1.0);
3. score every rendered row two ways on the same model:
   naive  one full forward per row (TorchBackend.score, batched with padding), every row of every config;
   trie   PrefixTrieScorer over the same rows: each distinct (prefix, token) forwarded once;
   and check they agree;
4. run the whole `cleaner ablate` job (render + one scorer pass + advantages + writes) for the grid;
5. run it again with the IS gate on every config of the grid (tau 0.5, the reference's setting):
   render, score, render again while an IS decision was assumed.
Targets: trie tokens / naive tokens <= 0.5, naive time / trie time >= 2, ablate time / collect
time <= 0.10, IS-gated ablate time / collect time <= 0.15. Collection, trie scoring and the ablate job are each the median of
--repeats runs: on a shared 2-core machine single runs of either vary by 10-50%. Each ablate run
follows its own collection, on an untouched copy of that warehouse, and the ratio of each pair is
printed too: the two halves of a pair see the same machine.

    python bench/purify_cost.py --prompts 64 --group-size 8
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cleaner.config import DEFAULT_POLICY, CollectConfig, PurifyConfig
from cleaner.engine.collect.job import CollectRequest, collect_job
from cleaner.engine.model.chat import ChatFormat
from cleaner.engine.model.torch_backend import TorchBackend
from cleaner.engine.model.trie_scorer import PrefixTrieScorer
from cleaner.engine.purify.job import PurifyRequest, purify_job
from cleaner.engine.purify.pipeline import render_iteration
from cleaner.engine.saar.walk import clear_similarity_cache
from cleaner.warehouse import Warehouse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--model", default=str(DEFAULT_POLICY))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="collect, trie scoring and ablate job: median of this many runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    backend = TorchBackend(args.model)
    decode = ChatFormat(backend.tokenizer).decode
    configs = [PurifyConfig(gamma=g, rollback_prob=p) for g, p in itertools.product((0.3, 0.5, 0.7), (0.7, 1.0))]
    gated_configs = [dataclasses.replace(c, rollback_is_threshold=0.5) for c in configs]
    with tempfile.TemporaryDirectory() as root:
        collect_runs, ablate_runs, scoring_runs, gated_runs, gated = [], [], [], [], 0
        for repeat in range(args.repeats):  # the same seed collects the same iteration each time
            warehouse = Warehouse(Path(root) / f"collect-{repeat}")
            started = time.perf_counter()
            config = CollectConfig(model=args.model, n_prompts=args.prompts, group_size=args.group_size)
            collect_job(warehouse, CollectRequest(config), backend=backend, progress=False)
            collect_runs.append(time.perf_counter() - started)
            # right after its collection, on an untouched copy (purify is idempotent): the pair sees
            # the same machine, so their ratio is steadier than a ratio of separate medians
            shutil.copytree(warehouse.root, Path(root) / f"ablate-{repeat}")
            clear_similarity_cache()  # each run computes its similarities afresh
            started = time.perf_counter()
            outcome = purify_job(Warehouse(Path(root) / f"ablate-{repeat}"), PurifyRequest(0, configs), backend=backend,
                                 progress=False)
            ablate_runs.append(time.perf_counter() - started)
            scoring_runs.append(outcome.scorer_stats.seconds)
            shutil.copytree(warehouse.root, Path(root) / f"gated-{repeat}")
            clear_similarity_cache()
            started = time.perf_counter()
            outcome = purify_job(Warehouse(Path(root) / f"gated-{repeat}"), PurifyRequest(0, gated_configs), backend=backend,
                                 progress=False)
            gated_runs.append(time.perf_counter() - started)
            gated = sum(result.stats.n_gated for result in outcome.results)
        collect_s, ablate_s = statistics.median(collect_runs), statistics.median(ablate_runs)
        pair_ratios = [a / c for a, c in zip(ablate_runs, collect_runs, strict=True)]
        gated_ratios = [a / c for a, c in zip(gated_runs, collect_runs, strict=True)]

        rollouts, segments = warehouse.read_rollouts(0), warehouse.read_segments(0)
        rows = [row for c in configs for row in render_iteration(rollouts, segments, c, decode)[0]]
        sequences = [row.token_ids for row in rows]
        starts = [max(row.prompt_len, 1) for row in rows]

        started = time.perf_counter()
        naive = backend.score(sequences, starts)
        naive_s = time.perf_counter() - started
        trie_runs = []
        for _ in range(args.repeats):
            scorer = PrefixTrieScorer(backend.model)
            started = time.perf_counter()
            trie = scorer.score_rows(sequences, starts)
            trie_runs.append(time.perf_counter() - started)
        trie_s = statistics.median(trie_runs)
        worst = max((abs(a - b) for x, y in zip(naive, trie, strict=True) for a, b in zip(x, y, strict=True)),
                    default=0.0)

    naive_tokens = sum(len(s) for s in sequences)
    print(f"iteration: {len(rollouts)} rollouts, {len(configs)} configs -> {len(rows)} rows, {naive_tokens} tokens")
    print(f"collect                      {collect_s:8.2f} s   runs {_seconds(collect_runs)}")
    print(f"naive scoring (every row)    {naive_s:8.2f} s   {naive_tokens} tokens forwarded")
    print(f"prefix-trie scoring          {trie_s:8.2f} s   {scorer.stats.tokens_forwarded} tokens forwarded, "
          f"{scorer.stats.n_forwards} forwards; runs {_seconds(trie_runs)}")
    print(f"cleaner ablate job, {len(configs)} configs {ablate_s:8.2f} s   runs {_seconds(ablate_runs)}, "
          f"of which scoring {_seconds(scoring_runs)}")
    print(f"tokens trie / naive          {scorer.stats.tokens_forwarded / naive_tokens:8.3f}   (target <= 0.5)")
    print(f"time naive / trie            {naive_s / trie_s:8.2f}x  (target >= 2)")
    print(f"ablate / collect             {ablate_s / collect_s:8.3f}   (target <= 0.10; medians)")
    print(f"  per pair (collect, then ablate on its copy): {'/'.join(f'{r:.3f}' for r in pair_ratios)}, "
          f"median {statistics.median(pair_ratios):.3f}, worst {max(pair_ratios):.3f}")
    print(f"IS-gated ablate, tau 0.5     {statistics.median(gated_runs):8.2f} s   runs {_seconds(gated_runs)}; "
          f"{gated} merges gated over the {len(gated_configs)} configs")
    print(f"IS-gated ablate / collect    {statistics.median(gated_runs) / collect_s:8.3f}   (target <= 0.15; medians)"
          f"; per pair {'/'.join(f'{r:.3f}' for r in gated_ratios)}")
    print(f"max |naive - trie| logprob   {worst:.2e}")


def _seconds(runs: list[float]) -> str:
    return "/".join(f"{run:.2f}" for run in runs) + " s"


if __name__ == "__main__":
    main()
