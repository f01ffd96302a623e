"""Attention of query chunks over key chunks, one block kernel per (query chunk, key chunk) pair.

What both context-parallel implementations compute once the keys are at hand: every pair runs
through a kernel that takes a mask and returns the block's log-sum-exp (on CPU ATen's flash op,
on CUDA torch's memory-efficient op: ``BLOCK_KERNELS``); blocks are merged by their log-sum-exps
in fp32, so the result is the softmax over all keys.
Pairs where no query sees a key are skipped and the others run unmasked or plain causal when
they can (``ChunkMasks.block``), so no ``[T, T]`` mask is ever built or saved. The backward
recomputes each block from the *whole* output and log-sum-exp (the flash-attention backward).
Keys and values keep their own ``num_key_value_heads``: the kernel does GQA itself.

Written by hand because torch's ``context_parallel`` has no CPU path (PLATFORM_NOTES).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from lit_ablate.models.chunk_masks import BlockMask, ChunkMasks

Pair = tuple[tuple[int, int], tuple[int, int]]
"""``((query slot, query chunk), (key slot, key chunk))``: a slot indexes the tensor at hand, a
chunk the whole sequence."""


def block_forward(q: Tensor, k: Tensor, v: Tensor, block: BlockMask, scale: float | None) -> tuple[Tensor, Tensor]:
    """One block's ``(output, fp32 log-sum-exp)``; rows that see no key get an output of 0 and a
    log-sum-exp of -inf (kernels report 0 or NaN for them, which a merge would count as weight)."""
    out, lse = BLOCK_KERNELS[q.device.type][0](q, k, v, block, scale)
    if block.rows is not None:
        out = out.masked_fill(~block.rows[..., None], 0.0)
        lse = lse.masked_fill(~block.rows, float("-inf"))
    return out, lse


def block_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: BlockMask, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's ``(dq, dk, dv)`` given the *whole* attention's output and log-sum-exp."""
    return BLOCK_KERNELS[q.device.type][1](grad_out, q, k, v, out, lse, block, scale)


def cpu_block_forward(q: Tensor, k: Tensor, v: Tensor, block: BlockMask, scale: float | None) -> tuple[Tensor, Tensor]:
    """ATen's CPU flash op: GQA, masks of the query's dtype and the log-sum-exp built in."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale
    )


def cpu_block_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: BlockMask, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale
    )


def cuda_block_forward(q: Tensor, k: Tensor, v: Tensor, block: BlockMask, scale: float | None) -> tuple[Tensor, Tensor]:
    """torch's CUDA memory-efficient op (``_scaled_dot_product_efficient_attention``): the CUDA
    kernel in every torch build that takes a mask and returns the log-sum-exp (flash has no mask).
    Its contract, handled here: equal query and key heads (K/V expanded for the kernel only, never
    on the wire), a ``[B, H, Q, K]`` bias whose rows are 16-element aligned, and a log-sum-exp
    padded to a multiple of 32 queries (except on ROCm), cut back here."""
    groups = q.shape[1] // k.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), _expand_heads(k, groups), _expand_heads(v, groups), _efficient_bias(block, q, k), True,
        0.0, block.causal, scale=scale,
    )  # fmt: skip
    return out, lse[..., : q.shape[-2]]


def cuda_block_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: BlockMask, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    groups = q.shape[1] // k.shape[1]
    rows = q.shape[-2]
    padded = rows if torch.version.hip else math.ceil(rows / 32) * 32
    lse = torch.nn.functional.pad(lse, (0, padded - rows))
    no_dropout = torch.zeros((), dtype=torch.long)  # seed and offset: unread without dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out.contiguous(), q.contiguous(), _expand_heads(k, groups), _expand_heads(v, groups),
        _efficient_bias(block, q, k), out.contiguous(), lse.contiguous(), no_dropout, no_dropout, 0.0,
        [True, True, True, False], block.causal, scale=scale,
    )  # fmt: skip
    return dq, _sum_heads(dk, groups), _sum_heads(dv, groups)


def _expand_heads(t: Tensor, groups: int) -> Tensor:
    """``[B, H_kv, T, D]`` -> ``[B, H_kv * groups, T, D]``, query head h using K/V head h // groups (GQA)."""
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d).contiguous()


def _sum_heads(t: Tensor, groups: int) -> Tensor:
    """The gradient of ``_expand_heads``: each K/V head sums its query heads' gradients."""
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _efficient_bias(block: BlockMask, q: Tensor, k: Tensor) -> Tensor | None:
    """The block's mask as the memory-efficient kernel reads a bias: ``[B, H, Q, K]`` (heads
    broadcast), each row starting on a 16-element boundary (allocated wider, then cut)."""
    if block.mask is None:
        return None
    b, _, rows, keys = block.mask.shape
    aligned = torch.zeros((b, 1, rows, math.ceil(keys / 16) * 16), dtype=q.dtype, device=q.device)
    bias = aligned[..., :keys].masked_fill_(~block.mask, float("-inf"))
    return bias.expand(b, q.shape[1], rows, keys)


BlockKernel = tuple[Callable[..., tuple[Tensor, Tensor]], Callable[..., tuple[Tensor, Tensor, Tensor]]]
BLOCK_KERNELS: dict[str, BlockKernel] = {
    "cpu": (cpu_block_forward, cpu_block_backward),
    "cuda": (cuda_block_forward, cuda_block_backward),
}
"""Device type -> ``(forward, backward)`` block kernels (``ContextParallelStrategy`` refuses other devices)."""


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """In place: ``out``/``lse`` (fp32, the keys so far) become the attention over those keys and the block's."""
    merged = torch.logaddexp(lse, block_lse)
    finite = merged.masked_fill(merged == float("-inf"), 0.0)  # rows that have seen no key yet stay 0
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(merged)


def chunk(t: Tensor, slot: int, length: int) -> Tensor:
    """Chunk ``slot`` of ``t`` along the sequence (dim -2 of ``[..., T, D]``, -1 of ``[B, H, T]``)."""
    return t.narrow(-1 if t.dim() == 3 else -2, slot * length, length)


def forward_blocks(q: Tensor, kv: Tensor, pairs: Iterable[Pair], masks: ChunkMasks, out: Tensor, lse: Tensor,
                   scale: float | None) -> None:  # fmt: skip
    """Merge every pair's block into ``out``/``lse`` (fp32 accumulators shaped like ``q``)."""
    c = masks.chunk_len
    for (q_slot, q_chunk), (k_slot, k_chunk) in pairs:
        block = masks.block(q_chunk, k_chunk)
        if block is not None:
            block_out, block_lse = block_forward(chunk(q, q_slot, c), chunk(kv[0], k_slot, c), chunk(kv[1], k_slot, c),
                                                 block, scale)  # fmt: skip
            merge_block(chunk(out, q_slot, c), chunk(lse, q_slot, c), block_out, block_lse)


def backward_blocks(grad_out: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, pairs: Iterable[Pair],
                    masks: ChunkMasks, grad_q: Tensor, grad_kv: Tensor, scale: float | None) -> None:  # fmt: skip
    """Add every pair's dQ into ``grad_q`` and dK/dV into ``grad_kv`` (fp32, shaped like ``q`` and ``kv``)."""
    c = masks.chunk_len
    for (q_slot, q_chunk), (k_slot, k_chunk) in pairs:
        block = masks.block(q_chunk, k_chunk)
        if block is None:
            continue
        dq, dk, dv = block_backward(
            chunk(grad_out, q_slot, c), chunk(q, q_slot, c), chunk(kv[0], k_slot, c), chunk(kv[1], k_slot, c),
            chunk(out, q_slot, c), chunk(lse, q_slot, c), block, scale,
        )
        chunk(grad_q, q_slot, c).add_(dq)
        chunk(grad_kv[0], k_slot, c).add_(dk)
        chunk(grad_kv[1], k_slot, c).add_(dv)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, kv: Tensor, masks: ChunkMasks, rank: int, scale: float | None) -> Tensor:
        pairs = _all_pairs(masks, rank)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        forward_blocks(q, kv, pairs, masks, out, lse, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.masks, ctx.rank, ctx.scale = masks, rank, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, kv, out, lse = ctx.saved_tensors
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        backward_blocks(grad_out, q, kv, out, lse, _all_pairs(ctx.masks, ctx.rank), ctx.masks, grad_q, grad_kv, ctx.scale)
        return grad_q.to(q.dtype), grad_kv.to(kv.dtype), None, None, None


def _all_pairs(masks: ChunkMasks, rank: int) -> list[Pair]:
    """``rank``'s query chunks against every chunk of a whole-sequence K/V (slot = chunk)."""
    return [(q, (k, k)) for q in masks.slots(rank) for k in range(masks.layout.num_chunks)]


def block_attention(q: Tensor, kv: Tensor, masks: ChunkMasks, rank: int, scale: float | None = None) -> Tensor:
    """Attention of ``rank``'s query chunks (``q`` ``[B, H, T_local, D]``, in layout order) over
    the whole sequence's stacked keys and values (``kv`` ``[2, B, H_kv, T, D]``, in sequence order)."""
    return _BlockAttention.apply(q, kv, masks, rank, scale)
