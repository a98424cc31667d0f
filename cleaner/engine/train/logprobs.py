"""Token log-probabilities and entropy from hidden states, never the (M, V) logits at once
(docs/architecture.md §7, "Memory at real shapes").

The full logits of a micro batch are tokens x vocabulary: 4,096 tokens of Qwen's 151,936-token
vocabulary are 2.5 GB in float32 per copy, and autograd keeps several copies (the logits, their
float32 cast, the log-softmax for backward, the softmax for entropy). The train step needs only two
numbers per loss token, log pi(target) and the entropy of the distribution that predicted it, so
`ChunkedLogProbs` applies the lm_head to a chunk of hidden states at a time, keeps the two numbers
and the chunk's log-sum-exp, and frees the chunk's logits; its backward recomputes each chunk's
logits and turns them into the gradients of the hidden states and of the head (the idea of verl's
FusedLinearForPPO and Liger's fused linear cross-entropy). Peak memory is one chunk's logits, a few
times over, whatever the number of tokens.

Design decisions:
- The matmul runs in `compute_dtype` (bfloat16 under --compute-dtype bfloat16), the log-softmax and
  everything after it in float32, as verl and Liger do.
- Entropy is always computed (it is a reported metric) but carries a gradient only when asked
  (an entropy bonus in the loss); otherwise it is marked non-differentiable, and its backward term
  costs nothing.
- The gradients, per token i with p = softmax(z_i), log p = z_i - lse_i, H_i = -sum p log p:
    d log p(target) / dz = onehot(target) - p
    d H / dz = -p * (log p + H)
  so dL/dz = -p * (g_lp + g_H (log p + H)) + g_lp onehot(target), built in place on the chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cleaner.engine.model.head import DEFAULT_CHUNK_TOKENS, chunk_logits, head_in


class TokenOutputs(NamedTuple):
    """A NamedTuple, not a dataclass: ZeRO-3 hooks the backward of a module's outputs only through
    tensors, tuples, lists and dicts, and the head's weight must be gathered again for backward."""

    log_probs: torch.Tensor  # (M,) float32: log pi(target) of each loss token
    entropy: torch.Tensor  # (M,) float32: entropy of the distribution that predicted it


class ChunkedLogProbs(torch.autograd.Function):
    """(hidden (M, H), head weight (V, H), bias (V,) or None, targets (M,)) -> (log_probs, entropy),
    both (M,) float32, one chunk of `chunk_tokens` rows of logits at a time in forward and backward.
    Without `with_entropy` the entropy is zeros and costs nothing."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, dtype: torch.dtype,
                entropy_grad: bool, with_entropy: bool):
        count = hidden.shape[0]
        log_probs = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(log_probs)
        log_norm = torch.empty_like(log_probs)  # lse per token, reused by backward
        head_weight, head_bias = head_in(dtype, weight, bias)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, count, chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                logits = chunk_logits(hidden[rows], head_weight, head_bias, dtype)  # (C, V)
                lse = torch.logsumexp(logits, dim=-1)  # (C,)
                log_probs[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1) - lse
                if with_entropy:
                    logits.sub_(lse[:, None])  # log p, in place: (C, V)
                    entropy[rows] = -logits.exp().mul_(logits).sum(-1)  # two (C, V) copies at most
                log_norm[rows] = lse
        del head_weight, head_bias
        ctx.save_for_backward(hidden, weight, bias, targets, log_norm, entropy)
        ctx.chunk_tokens, ctx.dtype, ctx.entropy_grad = chunk_tokens, dtype, entropy_grad and with_entropy
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, targets, log_norm, entropy = ctx.saved_tensors
        dtype, chunk_tokens = ctx.dtype, ctx.chunk_tokens
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(log_norm)
        use_entropy = ctx.entropy_grad and grad_entropy is not None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        head_weight, head_bias = head_in(dtype, weight, bias)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                grad_logits = chunk_logits(hidden[rows], head_weight, head_bias, dtype)  # (C, V), becomes dL/dz
                grad_logits.sub_(log_norm[rows, None])  # log p
                probs = grad_logits.exp()  # (C, V)
                if use_entropy:
                    grad_logits.add_(entropy[rows, None]).mul_(grad_entropy[rows, None])
                    grad_logits.add_(grad_log_probs[rows, None])  # g_lp + g_H (log p + H)
                else:
                    grad_logits.copy_(grad_log_probs[rows, None].expand_as(grad_logits))
                grad_logits.mul_(probs).neg_()
                del probs
                grad_logits.scatter_add_(-1, targets[rows, None], grad_log_probs[rows, None])
                if grad_hidden is not None:
                    grad_hidden[rows] = (grad_logits.to(dtype) @ head_weight).to(hidden.dtype)
                if grad_weight is not None and dtype == torch.float32:
                    grad_weight.addmm_(grad_logits.t(), hidden[rows].float())  # no (V, H) temporary
                elif grad_weight is not None:  # the product in `dtype`, accumulated in float32
                    grad_weight.add_(grad_logits.t().to(dtype) @ hidden[rows].to(dtype))
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_token_outputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                          dtype: torch.dtype = torch.float32, entropy_grad: bool = False,
                          with_entropy: bool = True) -> TokenOutputs:
    """log pi(targets) and entropy from the hidden states that predict them; (M, H) -> (M,) each.

    hidden: the final hidden states (after the model's last norm) at the positions BEFORE each
    target; weight, bias: the lm_head's. Differentiable in hidden, weight and bias; in entropy only
    with `entropy_grad`. Without `with_entropy`, entropy is zeros (the KL reference's case)."""
    log_probs, entropy = ChunkedLogProbs.apply(hidden, weight, bias, targets, chunk_tokens, dtype,
                                               entropy_grad, with_entropy)
    return TokenOutputs(log_probs=log_probs, entropy=entropy)
