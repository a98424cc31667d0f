"""Old-logprob recompute with prefix reuse (DESIGN.md 5).

`score_rows(sequences, starts)` has the contract of `Backend.score`: for each row s and start P >= 1,
`[log pi(s[t] | s[:t]) for t in range(P, len(s))]`, untempered, equal to a naive full forward of
the row within 1e-4 in float32.

Design decisions:
- Rows share long prefixes (a group's prompt; all renderings of one rollout up to the first
  rewritten span), so we build a radix tree over the batch: each node holds an edge of tokens that
  every row below it shares. Each edge is forwarded exactly once, on top of the KV cache of its
  parent path, so every distinct (prefix, token) position is computed once.
- The children of a node are forwarded together: the parent's one-row cache is broadcast to the
  chunk's rows, the child edges are right-padded, positions continue at the parent's depth, and
  the attention mask is ones over the prefix then each child's real tokens. Right padding keeps
  every real query's keys identical to the unpadded forward.
- The boundary: the log-prob of an edge's first token comes from the LAST logits of its parent
  path (kept as one (V,) log-softmax per internal node); the rest come from the edge's own logits.
  The very first token of a row has no log-prob (starts are >= 1).
- Memory is bounded: the tree is walked depth first; a chunk of children is forwarded, each
  child's subtree is finished before the next chunk is forwarded, and a chunk's cache is dropped
  when its subtrees are done. Chunks obey rows x (prefix + padded edge) <= max_batch_tokens, and
  edges longer than `max_edge_tokens` are split into chains of nodes, so one forward never holds
  more than about max_batch_tokens of cache plus logits; the walk keeps one chunk per tree level.
- Logits of every edge position are computed (prompt positions too) even when only tokens from
  `start` are wanted: the prefix must be forwarded for its cache anyway, and the extra lm_head
  work is small next to the transformer. Results are sliced at the end.
- Another engine can satisfy the same `Scorer` protocol: `BackendScorer` wraps any Backend whose
  `score` reuses prefixes itself (the SGLang backend: RadixAttention caches prefixes, rows are
  sent shared-prefix-first), so purify codes against `Scorer` and never against torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cleaner.engine.backends.base import Backend
from cleaner.engine.backends.kv import (
    KV,
    causal_forward,
    kv_expand,
    kv_length,
    kv_select,
    kv_truncate,
    target_logprobs,
)
from cleaner.engine.backends.torch_backend import check_score_inputs

log = logging.getLogger(__name__)

SCORER_VERSION = "prefix-trie-1"


# ---------------------------------------------------------------------------- interface


@dataclass
class ScorerStats:
    """Work counters, cumulative over calls (mutable on purpose: the scorer updates them)."""

    tokens_forwarded: int = 0  # real (unpadded) tokens sent through the model
    tokens_naive: int = 0  # sum of row lengths: what one full forward per row would cost
    n_prefix_groups: int = 0  # internal tree nodes whose cache was reused by >= 1 child forward
    n_forwards: int = 0  # model calls
    seconds: float = 0.0

    @property
    def reuse_ratio(self) -> float:
        """tokens_naive / tokens_forwarded (1.0 = no sharing)."""
        return self.tokens_naive / max(self.tokens_forwarded, 1)


class Scorer(Protocol):
    version: str
    stats: ScorerStats

    def score_rows(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> list[list[float]]: ...


@dataclass
class BackendScorer:
    """A Scorer over a Backend whose own `score` reuses prefixes (SGLang's radix cache).

    With `warm_prefixes`, the shared prefix of every branching node of the batch's radix tree is
    scored first (one token each), so the engine's cache holds it before the full rows arrive and
    rows scheduled together do not all miss it.
    """

    backend: Backend
    warm_prefixes: bool = False
    min_prefix_tokens: int = 16  # shorter shared prefixes are not worth a warm-up request
    version: str = "backend-score-1"
    stats: ScorerStats = field(default_factory=ScorerStats)

    def score_rows(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        check_score_inputs(sequences, starts)
        began = time.perf_counter()
        if self.warm_prefixes:
            prefixes = shared_prefixes(sequences, self.min_prefix_tokens)
            self.backend.score(prefixes, [len(p) - 1 for p in prefixes])
            self.stats.n_prefix_groups += len(prefixes)
        order = sorted(range(len(sequences)), key=lambda i: tuple(sequences[i]))  # prefixes first
        scored = self.backend.score([sequences[i] for i in order], [starts[i] for i in order])
        results: list[list[float]] = [[] for _ in sequences]
        for index, row in zip(order, scored, strict=True):
            results[index] = row
        self.stats.tokens_naive += sum(len(s) for s in sequences)
        self.stats.tokens_forwarded += sum(len(s) for s in sequences)  # unknown: engine-side cache
        self.stats.seconds += time.perf_counter() - began
        return results


def shared_prefixes(sequences: Sequence[Sequence[int]], min_tokens: int) -> list[list[int]]:
    """The token path to every radix-tree node that two or more rows continue past."""
    root = build_radix_tree(sequences, max_edge_tokens=max(len(s) for s in sequences) if sequences else 1)
    found: list[list[int]] = []
    pending = [(child, list(child.edge)) for child in root.children]
    while pending:
        node, path = pending.pop()
        if len(node.children) + len(node.ending_rows) >= 2 and node.children and len(path) >= min_tokens:
            found.append(path)
        pending.extend((child, path + list(child.edge)) for child in node.children)
    return sorted(found, key=len)


# ---------------------------------------------------------------------------- radix tree


@dataclass
class Node:
    """A radix-tree node: `edge` follows `depth` tokens shared by every row below it."""

    edge: tuple[int, ...]
    depth: int  # tokens before the edge
    children: list[Node] = field(default_factory=list)
    parent: Node | None = None
    ending_rows: list[int] = field(default_factory=list)  # rows whose sequence ends with this edge
    logprobs: list[float] = field(default_factory=list)  # per edge token; NaN at absolute position 0


def build_radix_tree(sequences: Sequence[Sequence[int]], max_edge_tokens: int) -> Node:
    """Radix tree over the rows (root has an empty edge); long edges become chains of nodes."""
    root = Node(edge=(), depth=0)
    order = sorted(range(len(sequences)), key=lambda i: tuple(sequences[i]))
    pending = [(root, order)]  # (parent, rows below it, sorted, all longer than parent's end)
    while pending:
        parent, rows = pending.pop()
        depth = parent.depth + len(parent.edge)
        for group in _runs_by_token(sequences, rows, depth):
            first, last = sequences[group[0]], sequences[group[-1]]
            shared = _common_prefix_length(first, last, depth)  # sorted: LCP(all) = LCP(first, last)
            node = _add_chain(parent, tuple(first[depth:shared]), depth, max_edge_tokens)
            node.ending_rows = [i for i in group if len(sequences[i]) == shared]
            below = [i for i in group if len(sequences[i]) > shared]
            if below:
                pending.append((node, below))
    return root


def _runs_by_token(sequences, rows: list[int], depth: int) -> list[list[int]]:
    """Split sorted rows into runs that share the token at `depth`."""
    runs: list[list[int]] = []
    for index in rows:
        if runs and sequences[runs[-1][0]][depth] == sequences[index][depth]:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


def _common_prefix_length(a: Sequence[int], b: Sequence[int], start: int) -> int:
    end = start
    limit = min(len(a), len(b))
    while end < limit and a[end] == b[end]:
        end += 1
    return end


def _add_chain(parent: Node, edge: tuple[int, ...], depth: int, max_edge_tokens: int) -> Node:
    """Attach `edge` under `parent` as nodes of at most max_edge_tokens; returns the last one."""
    for offset in range(0, len(edge), max_edge_tokens):
        piece = edge[offset : offset + max_edge_tokens]
        node = Node(edge=piece, depth=depth + offset, parent=parent)
        parent.children.append(node)
        parent = node
    return parent


# ---------------------------------------------------------------------------- scorer


class PrefixTrieScorer:
    """Scores rows by forwarding each radix-tree edge once on top of its parent's KV cache."""

    version = SCORER_VERSION

    def __init__(
        self,
        model: torch.nn.Module,
        device: str | torch.device = "cpu",
        max_batch_tokens: int = 8192,  # rows x (prefix + padded edge) per forward
        max_edge_tokens: int = 2048,  # longer edges are forwarded in pieces
    ) -> None:
        if max_edge_tokens > max_batch_tokens:
            raise ValueError("max_edge_tokens must be <= max_batch_tokens")
        self.model = model
        self.device = torch.device(device)
        self.max_batch_tokens = max_batch_tokens
        self.max_edge_tokens = max_edge_tokens
        self.stats = ScorerStats()

    @torch.inference_mode()
    def score_rows(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """Same contract as Backend.score; see the module docstring."""
        check_score_inputs(sequences, starts)
        began = time.perf_counter()
        root = build_radix_tree(sequences, self.max_edge_tokens)
        self._visit(root, kv=None, last_logprobs=None)
        results: list[list[float]] = [[] for _ in sequences]
        for node in _nodes_with_ending_rows(root):
            path = _path_logprobs(node)
            for index in node.ending_rows:
                results[index] = path[starts[index] :]
        self.stats.tokens_naive += sum(len(s) for s in sequences)
        self.stats.seconds += time.perf_counter() - began
        return results

    def _visit(self, node: Node, kv: KV | None, last_logprobs: torch.Tensor | None) -> None:
        """Forward the children of `node` in chunks, recursing into each child's subtree."""
        if kv is not None:
            self.stats.n_prefix_groups += 1
        for chunk in _chunks(node.children, kv_length(kv), self.max_batch_tokens):
            lengths = [len(child.edge) for child in chunk]
            width = max(lengths)
            out = self._forward_chunk(chunk, width, kv)
            targets = torch.tensor(
                [list(c.edge[1:]) + [0] * (width - len(c.edge)) for c in chunk], device=self.device
            )  # (C, width - 1)
            inner = target_logprobs(out.logits[:, :-1], targets).cpu()  # (C, width - 1)
            lasts = {  # (V,) next-token distribution at the end of each child that has children
                row: out.logits[row, lengths[row] - 1].float().log_softmax(-1)
                for row, child in enumerate(chunk) if child.children
            }
            chunk_kv = out.kv
            del out  # the chunk's logits are not needed while its subtrees are walked
            first = (
                last_logprobs[[c.edge[0] for c in chunk]].tolist()
                if last_logprobs is not None
                else [float("nan")] * len(chunk)  # absolute position 0 has no log-prob
            )
            for row, child in enumerate(chunk):
                child.logprobs = [first[row]] + inner[row, : lengths[row] - 1].tolist()
                if child.children:
                    child_kv = kv_truncate(kv_select(chunk_kv, slice(row, row + 1)), child.depth + lengths[row])
                    self._visit(child, child_kv, lasts.pop(row))

    def _forward_chunk(self, chunk: list[Node], width: int, kv: KV | None):
        """One forward of the chunk's edges (right-padded to width) after the shared prefix."""
        prefix_length = kv_length(kv)
        input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), prefix_length + width), dtype=torch.long)
        attention_mask[:, :prefix_length] = 1
        for row, child in enumerate(chunk):
            input_ids[row, : len(child.edge)] = torch.tensor(child.edge, dtype=torch.long)
            attention_mask[row, prefix_length : prefix_length + len(child.edge)] = 1
        position_ids = torch.arange(prefix_length, prefix_length + width).expand(len(chunk), -1)
        past = kv_expand(kv, len(chunk)) if kv is not None else None
        self.stats.tokens_forwarded += sum(len(child.edge) for child in chunk)
        self.stats.n_forwards += 1
        return causal_forward(
            self.model, input_ids.to(self.device), attention_mask.to(self.device),
            position_ids.to(self.device), past=past,
        )


# ---------------------------------------------------------------------------- helpers


def _chunks(children: list[Node], prefix_length: int, max_batch_tokens: int) -> list[list[Node]]:
    """Children grouped longest edge first so rows x (prefix + longest edge) <= budget."""
    chunks: list[list[Node]] = []
    for child in sorted(children, key=lambda c: -len(c.edge)):
        if chunks and (len(chunks[-1]) + 1) * (prefix_length + len(chunks[-1][0].edge)) <= max_batch_tokens:
            chunks[-1].append(child)
        else:
            chunks.append([child])
    return chunks


def _nodes_with_ending_rows(root: Node) -> list[Node]:
    found, pending = [], [root]
    while pending:
        node = pending.pop()
        if node.ending_rows:
            found.append(node)
        pending.extend(node.children)
    return found


def _path_logprobs(node: Node) -> list[float]:
    """Log-probs of every position from the root to the end of `node` (entry 0 is NaN)."""
    pieces = []
    while node is not None:
        pieces.append(node.logprobs)
        node = node.parent
    return [lp for piece in reversed(pieces) for lp in piece]
