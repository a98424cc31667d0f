"""Old-logprob recompute with prefix reuse (DESIGN.md 5).

`score_rows(sequences, starts)` has the contract of `Backend.score`: for each row s and start P >= 1,
`[log pi(s[t] | s[:t]) for t in range(P, len(s))]`, untempered, equal to a naive full forward of
the row within 1e-4 in float32.

Design decisions:
- Rows share long prefixes (a group's prompt; all renderings of one rollout up to the first
  rewritten span), so we build a radix tree over the batch: each node holds an edge of tokens that
  every row below it shares. Each edge is forwarded exactly once, on top of the KV cache of its
  parent path, so every distinct (prefix, token) position is computed once.
- Edges are batched ACROSS nodes, not per parent: pending edges sit on a stack; a window of them
  (window_batches forwards' worth of tokens) is taken off the top, sorted by length, and cut into
  batches of rows x (longest prefix + longest edge) <= max_batch_tokens. Forwarding each node's
  children on their own cost one small forward per internal node (393 on the toy ablation); across
  nodes it is 38, and scoring went from 2.31 s to about 0.95 s (BENCHMARKS.md).
- A row of a batch is its edge on top of its own parent's cache. Prefix caches are LEFT-padded to
  the batch's longest prefix and edges right-padded; positions are explicit, and a 4-D additive
  mask lets each query see its own prefix and its edge's real tokens up to itself. Left padding
  keeps each row's prefix and edge contiguous in the output cache, so a child's cache is a view.
  The mask is built here (float, not transformers' boolean) and SDPA gets `enable_gqa` on CPU:
  both are faster there, with the same values.
- Long edges are cut into pieces of max_edge_tokens (64 on CPU): batches then mix pieces of
  similar length, which measured best of 32/48/64/96/128/2048 (padding 16% of query tokens at 64,
  58% with whole edges). On CUDA the default stays 2048 (not measured here: no GPU).
- The boundary: the log-prob of an edge's first token comes from the LAST position of its parent
  edge; the rest come from the edge's own positions. The very first token of a row has no
  log-prob (starts are >= 1). A leaf's last token is context for nothing and is not forwarded.
- Only the positions someone needs go through the output head: from the smallest start among
  the rows below a node, never padding. That needs `logits == head(decoder(x))`, which is checked
  on a probe at construction (`head_is_plain_linear`); heads that scale or cap logits fall back to
  full forwards.
- Memory: the stack is walked last-in first-out, so the pending caches are those of about one
  window per tree level; a forward holds about max_batch_tokens of cache plus activations.
- Another engine can satisfy the same `Scorer` protocol: `BackendScorer` wraps any Backend whose
  `score` reuses prefixes itself (the SGLang backend: RadixAttention caches prefixes, rows are
  sent shared-prefix-first), so purify codes against `Scorer` and never against torch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cleaner.engine.backends.base import Backend
from cleaner.engine.backends.kv import (
    KV,
    BufferCache,
    causal_forward,
    head_is_plain_linear,
    hidden_forward,
)
from cleaner.engine.backends.torch_backend import check_score_inputs
from cleaner.engine.purify.radix import (
    Node,
    build_radix_tree,
    mark_first_scored,
    nodes_with_ending_rows,
    path_logprobs,
    shared_prefixes,
)

SCORER_VERSION = "prefix-trie-1"
CPU_EDGE_TOKENS = 64  # measured best of 32/48/64/96/128/2048 on the toy ablation (BENCHMARKS.md)


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


# ---------------------------------------------------------------------------- scorer


class PrefixTrieScorer:
    """Scores rows by forwarding each radix-tree edge once on top of its parent's KV cache."""

    version = SCORER_VERSION

    def __init__(
        self,
        model: torch.nn.Module,
        device: str | torch.device = "cpu",
        max_batch_tokens: int = 8192,  # rows x (longest prefix + longest edge) per forward
        max_edge_tokens: int | None = None,  # longer edges go in pieces; None: 64 on CPU, else 2048
        window_batches: int = 4,  # edges taken off the stack at once, in forwards' worth of tokens
    ) -> None:
        device = torch.device(device)
        if max_edge_tokens is None:  # short pieces pad less; see the module docstring
            max_edge_tokens = CPU_EDGE_TOKENS if device.type == "cpu" else 2048
        if max_edge_tokens > max_batch_tokens:
            raise ValueError("max_edge_tokens must be <= max_batch_tokens")
        if window_batches < 1:
            raise ValueError("window_batches must be >= 1")
        self.model = model
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.max_edge_tokens = max_edge_tokens
        self.window_batches = window_batches
        self.split_head = head_is_plain_linear(model)
        self.dtype = next(model.parameters()).dtype
        self.stats = ScorerStats()

    @torch.inference_mode()
    def score_rows(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """Same contract as Backend.score; see the module docstring."""
        check_score_inputs(sequences, starts)
        began = time.perf_counter()
        root = build_radix_tree(sequences, self.max_edge_tokens)
        mark_first_scored(root, starts)
        stack = [_Pending(child, kv=None, first_logprob=float("nan")) for child in root.children]
        while stack:
            window = _take_window(stack, self.window_batches * self.max_batch_tokens)
            for item in window:
                if item.forward_length == 0:  # a one-token leaf: its log-prob came from the parent
                    item.node.logprobs = [item.first_logprob]
            window = [item for item in window if item.forward_length]
            for batch in _batches(window, self.max_batch_tokens):
                stack.extend(self._forward(batch))
        results: list[list[float]] = [[] for _ in sequences]
        for node in nodes_with_ending_rows(root):
            path = path_logprobs(node)
            for index in node.ending_rows:
                results[index] = path[starts[index] :]
        self.stats.tokens_naive += sum(len(s) for s in sequences)
        self.stats.seconds += time.perf_counter() - began
        return results

    def _forward(self, batch: list[_Pending]) -> list[_Pending]:
        """One forward of the batch's edges; fills their log-probs and returns their children."""
        lengths = [item.forward_length for item in batch]
        depths = torch.tensor([item.node.depth for item in batch])  # (C,)
        prefix_length, width = int(depths.max()), max(lengths)
        input_ids = torch.tensor(  # (C, W), right-padded
            [list(item.node.edge[:n]) + [0] * (width - n) for item, n in zip(batch, lengths, strict=True)]
        )
        attention_mask = _attention_bias(depths, torch.tensor(lengths), prefix_length, width, self.dtype)
        position_ids = depths[:, None] + torch.arange(width)  # (C, W)
        self.stats.tokens_forwarded += sum(lengths)
        self.stats.n_forwards += 1
        past = BufferCache(_prefix_buffer(batch, prefix_length, width), prefix_length) if prefix_length else None
        arguments = (input_ids.to(self.device), attention_mask.to(self.device), position_ids.to(self.device))
        plan = _HeadPlan.of(batch)
        rows, cols, entries, targets = (
            torch.tensor(index, dtype=torch.long, device=self.device)
            for index in (plan.rows, plan.cols, plan.pick_entries, plan.pick_targets)
        )
        with _grouped_query_sdpa(self.device.type == "cpu"):
            if self.split_head:  # project only the positions someone needs: no padding, no prompt
                out = hidden_forward(self.model, *arguments, past=past)
                logits = self.model.get_output_embeddings()(out.hidden[rows, cols]).float()  # (N, V)
            else:
                out = causal_forward(self.model, *arguments, past=past)
                logits = out.logits[rows, cols].float()  # (N, V)
        values = (logits[entries, targets] - torch.logsumexp(logits, -1)[entries]).tolist()  # (M,)
        parents = [row for row, item in enumerate(batch) if item.node.children]
        if past is not None and 2 * len(parents) >= len(batch):  # keep the buffer: every path is in it
            stacked, slot = past.buffer, {row: row for row in parents}
        else:  # copy the few parent rows out, so the leaves' share of the buffer can be freed
            stacked = _stack_kv(out.kv, parents) if parents else None
            slot = {row: index for index, row in enumerate(parents)}
        children: list[_Pending] = []
        for row, item in enumerate(batch):
            node, offset, n_inner = item.node, plan.value_offsets[row], plan.n_inner[row]
            n_skipped = len(node.edge) - 1 - n_inner  # positions before anyone's start
            node.logprobs = [item.first_logprob] + [_NAN] * n_skipped + values[offset : offset + n_inner]
            if node.children:
                self.stats.n_prefix_groups += 1
                # a view: the row's prefix and edge are contiguous because prefixes are left-padded
                at = slot[row]
                kv = stacked[:, :, at : at + 1, :, prefix_length - node.depth : prefix_length + lengths[row]]
                firsts = values[offset + n_inner : offset + n_inner + len(node.children)]
                children.extend(_Pending(c, kv, first) for c, first in zip(node.children, firsts, strict=True))
        return children


_NAN = float("nan")


@dataclass
class _HeadPlan:
    """Which output positions of a batch to project, and which token to read at each.

    For each row: its inner positions from the first one a row below it wants, then (for a node
    with children) its last position once per child. `values` come back in the same order.
    """

    rows: list[int] = field(default_factory=list)  # per projected position: batch row
    cols: list[int] = field(default_factory=list)  # per projected position: column in the edge
    pick_entries: list[int] = field(default_factory=list)  # per read value: projected position
    pick_targets: list[int] = field(default_factory=list)  # per read value: token id
    value_offsets: list[int] = field(default_factory=list)  # per row: its first read value
    n_inner: list[int] = field(default_factory=list)  # per row: inner log-probs it reads

    @classmethod
    def of(cls, batch: list[_Pending]) -> _HeadPlan:
        plan = cls()
        for row, item in enumerate(batch):
            node, length = item.node, len(item.node.edge)
            first_col = min(max(0, node.first_scored - node.depth - 1), length - 1)
            n_inner = length - 1 - first_col  # logits at col score the token at col + 1
            plan.value_offsets.append(len(plan.pick_entries))
            plan.n_inner.append(n_inner)
            plan.pick_entries.extend(range(len(plan.rows), len(plan.rows) + n_inner))
            plan.pick_targets.extend(node.edge[first_col + 1 : length])
            plan.rows.extend([row] * n_inner)
            plan.cols.extend(range(first_col, length - 1))
            if node.children:  # the last position scores every child's first token
                entry = len(plan.rows)
                plan.rows.append(row)
                plan.cols.append(length - 1)
                for child in node.children:
                    plan.pick_entries.append(entry)
                    plan.pick_targets.append(child.edge[0])
        return plan


# ---------------------------------------------------------------------------- helpers


@dataclass
class _Pending:
    """An edge waiting to be forwarded, with what its parent path left for it."""

    node: Node
    kv: torch.Tensor | None  # (layers, 2, 1, H, node.depth, D): the path's cache; None at depth 0
    first_logprob: float  # log-prob of node.edge[0] after the path; NaN at absolute position 0

    @property
    def forward_length(self) -> int:
        """Edge tokens to forward: a leaf's last token is never context for anything, so it is not."""
        return len(self.node.edge) if self.node.children else len(self.node.edge) - 1


def _cost(item: _Pending) -> int:
    return item.node.depth + item.forward_length


def _take_window(stack: list[_Pending], window_tokens: int) -> list[_Pending]:
    """Pop edges off the top of the stack until their prefix + edge tokens reach the window."""
    window = [stack.pop()]
    total = _cost(window[0])
    while stack and total + _cost(stack[-1]) <= window_tokens:
        total += _cost(stack[-1])
        window.append(stack.pop())
    return window


def _batches(window: list[_Pending], max_batch_tokens: int) -> list[list[_Pending]]:
    """Edges grouped by similar shape so rows x (longest prefix + longest edge) <= budget."""
    batches: list[list[_Pending]] = []
    prefix = edge = 0
    for item in sorted(window, key=lambda i: (-i.forward_length, -i.node.depth)):
        grown_prefix, grown_edge = max(prefix, item.node.depth), max(edge, item.forward_length)
        if batches and (len(batches[-1]) + 1) * (grown_prefix + grown_edge) <= max_batch_tokens:
            batches[-1].append(item)
            prefix, edge = grown_prefix, grown_edge
        else:
            batches.append([item])
            prefix, edge = item.node.depth, item.forward_length
    return batches


def _attention_bias(depths: torch.Tensor, lengths: torch.Tensor, prefix_length: int, width: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The batch's 4-D additive mask (C, 1, W, P + W): 0 where a query may look, dtype-min elsewhere.

    A query sees its row's own (left-padded) prefix and the real edge tokens up to itself. Built
    here rather than by transformers because SDPA on CPU runs faster with an additive float mask
    than with the boolean one transformers would build from a 2-D mask (same values).
    """
    columns = torch.arange(prefix_length + width)  # (P + W,)
    queries = torch.arange(width)[:, None]  # (W, 1)
    in_prefix = (columns >= prefix_length - depths[:, None]) & (columns < prefix_length)  # (C, P + W)
    edge_column = columns - prefix_length  # (P + W,)
    in_edge = (edge_column >= 0)[None, None, :] & (edge_column[None, None, :] <= queries[None]) \
        & (edge_column[None, None, :] < lengths[:, None, None])  # (C, W, P + W)
    allowed = in_prefix[:, None, :] | in_edge  # (C, W, P + W)
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return bias[:, None]  # (C, 1, W, P + W)


@contextlib.contextmanager
def _grouped_query_sdpa(enabled: bool):
    """Let transformers pass `enable_gqa` to SDPA with a mask instead of repeating K/V per head.

    On CPU this is ~30% faster attention (measured); on CUDA a mask with enable_gqa falls back to
    the math kernel, so it stays off there. transformers reads the variable on every call.
    """
    if not enabled:
        yield
        return
    previous = os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRANSFORMERS_SDPA_FORCE_GQA"]
        else:
            os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = previous


def _prefix_buffer(batch: list[_Pending], prefix_length: int, width: int) -> torch.Tensor:
    """A (layers, 2, C, H, prefix_length + width, D) buffer holding the batch's prefix caches
    LEFT-padded with zeros to prefix_length (siblings share one copy); the forward fills the rest."""
    template = next(item.kv for item in batch if item.kv is not None)  # (layers, 2, 1, H, T, D)
    layers, _, _, heads, _, head_dim = template.shape
    buffer = template.new_empty((layers, 2, len(batch), heads, prefix_length + width, head_dim))
    by_cache: dict[int, list[int]] = {}
    for row, item in enumerate(batch):
        if item.kv is None:
            buffer[:, :, row, :, :prefix_length] = 0
        else:
            by_cache.setdefault(id(item.kv), []).append(row)
    for rows in by_cache.values():
        cache = batch[rows[0]].kv
        start = prefix_length - cache.shape[-2]
        if start:  # padding must be finite: masked scores are added to it, and NaN would survive
            buffer[:, :, rows, :, :start] = 0
        buffer[:, :, rows, :, start:prefix_length] = cache  # broadcast over the siblings
    return buffer


def _stack_kv(kv: KV, rows: list[int]) -> torch.Tensor:
    """The caches of `rows` as one (layers, 2, len(rows), H, T, D) tensor: one slice per row, all layers."""
    index = torch.tensor(rows, device=kv[0][0].device)
    return torch.stack([torch.stack((keys.index_select(0, index), values.index_select(0, index)))
                        for keys, values in kv])
