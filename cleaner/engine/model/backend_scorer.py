"""Purify's RowScorer for a backend whose engine keeps its own prefix cache (SGLang's RadixAttention).

`BackendScorer(backend.score).score_rows(sequences, starts)` has the contract of `Backend.score` and
returns exactly what the backend's `score` would for each row; what changes is what the engine
has to compute (docs/architecture.md §6).

Design decisions:
- SGLang caps a request's prefix-cache match at its `logprob_start_len` (it needs the logits from
  there on), so scoring whole rows reuses at most each row's prompt: every rendering of a rollout
  would recompute the response tokens it shares with the other renderings. Instead the rows
  become a radix tree (radix.py) and each edge is ONE request: the path from the root to the
  end of the edge, scored from the edge's first wanted position. The request's cacheable prefix
  is then its parent's path, which the engine has just computed, so each distinct
  (prefix, token) position is computed about once, as in the torch prefix-trie scorer.
- Requests go level by level, one `score` call per tree depth, so a parent's path is in the
  engine's cache before its children arrive (requests of one call run concurrently and would
  miss each other). A tree has as many levels as a row has branch points: a handful for purify.
- A branching node none of whose positions is wanted (typically a group's prompt) is still sent,
  asking for its last position only, so its path is computed once and cached before its
  children arrive, instead of once per child.
- Edges are not split: the engine chunks long prefills itself.
- Positions before every start below a node are not asked for (NaN internally, never returned).
- `stats.tokens_forwarded` counts, per request, the tokens past the part of it the engine may
  serve from its cache (the parent's path, capped at the request's logprob_start_len): what it
  computes when its cache holds every path sent before. It may evict and recompute more, so a
  backend that can read what the engine did passes `computed` (its running count of tokens the
  engine computed: SGLang's prompt tokens minus `cached_tokens`), which fills `stats.tokens_computed`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from cleaner.engine.model.base import ScorerStats, check_score_inputs
from cleaner.engine.model.radix import (
    Node,
    build_radix_tree,
    mark_first_scored,
    row_logprobs,
)

SCORER_VERSION = "backend-radix-1"
ScoreFn = Callable[[Sequence[Sequence[int]], Sequence[int]], list[list[float]]]
Counter = Callable[[], int]


@dataclass
class BackendScorer:
    """Scores rows through `score` (a backend's), one request per radix-tree edge, level by level."""

    score: ScoreFn
    progress: bool = False  # a tqdm bar over the requests
    computed: Counter | None = None  # the engine's running count of tokens it computed, if known
    version: str = SCORER_VERSION
    stats: ScorerStats = field(default_factory=ScorerStats)

    def score_rows(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        check_score_inputs(sequences, starts)
        began = time.perf_counter()
        computed_before = self.computed() if self.computed is not None else 0
        root = build_radix_tree(sequences, max_edge_tokens=max((len(s) for s in sequences), default=1))
        mark_first_scored(root, starts)
        level = [(child, tuple(child.edge)) for child in root.children]
        with tqdm(desc="score", unit="req", disable=not self.progress, leave=False) as bar:
            while level:
                self._score_level(level)
                bar.update(len(level))
                level = [(child, path + child.edge) for node, path in level for child in node.children]
        results = row_logprobs(root, starts)
        self.stats.tokens_naive += sum(len(s) for s in sequences)
        if self.computed is not None:
            self.stats.tokens_computed = (self.stats.tokens_computed or 0) + self.computed() - computed_before
        self.stats.seconds += time.perf_counter() - began
        return results

    def _score_level(self, level: list[tuple[Node, tuple[int, ...]]]) -> None:
        """One `score` call for every edge of a tree level; fills each node's log-probs."""
        asked = []  # (node, its path, first position asked for)
        for node, path in level:
            first = max(1, node.depth, node.first_scored)
            if first >= len(path) and node.children and len(path) >= 2:
                first = len(path) - 1  # nothing wanted here: computed once for the children's sake
            node.logprobs = [math.nan] * len(node.edge)  # until scored; positions nobody wants stay NaN
            if first < len(path):
                asked.append((node, path, first))
            self.stats.n_prefix_groups += bool(node.children)
        if not asked:
            return
        scored = self.score([path for _, path, _ in asked], [first for _, _, first in asked])
        for (node, path, first), values in zip(asked, scored, strict=True):
            node.logprobs[first - node.depth:] = values
            self.stats.tokens_forwarded += len(path) - min(first - 1, node.depth)
        self.stats.n_forwards += len(asked)
