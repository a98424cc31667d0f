"""The prefix-trie scorer's attention (docs/architecture.md §6): one packed forward, attention per
batch of edges over their rows' own prefix caches.

The scorer sends a window of radix-tree edges through the model as ONE unpadded row with explicit
positions, so the linear layers, norms and output head never see padding. Attention is the one
step that needs each row's own prefix, so `trie_attention` is registered with transformers'
`AttentionInterface` and the model is switched to it for the scorer's forwards only
(`packed_attention`, restored in a `finally`: no other thread may run the same model object during
a scoring call). Per `AttentionBatch` it gathers the rows' queries into a padded batch, writes their
keys and values after their prefix caches in the batch's buffer, and attends with a 4-D additive
mask that lets each query see its own prefix and its edge's real tokens up to itself: torch SDPA for
a model loaded with sdpa, the model's own eager function for one loaded with eager (soft-capping
models). Sliding-window layers are plain causal attention while every row fits in the window; a
longer row raises NotImplementedError rather than scoring with the wrong mask.

Prefix caches are LEFT-padded to the batch's longest prefix, so each row's prefix and edge are
contiguous in the buffer after the forward and a child's cache is a view. The mask is float (not
transformers' boolean) and SDPA gets `enable_gqa` on CPU: both are faster there, same values.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from cleaner.engine.model.radix import Node

TORCH_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


class Edge(Protocol):
    """An edge waiting to be forwarded (the scorer's), with its parent path's cache."""

    node: Node
    kv: torch.Tensor | None  # (layers, 2, 1, H, node.depth, D): the path's cache; None at depth 0

    @property
    def forward_length(self) -> int: ...


def attention_bias(depths: torch.Tensor, lengths: torch.Tensor, prefix_length: int, width: int,
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


@dataclass
class AttentionBatch:
    """Edges of one forward that share an attention call: a padded batch of rows x (prefix + edge).

    `buffer` (layers, 2, C, H_kv, prefix + width, D) holds each row's prefix cache LEFT-padded to
    `prefix`; `trie_attention` writes the edges' keys and values after it, layer by layer, so
    after the forward it holds every row's whole path.
    """

    items: list[Edge]
    prefix: int  # longest prefix
    width: int  # longest edge
    buffer: torch.Tensor
    mask: torch.Tensor  # (C, 1, W, P + W) additive
    gather: torch.Tensor  # (C * W,) packed index of each (row, column) slot; padding repeats a row's last token
    real_slots: torch.Tensor  # (n_tokens,) slots holding a real token, in packed order
    n_tokens: int

    @classmethod
    def of(cls, items: list[Edge], first_packed: int, geometry: tuple[int, int, int], dtype: torch.dtype,
           device: torch.device) -> AttentionBatch:
        """The group of `items`, whose tokens start at packed index `first_packed` of the forward."""
        layers, kv_heads, head_dim = geometry
        lengths = [item.forward_length for item in items]
        depths = [item.node.depth for item in items]
        prefix, width = max(depths), max(lengths)
        # zeros: left padding must be finite (masked scores are added to it, and NaN would survive)
        buffer = torch.zeros((layers, 2, len(items), kv_heads, prefix + width, head_dim), dtype=dtype, device=device)
        for row, item in enumerate(items):
            if item.kv is not None:  # plain slice copies: much cheaper than one index_put per parent
                buffer[:, :, row, :, prefix - item.node.depth : prefix] = item.kv[:, :, 0]
        length = torch.tensor(lengths)  # (C,)
        mask = attention_bias(torch.tensor(depths), length, prefix, width, dtype).to(device)
        starts = first_packed + torch.cumsum(length, 0) - length  # (C,) packed offset of each row
        columns = torch.arange(width)[None, :]  # (1, W)
        gather = (starts[:, None] + torch.minimum(columns, length[:, None] - 1)).flatten()  # padding: last token
        real_slots = (columns < length[:, None]).flatten().nonzero().squeeze(1)
        return cls(items, prefix, width, buffer, mask, gather.to(device), real_slots.to(device), sum(lengths))


@dataclass
class _AttentionPlan:
    groups: list[AttentionBatch]
    eager: bool  # the model was loaded with eager attention: use its own eager function, else SDPA
    grouped_query: bool  # SDPA with enable_gqa (CPU) rather than K/V repeated per query head
    longest: int  # the longest path (prefix + edge) of the forward, for sliding-window layers


_PLAN: contextvars.ContextVar[_AttentionPlan | None] = contextvars.ContextVar("cleaner_trie_plan", default=None)
_ATTENTION = "cleaner_trie"


def trie_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention of one packed forward: per group, gather its rows into a padded batch on top of
    their prefix caches, attend with the group's mask, scatter back.

    query (1, H, N, D) and key/value (1, H_kv, N, D) hold the forward's N new tokens (no cache:
    the prefixes live in the groups' buffers); `attention_mask` is the placeholder and is ignored.
    Returns (1, N, H, D) like every transformers attention function.
    """
    plan = _PLAN.get()
    if plan is None:
        raise RuntimeError("cleaner_trie attention runs only inside PrefixTrieScorer's forwards")
    window = kwargs.get("sliding_window")
    if window is not None and plan.longest > window:  # inside the window it is plain causal attention
        raise NotImplementedError(f"PrefixTrieScorer: a row reaches {plan.longest} tokens, past the model's "
                                  f"sliding window of {window}; sliding-window attention is not supported")
    eager = sys.modules[type(module).__module__].eager_attention_forward if plan.eager else None
    layer = module.layer_idx
    queries, keys, values = (tensor[0].transpose(0, 1) for tensor in (query, key, value))  # (N, heads, D)
    out, first = queries.new_empty(queries.shape), 0
    for group in plan.groups:
        rows, width, prefix, index = len(group.items), group.width, group.prefix, group.gather
        q = queries.index_select(0, index).view(rows, width, *queries.shape[1:]).transpose(1, 2)
        group.buffer[layer, 0, :, :, prefix:] = keys.index_select(0, index).view(
            rows, width, *keys.shape[1:]).transpose(1, 2)
        group.buffer[layer, 1, :, :, prefix:] = values.index_select(0, index).view(
            rows, width, *values.shape[1:]).transpose(1, 2)
        k, v = group.buffer[layer, 0], group.buffer[layer, 1]  # (C, H_kv, P + W, D)
        if eager is not None:  # the model's own, e.g. for logit soft-capping
            attended, _ = eager(module, q, k, v, group.mask, scaling=scaling, dropout=0.0, **kwargs)
        else:
            attended = _sdpa(q, k, v, group.mask, scaling, plan.grouped_query)
        out[first : first + group.n_tokens] = attended.reshape(rows * width, *queries.shape[1:])[group.real_slots]
        first += group.n_tokens
    return out.unsqueeze(0), None


_CUDNN = hasattr(SDPBackend, "CUDNN_ATTENTION")


def _sdpa(query, key, value, mask, scaling, grouped_query: bool) -> torch.Tensor:
    """(C, H, W, D) queries over (C, H_kv, T, D) keys and values -> (C, W, H, D); no dropout (scoring).

    With fewer K/V heads than query heads, `enable_gqa` is faster on CPU; on CUDA a mask with
    enable_gqa falls back to the math kernel, so there K/V are repeated per query head.
    """
    repeat = query.shape[1] // key.shape[1]
    if repeat > 1 and not grouped_query:
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    extra = {"enable_gqa": True} if repeat > 1 and grouped_query else {}
    if not query.is_cuda:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, **extra).transpose(1, 2)
    # a GPU: the fused kernels that take a mask, never the math kernel's (C, H, W, T) scores
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, *([SDPBackend.CUDNN_ATTENTION] if _CUDNN else [])]):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, **extra)
    except RuntimeError as error:
        if "No available kernel" not in str(error):
            raise
        raise NotImplementedError(f"PrefixTrieScorer: no fused attention kernel takes a masked batch of {query.dtype} "
                                  f"with head dim {query.shape[-1]} on {query.device} (the math kernel, which builds "
                                  "every score, is never used)") from error
    return out.transpose(1, 2)


AttentionInterface.register(_ATTENTION, trie_attention)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, groups: list[AttentionBatch], grouped_query: bool):
    """Route the model's attention through `trie_attention` for one forward."""
    config = model.config
    loaded = config._attn_implementation
    longest = max(item.node.depth + item.forward_length for group in groups for item in group.items)
    token = _PLAN.set(_AttentionPlan(groups, eager=loaded == "eager", grouped_query=grouped_query,
                                     longest=longest))
    config._attn_implementation = _ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = loaded
        _PLAN.reset(token)
