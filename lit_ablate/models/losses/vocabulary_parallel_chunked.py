"""The ``chunked`` loss on a vocabulary-sharded LM head (tensor parallelism): each rank holds rows
``[start, start + V / tp)`` of the head and never sees the other ranks' logits.

Per token chunk a rank forms its own logit columns only (``chunk_tokens x V / tp``) and reduces them
to its partial log-sum-exp and, where the target falls in its columns, the target logit. Two
all-reduces over the ``tp`` group, of ``[N]`` numbers each, then give every rank the whole
vocabulary's log-sum-exp (the ranks' max, then the sum of ``exp(partial - max)`` together with the
target logits) and so the same loss. The gradient pass recomputes the rank's chunk logits against
that global log-sum-exp: ``softmax - onehot`` of its columns gives its head rows' whole gradient
and a partial hidden-state gradient, which is all-reduced once. So ``grad_in_forward`` does not
apply here: the softmax needs the global log-sum-exp, known only after the forward's collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lit_ablate.models.losses.chunked_cross_entropy import IGNORE_INDEX, ChunkGradients, chunked_lse, row_scales


def vocabulary_parallel_chunked_cross_entropy(
    hidden: Tensor,
    weight_shard: Tensor,
    labels: Tensor,
    vocab_start: int,
    group: dist.ProcessGroup,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    z_loss_weight: float = 0.0,
) -> Tensor:
    """fp32 sum over counted tokens of ``CE + z_loss_weight * logsumexp^2`` over the whole vocabulary,
    equal on every rank of ``group``.

    Args:
        hidden: ``[N, H]`` final hidden states, the same on every rank of ``group``.
        weight_shard: ``[V / tp, H]``: this rank's rows of the LM head, from ``vocab_start``.
        labels: ``[N]`` global target ids, already shifted (``-100``: not counted).
    """
    return _VocabularyParallelChunkedCrossEntropy.apply(
        hidden,
        weight_shard,
        labels,
        vocab_start,
        group,
        chunk_tokens,
        chunk_vocab or weight_shard.shape[0],
        z_loss_weight,
    )


def global_log_sum_exp(partial_lse: Tensor, partial_target: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """The whole vocabulary's log-sum-exp and target logit from each rank's columns' (all-reduced)."""
    top = partial_lse.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([(partial_lse - top).exp(), partial_target])
    dist.all_reduce(sums, group=group)
    return top + sums[0].log(), sums[1]


class _VocabularyParallelChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        vocab_start: int,
        group: dist.ProcessGroup,
        chunk_tokens: int,
        chunk_vocab: int,
        z_loss_weight: float,
    ) -> Tensor:
        counted = labels != IGNORE_INDEX
        # Targets in this rank's columns land in [0, V / tp); the others fall outside (-100 too: it
        # may equal another rank's shifted label, so ``counted`` is kept apart).
        local_labels = torch.where(counted, labels - vocab_start, -1)
        partial_lse, partial_target = chunked_lse(hidden, weight, None, local_labels, chunk_tokens, chunk_vocab)
        lse, target = global_log_sum_exp(partial_lse, partial_target, group)
        per_token = lse - target
        if z_loss_weight:
            per_token = per_token + z_loss_weight * lse.square()
        ctx.save_for_backward(hidden, weight, local_labels, counted, lse)
        ctx.group, ctx.chunk_tokens, ctx.chunk_vocab, ctx.z_loss_weight = (
            group,
            chunk_tokens,
            chunk_vocab,
            z_loss_weight,
        )
        return torch.where(counted, per_token, 0.0).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, local_labels, counted, lse = ctx.saved_tensors
        grads = ChunkGradients(hidden, weight, None, (*ctx.needs_input_grad[:2], False))
        scales = row_scales(counted, lse, ctx.z_loss_weight, grad_loss)
        grads.add_every_token(hidden, weight, None, local_labels, lse, scales, ctx.chunk_tokens, ctx.chunk_vocab)
        grad_hidden, grad_weight, _ = grads.finished(None)
        if grad_hidden is not None:  # each rank's columns' share of every token's gradient
            dist.all_reduce(grad_hidden, group=ctx.group)
        return grad_hidden, grad_weight, *(None,) * 6
