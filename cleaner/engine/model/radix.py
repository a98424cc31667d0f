"""The radix tree the prefix-trie scorer walks (docs/architecture.md §6).

Each node holds an edge of tokens that every row below it shares; the root's edge is empty. Long
edges become chains of nodes, so a forward never exceeds its budget: pieces of max_edge_tokens near
the root, longer ones deep in a row (a sixteenth of their depth, at most 8 x max_edge_tokens),
because the scorer copies a piece's whole prefix cache into its attention batch: with pieces of a
fixed size that copying grows with the square of a row's length, with these about linearly.
The scorer writes each node's log-probs in place, and `path_logprobs` reads a row back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Node:
    """A radix-tree node: `edge` follows `depth` tokens shared by every row below it."""

    edge: tuple[int, ...]
    depth: int  # tokens before the edge
    children: list[Node] = field(default_factory=list)
    parent: Node | None = None
    ending_rows: list[int] = field(default_factory=list)  # rows whose sequence ends with this edge
    logprobs: list[float] = field(default_factory=list)  # per edge token; NaN where nobody asked
    first_scored: int = 0  # first absolute position whose log-prob some row below this node wants

    @property
    def forward_length(self) -> int:
        """Edge tokens a scorer forwards: a leaf's last token is context for nothing, so not it."""
        return len(self.edge) if self.children else len(self.edge) - 1


def build_radix_tree(sequences: Sequence[Sequence[int]], max_edge_tokens: int,
                     max_piece_tokens: int | None = None) -> Node:
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
            node = _add_chain(parent, tuple(first[depth:shared]), depth, max_edge_tokens, max_piece_tokens)
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


DEPTH_PER_PIECE_TOKEN = 16  # a piece deep in a row is up to 1/16 of its depth (module notes)
MAX_PIECE_FACTOR = 8  # and at most this many times max_edge_tokens


def piece_tokens(depth: int, max_edge_tokens: int, max_piece_tokens: int | None = None) -> int:
    """The longest piece that starts at `depth` (at most `max_piece_tokens`, default 8 x max_edge_tokens)."""
    cap = MAX_PIECE_FACTOR * max_edge_tokens if max_piece_tokens is None else max(max_piece_tokens, max_edge_tokens)
    return min(max(max_edge_tokens, depth // DEPTH_PER_PIECE_TOKEN), cap)


def _add_chain(parent: Node, edge: tuple[int, ...], depth: int, max_edge_tokens: int,
               max_piece_tokens: int | None) -> Node:
    """Attach `edge` under `parent` as a chain of pieces (`piece_tokens`); returns the last one."""
    offset = 0
    while offset < len(edge):
        size = piece_tokens(depth + offset, max_edge_tokens, max_piece_tokens)
        node = Node(edge=edge[offset : offset + size], depth=depth + offset, parent=parent)
        parent.children.append(node)
        parent = node
        offset += size
    return parent


def mark_first_scored(root: Node, starts: Sequence[int]) -> None:
    """Set every node's first_scored: the smallest start among the rows that pass through it."""
    order, pending = [], [root]
    while pending:
        node = pending.pop()
        order.append(node)
        pending.extend(node.children)
    for node in reversed(order):  # children before parents
        node.first_scored = min(
            [starts[i] for i in node.ending_rows] + [child.first_scored for child in node.children]
        )


def tokens_to_forward(root: Node) -> int:
    """Tokens a scorer forwards over the tree: every edge once (`Node.forward_length`)."""
    total, pending = 0, list(root.children)
    while pending:
        node = pending.pop()
        total += node.forward_length
        pending.extend(node.children)
    return total


def nodes_with_ending_rows(root: Node) -> list[Node]:
    found, pending = [], [root]
    while pending:
        node = pending.pop()
        if node.ending_rows:
            found.append(node)
        pending.extend(node.children)
    return found


def path_logprobs(node: Node) -> list[float]:
    """Log-probs of every position from the root to the end of `node` (entry 0 is NaN)."""
    pieces = []
    while node is not None:
        pieces.append(node.logprobs)
        node = node.parent
    return [lp for piece in reversed(pieces) for lp in piece]


def row_logprobs(root: Node, starts: Sequence[int]) -> list[list[float]]:
    """What a scorer returns once it has filled the tree's log-probs: for row i, those of positions
    starts[i] to the end of its sequence."""
    results: list[list[float]] = [[] for _ in starts]
    for node in nodes_with_ending_rows(root):
        path = path_logprobs(node)
        for index in node.ending_rows:
            results[index] = path[starts[index]:]
    return results
