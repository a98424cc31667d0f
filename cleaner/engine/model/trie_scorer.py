"""Old-logprob recompute with prefix reuse (docs/architecture.md §6).

`score_rows(sequences, starts)` has the contract of `Backend.score`: for each row s and start P >= 1,
`[log pi(s[t] | s[:t]) for t in range(P, len(s))]`, untempered, equal to a naive full forward of
the row within 1e-4 in float32.

Design decisions:
- Rows share long prefixes (a group's prompt; all renderings of one rollout up to the first
  rewritten span), so we build a radix tree over the batch: each node holds an edge of tokens that
  every row below it shares. Each edge is forwarded exactly once, on top of the KV cache of its
  parent path, so every distinct (prefix, token) position is computed once.
- Edges are batched ACROSS nodes, not per parent: pending edges sit on a stack; a window of them
  (window_batches attention batches' worth of tokens) is taken off the top, sorted by length, and
  cut into attention batches of rows x (longest prefix + longest edge) <= max_batch_tokens.
  Forwarding each node's children on their own would cost one small forward per internal node.
- One forward per window, packed: the window's edges go through the model as one unpadded row, and
  attention runs per batch over each row's own prefix cache (`trie_attention.py`). Flash kernels
  take no 4-D mask, so a model loaded with them is refused at construction.
- Sizes: on CPU, pieces of max_edge_tokens = 64 near the root, longer deep in a row (radix.py: a
  sixteenth of the depth, up to 8x, never past an attention batch), so copying each piece's prefix
  cache into its batch grows about linearly with a row, not with its square (batches then mix
  pieces of similar length) and
  attention batches of 2048 tokens (small batches pad less, and 4 of them per forward keep
  activations in cache), the best of the sizes compared in BENCHMARKS.md. On CUDA the defaults
  are 2048 and 8192, larger because a GPU wants bigger kernels; they have not been compared there.
- The boundary: the log-prob of an edge's first token comes from the LAST position of its parent
  edge; the rest come from the edge's own positions. The very first token of a row has no
  log-prob (starts are >= 1). A leaf's last token is context for nothing and is not forwarded.
- Only the positions someone needs go through the output head, from the smallest start among the
  rows below a node, never the prompt, and `chunk_tokens` of them at a time (head.py): the decoder
  gives the last hidden states, the lm_head turns a chunk into logits, keeps log pi(target) and
  frees them, so the peak is one chunk's logits (0.3 GB at Qwen's vocabulary), not positions x
  vocabulary (18.5 GiB of float32 for a 32,768-position window). A model whose logits are not a
  plain linear head (soft-capped, scaled) is refused, as the train step refuses it.
- Memory: the stack is walked last-in first-out, so the pending caches are those of about one
  window per tree level; a forward holds about window_batches x max_batch_tokens of cache plus the
  activations of the window's tokens. A batch whose rows are mostly leaves hands its few parents a
  copy of their rows, so the leaves' share of its buffer is freed. On a GPU the sizes come from a
  memory budget (`_sizes`): half of what a naive forward of the longest row holds (its logits and
  cache), or `memory_bytes` (`--scorer-memory-gb`), within what the device has free, so the scorer
  never holds more than the naive pass it replaces (sized on a model, not yet measured on a GPU).
- It is the torch backend's `RowScorer` (base.py): purify gets it from `TorchBackend.scorer()`
  and codes against the protocol; a remote engine's scorer is `backend_scorer.BackendScorer`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from cleaner.engine.model.base import ScorerStats, check_score_inputs
from cleaner.engine.model.head import (
    DEFAULT_CHUNK_TOKENS,
    check_attention,
    check_plain_head,
    target_logprobs,
)
from cleaner.engine.model.kv import kv_geometry
from cleaner.engine.model.radix import (
    MAX_PIECE_FACTOR,
    Node,
    build_radix_tree,
    mark_first_scored,
    row_logprobs,
    tokens_to_forward,
)
from cleaner.engine.model.trie_attention import TORCH_GQA, AttentionBatch, packed_attention

SCORER_VERSION = "prefix-trie-1"
CPU_EDGE_TOKENS = 64  # the best piece size on CPU among those compared in BENCHMARKS.md
CPU_BATCH_TOKENS = 2048  # the best attention batch on CPU among those compared in BENCHMARKS.md
GPU_BATCH_TOKENS = 8192  # the largest attention batch on a GPU (a memory budget may ask for less)
GPU_EDGE_TOKENS = 2048
BUDGET_MIN_BATCH_TOKENS = 512  # a budget never shrinks batches below this (launches would dominate)


# ---------------------------------------------------------------------------- scorer


class PrefixTrieScorer:
    """Scores rows by forwarding each radix-tree edge once on top of its parent's KV cache."""

    version = SCORER_VERSION

    def __init__(
        self,
        model: torch.nn.Module,
        device: str | torch.device = "cpu",
        max_batch_tokens: int | None = None,  # rows x (longest prefix + longest edge) per attention
        # batch; None: 2048 on CPU, else 8192
        max_edge_tokens: int | None = None,  # longer edges go in pieces; None: 64 on CPU, else 2048
        window_batches: int = 4,  # attention batches' worth of tokens per forward
        progress: bool = False,  # a tqdm bar over the tokens to forward
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,  # positions per lm_head chunk
        memory_bytes: int | None = None,  # on a GPU, what a forward's caches may take; None: half a naive pass's
    ) -> None:
        device = torch.device(device)
        on_cpu = device.type == "cpu"  # CPU and CUDA want different sizes; see the module docstring
        self.budgeted = not on_cpu and max_batch_tokens is None and max_edge_tokens is None
        self.memory_bytes = memory_bytes
        if max_batch_tokens is None:
            max_batch_tokens = CPU_BATCH_TOKENS if on_cpu else GPU_BATCH_TOKENS
        if max_edge_tokens is None:
            max_edge_tokens = CPU_EDGE_TOKENS if on_cpu else GPU_EDGE_TOKENS
        if max_edge_tokens > max_batch_tokens:
            raise ValueError("max_edge_tokens must be <= max_batch_tokens")
        if window_batches < 1:
            raise ValueError("window_batches must be >= 1")
        check_plain_head(model)
        check_attention(model)  # sinks; a sliding window is checked against the rows in score_rows
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.chunk_tokens = chunk_tokens
        self.device = device
        self.max_batch_tokens = max_batch_tokens
        self.max_edge_tokens = max_edge_tokens
        self.window_batches = window_batches
        self.progress = progress
        loaded = model.config._attn_implementation
        if loaded not in ("sdpa", "eager"):
            raise ValueError(f"PrefixTrieScorer needs a model loaded with attn_implementation 'sdpa' or "
                             f"'eager' (it passes 4-D masks); this one uses {loaded!r}")
        self.geometry = kv_geometry(model)  # (layers, kv heads, head dim) of the model's cache
        self.grouped_query = on_cpu and TORCH_GQA  # SDPA with enable_gqa: faster on CPU
        self.dtype = next(model.parameters()).dtype
        self.stats = ScorerStats()

    @torch.inference_mode()
    def score_rows(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """Same contract as Backend.score; see the module docstring."""
        check_score_inputs(sequences, starts)
        check_attention(self.model, max((len(s) for s in sequences), default=0))
        began = time.perf_counter()
        if self.budgeted and sequences:
            self.max_batch_tokens, self.max_edge_tokens = self._sizes(max(len(s) for s in sequences))
        root = build_radix_tree(sequences, self.max_edge_tokens,
                                min(MAX_PIECE_FACTOR * self.max_edge_tokens, self.max_batch_tokens))
        mark_first_scored(root, starts)
        stack = [_Pending(child, kv=None, first_logprob=float("nan")) for child in root.children]
        with tqdm(total=tokens_to_forward(root), desc="score", unit="tok", disable=not self.progress,
                  leave=False) as bar:
            while stack:
                window = _take_window(stack, self.window_batches * self.max_batch_tokens)
                for item in window:
                    if item.forward_length == 0:  # a one-token leaf: its log-prob came from the parent
                        item.node.logprobs = [item.first_logprob]
                window = [item for item in window if item.forward_length]
                if window:
                    stack.extend(self._forward(_batches(window, self.max_batch_tokens)))
                    bar.update(sum(item.forward_length for item in window))
        results = row_logprobs(root, starts)
        self.stats.tokens_naive += sum(len(s) for s in sequences)
        self.stats.seconds += time.perf_counter() - began
        return results

    def _sizes(self, longest: int) -> tuple[int, int]:
        """(attention batch, piece) tokens on a GPU, from a memory budget: a forward holds about
        (window_batches + 1) batches' key/value buffers twice over (its batches', and the parents'
        caches pending on the stack), so a batch gets budget / (2 (window_batches + 1)) of cache.
        The budget: `memory_bytes`, else half of what a naive forward of the longest row holds (its
        logits and its cache), never more than 80% of what the device has free."""
        layers, kv_heads, head_dim = self.geometry
        per_token = 2 * layers * kv_heads * head_dim * self.dtype.itemsize  # one position's keys and values
        naive = longest * (self.head.weight.shape[0] * 4 + per_token)
        budget = self.memory_bytes if self.memory_bytes is not None else naive // 2
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = min(budget, int(0.8 * free))
        batch = budget // (2 * (self.window_batches + 1) * per_token)
        batch = max(BUDGET_MIN_BATCH_TOKENS, min(GPU_BATCH_TOKENS, batch // 256 * 256))
        return batch, min(GPU_EDGE_TOKENS, batch)

    def _forward(self, batches: list[list[_Pending]]) -> list[_Pending]:
        """One packed forward of every edge of the window; fills their log-probs, returns their children.

        The edges go through the model as ONE unpadded row; attention runs per batch, padded (see
        trie_attention.py).
        """
        groups, first_packed = [], 0
        for items in batches:
            groups.append(AttentionBatch.of(items, first_packed, self.geometry, self.dtype, self.device))
            first_packed += groups[-1].n_tokens
        batch = [item for group in groups for item in group.items]  # packed order
        lengths = [item.forward_length for item in batch]
        offsets = list(itertools.accumulate(lengths, initial=0))
        input_ids = self._long(itertools.chain.from_iterable(
            item.node.edge[:n] for item, n in zip(batch, lengths, strict=True)))[None]  # (1, N)
        position_ids = self._long(itertools.chain.from_iterable(
            range(item.node.depth, item.node.depth + n) for item, n in zip(batch, lengths, strict=True)))[None]
        self.stats.tokens_forwarded += offsets[-1]
        self.stats.n_forwards += 1
        plan = _HeadPlan.of(batch)
        positions = [offsets[r] + c for r, c in zip(plan.rows, plan.cols, strict=True)]
        predictors = self._long(positions[entry] for entry in plan.pick_entries)  # (M,): the position before each
        with packed_attention(self.model, groups, self.grouped_query):
            # a 4-D mask passes through transformers' mask preparation untouched (never an N x N
            # causal mask); `trie_attention` ignores it and uses each batch's own
            hidden = self.decoder(input_ids=input_ids, attention_mask=_PLACEHOLDER_MASK.to(self.device),
                                  position_ids=position_ids, use_cache=False).last_hidden_state[0]  # (N, H)
        values = target_logprobs(hidden.index_select(0, predictors), self.head.weight, self.head.bias,
                                 self._long(plan.pick_targets), self.chunk_tokens, self.dtype).tolist()  # (M,)
        children: list[_Pending] = []
        first_row = 0
        for group in groups:
            children.extend(self._children(group, plan, values, first_row))
            first_row += len(group.items)
        return children

    def _long(self, values) -> torch.Tensor:
        """An int64 tensor on the device from Python ints (through numpy: much faster than torch.tensor on a generator)."""
        return torch.from_numpy(np.fromiter(values, dtype=np.int64)).to(self.device)

    def _children(self, group: AttentionBatch, plan: _HeadPlan, values: list[float], first_row: int) -> list[_Pending]:
        """Fill the log-probs of a group's edges; the children, each with a view of its path's cache."""
        parents = [row for row, item in enumerate(group.items) if item.node.children]
        if 2 * len(parents) >= len(group.items):  # keep the buffer: every row's path is in it
            stacked, slot = group.buffer, {row: row for row in parents}
        else:  # copy the few parent rows out, so the leaves' share of the buffer can be freed
            stacked = group.buffer[:, :, parents] if parents else None
            slot = {row: index for index, row in enumerate(parents)}
        children: list[_Pending] = []
        for row, item in enumerate(group.items):
            node, offset, n_inner = item.node, plan.value_offsets[first_row + row], plan.n_inner[first_row + row]
            n_skipped = len(node.edge) - 1 - n_inner  # positions before anyone's start
            node.logprobs = [item.first_logprob] + [_NAN] * n_skipped + values[offset : offset + n_inner]
            if node.children:
                self.stats.n_prefix_groups += 1
                # a view: the row's prefix and edge are contiguous because prefixes are left-padded
                at, end = slot[row], group.prefix + item.forward_length
                kv = stacked[:, :, at : at + 1, :, group.prefix - node.depth : end]
                firsts = values[offset + n_inner : offset + n_inner + len(node.children)]
                children.extend(_Pending(c, kv, first) for c, first in zip(node.children, firsts, strict=True))
        return children


_NAN = float("nan")
_PLACEHOLDER_MASK = torch.zeros((1, 1, 1, 1))


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
        return self.node.forward_length


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
