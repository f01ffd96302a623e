"""Attention of query chunks over key chunks, one block kernel per (query chunk, key chunk) pair.

What both context-parallel implementations compute once the keys are at hand: every pair runs
through a block kernel that returns the block's log-sum-exp (``block_kernels``: torch's SDPA
ops, flash-attn or flex); blocks are merged by their log-sum-exps in fp32, so the result is the
softmax over all keys.
Pairs where no query sees a key are skipped and the others run unmasked or plain causal when
they can (``ChunkMasks.block``), so no ``[T, T]`` mask is ever built or saved. The backward
recomputes each block from the *whole* output and log-sum-exp (the flash-attention backward).
Keys and values keep their own ``num_key_value_heads``: the kernels do GQA themselves.

Written by hand because torch's ``context_parallel`` has no CPU path for any SDPA backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from lit_ablate.models.attention.block_kernels import SDPA, BlockInputs, BlockKernel
from lit_ablate.models.attention.chunk_masks import ChunkMasks

Pair = tuple[tuple[int, int], tuple[int, int]]
"""``((query slot, query chunk), (key slot, key chunk))``: a slot indexes the tensor at hand, a
chunk the whole sequence."""


def block_forward(kernel: BlockKernel, x: BlockInputs) -> tuple[Tensor, Tensor]:
    """One block's ``(output, fp32 log-sum-exp)``; rows that see no key get an output of 0 and a
    log-sum-exp of -inf (kernels report 0 or NaN for them, which a merge would count as weight)."""
    out, lse = kernel.forward(x)
    rows = x.block.rows
    if rows is not None:
        out = out.masked_fill(~rows[..., None], 0.0)
        lse = lse.masked_fill(~rows, float("-inf"))
    return out, lse


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """In place: ``out``/``lse`` (fp32, the keys so far) become the attention over those keys and the block's."""
    merged = torch.logaddexp(lse, block_lse)
    finite = merged.masked_fill(merged == float("-inf"), 0.0)  # rows that have seen no key yet stay 0
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(
        block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1)
    )
    lse.copy_(merged)


def chunk(t: Tensor, slot: int, length: int) -> Tensor:
    """Chunk ``slot`` of ``t`` along the sequence (dim -2 of ``[..., T, D]``, -1 of ``[B, H, T]``)."""
    return t.narrow(-1 if t.dim() == 3 else -2, slot * length, length)


def blocks(
    pairs: Iterable[Pair], masks: ChunkMasks, q: Tensor, kv: Tensor, scale: float | None
) -> Iterator[tuple[int, int, BlockInputs]]:
    """``(query slot, key slot, block)`` of every pair in which some query sees some key."""
    c = masks.chunk_len
    for (q_slot, q_chunk), (k_slot, k_chunk) in pairs:
        block = masks.block(q_chunk, k_chunk)
        if block is not None:
            x = BlockInputs(chunk(q, q_slot, c), chunk(kv[0], k_slot, c), chunk(kv[1], k_slot, c), block, scale)
            yield q_slot, k_slot, x


def forward_blocks(
    kernel: BlockKernel,
    q: Tensor,
    kv: Tensor,
    pairs: Iterable[Pair],
    masks: ChunkMasks,
    out: Tensor,
    lse: Tensor,
    scale: float | None,
) -> None:
    """Merge every pair's block into ``out``/``lse`` (fp32 accumulators shaped like ``q``)."""
    c = masks.chunk_len
    for q_slot, _, x in blocks(pairs, masks, q, kv, scale):
        block_out, block_lse = block_forward(kernel, x)
        merge_block(chunk(out, q_slot, c), chunk(lse, q_slot, c), block_out, block_lse)


def backward_blocks(
    kernel: BlockKernel,
    grad_out: Tensor,
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    pairs: Iterable[Pair],
    masks: ChunkMasks,
    grad_q: Tensor,
    grad_kv: Tensor,
    scale: float | None,
) -> None:
    """Add every pair's dQ into ``grad_q`` and dK/dV into ``grad_kv`` (fp32, shaped like ``q`` and ``kv``)."""
    c = masks.chunk_len
    for q_slot, k_slot, x in blocks(pairs, masks, q, kv, scale):
        dq, dk, dv = kernel.backward(x, chunk(out, q_slot, c), chunk(lse, q_slot, c), chunk(grad_out, q_slot, c))
        chunk(grad_q, q_slot, c).add_(dq)
        chunk(grad_kv[0], k_slot, c).add_(dk)
        chunk(grad_kv[1], k_slot, c).add_(dv)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q: Tensor, kv: Tensor, masks: ChunkMasks, rank: int, scale: float | None, kernel: BlockKernel
    ) -> Tensor:
        pairs = _all_pairs(masks, rank)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        forward_blocks(kernel, q, kv, pairs, masks, out, lse, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.masks, ctx.rank, ctx.scale, ctx.kernel = masks, rank, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, out, lse = ctx.saved_tensors
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        backward_blocks(
            ctx.kernel,
            grad_out,
            q,
            kv,
            out,
            lse,
            _all_pairs(ctx.masks, ctx.rank),
            ctx.masks,
            grad_q,
            grad_kv,
            ctx.scale,
        )
        return grad_q.to(q.dtype), grad_kv.to(kv.dtype), None, None, None, None


def _all_pairs(masks: ChunkMasks, rank: int) -> list[Pair]:
    """``rank``'s query chunks against every chunk of a whole-sequence K/V (slot = chunk)."""
    return [(q, (k, k)) for q in masks.slots(rank) for k in range(masks.layout.num_chunks)]


def block_attention(
    q: Tensor, kv: Tensor, masks: ChunkMasks, rank: int, scale: float | None = None, kernel: BlockKernel = SDPA
) -> Tensor:
    """Attention of ``rank``'s query chunks (``q`` ``[B, H, T_local, D]``, in layout order) over
    the whole sequence's stacked keys and values (``kv`` ``[2, B, H_kv, T, D]``, in sequence order)."""
    return _BlockAttention.apply(q, kv, masks, rank, scale, kernel)
