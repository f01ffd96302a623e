"""Ring attention: exact causal attention over a sequence split across context-parallel ranks.

Each rank keeps its queries and passes its keys and values around the ring of ranks (point to
point, one stacked K/V message per hop, the next hop in flight while the current block computes).
Every (query chunk, key chunk) pair runs through a block kernel that returns the block's output
and log-sum-exp; blocks are merged by their log-sum-exps in fp32, so the result is the softmax
over all keys. Pairs where no query sees a key are skipped (later chunks, other documents:
``ChunkMasks``). The backward recomputes each block from the final output and log-sum-exp (the
flash-attention backward), sends K/V around the ring once more, and sends each block's dK/dV
along with it, one extra hop bringing the sum home. Keys and values travel with their own
``num_key_value_heads`` (GQA is never expanded on the wire or in the kernel).

Written by hand because torch's ``context_parallel`` has no CPU path (PLATFORM_NOTES): the block
kernel is ATen's CPU flash-attention op, the one SDPA itself runs on CPU, which takes a mask and
returns the log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lit_ablate.models.chunk_masks import BlockMask, ChunkMasks

KV_TAG, GRAD_KV_TAG = 0, 1


class Ring:
    """The ranks of ``group`` in a ring: each sends to the next and receives from the previous."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if self.size > 1:
            self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def source(self, step: int) -> int:
        """The rank whose keys and values this rank holds at ``step`` of a pass around the ring."""
        return (self.rank - step) % self.size

    def pass_on(self, tensor: Tensor, tag: int) -> Callable[[], Tensor]:
        """Send ``tensor`` to the next rank, receive the previous rank's; returns a wait for it."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.previous, self.group, tag),
        ])

        def wait() -> Tensor:
            for work in works:
                work.wait()
            return received

        return wait


def block_forward(q: Tensor, k: Tensor, v: Tensor, block: BlockMask, scale: float | None) -> tuple[Tensor, Tensor]:
    """One block's ``(output, fp32 log-sum-exp)``; rows that see no key get a log-sum-exp of -inf
    (the kernel reports 0 for them, which a merge would count as weight)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale
    )
    if block.rows is not None:
        lse = lse.masked_fill(~block.rows, float("-inf"))
    return out, lse


def block_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, block: BlockMask, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's ``(dq, dk, dv)`` given the *whole* attention's output and log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, block.causal, attn_mask=block.additive(q.dtype), scale=scale
    )


def merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> None:
    """In place: ``out``/``lse`` (fp32, the keys so far) become the attention over those keys and the block's."""
    merged = torch.logaddexp(lse, block_lse)
    finite = merged.masked_fill(merged == float("-inf"), 0.0)  # rows that have seen no key yet stay 0
    out.mul_(torch.exp(lse - finite).unsqueeze(-1)).add_(block_out.float() * torch.exp(block_lse - finite).unsqueeze(-1))
    lse.copy_(merged)


def _slot(t: Tensor, slot: int, length: int) -> Tensor:
    """Chunk ``slot`` of a shard along its sequence dimension (-2 of ``[..., T, D]``, -1 of ``[..., T]``)."""
    dim = -1 if t.dim() == 3 else -2
    return t.narrow(dim, slot * length, length)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, masks: ChunkMasks, ring: Ring, scale: float | None) -> Tensor:
        c = masks.chunk_len
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.size - 1 else None
            for (q_slot, q_chunk), (k_slot, k_chunk) in _pairs(masks, ring.rank, ring.source(step)):
                block = masks.block(q_chunk, k_chunk)
                if block is None:
                    continue
                block_out, block_lse = block_forward(
                    _slot(q, q_slot, c), _slot(kv[0], k_slot, c), _slot(kv[1], k_slot, c), block, scale
                )
                merge_block(_slot(out, q_slot, c), _slot(lse, q_slot, c), block_out, block_lse)
            if incoming is not None:
                kv = incoming()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.ring, ctx.scale = masks, ring, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        masks, ring, scale = ctx.masks, ctx.ring, ctx.scale
        c = masks.chunk_len
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        partial: Callable[[], Tensor] | None = None  # the dK/dV of this step's source, summed by the ranks before
        for step in range(ring.size):
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.size - 1 else None
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for (q_slot, q_chunk), (k_slot, k_chunk) in _pairs(masks, ring.rank, ring.source(step)):
                block = masks.block(q_chunk, k_chunk)
                if block is None:
                    continue
                dq, dk, dv = block_backward(
                    _slot(grad_out, q_slot, c), _slot(q, q_slot, c), _slot(kv[0], k_slot, c), _slot(kv[1], k_slot, c),
                    _slot(out, q_slot, c), _slot(lse, q_slot, c), block, scale,
                )
                _slot(grad_q, q_slot, c).add_(dq)
                _slot(grad_kv[0], k_slot, c).add_(dk)
                _slot(grad_kv[1], k_slot, c).add_(dv)
            if partial is not None:
                grad_kv += partial()
            # On to the next rank; after the last step that is the keys' owner (the hop home).
            partial = ring.pass_on(grad_kv, GRAD_KV_TAG) if ring.size > 1 else (lambda g=grad_kv: g)
            if incoming is not None:
                kv = incoming()
        grad_kv = partial()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None


def _pairs(masks: ChunkMasks, rank: int, source: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Every (query chunk of ``rank``, key chunk of ``source``) pair, as ``(slot, global chunk)`` each."""
    return [(q, k) for q in masks.slots(rank) for k in masks.slots(source)]


def ring_attention(q: Tensor, k: Tensor, v: Tensor, masks: ChunkMasks, group: ProcessGroup | None,
                   scale: float | None = None) -> Tensor:  # fmt: skip
    """Causal attention of this rank's queries over the keys of every rank of ``group``.

    ``q``: ``[B, H, T_local, D]``; ``k``/``v``: ``[B, H_kv, T_local, D]`` (this rank's shard, in
    ``masks.layout`` order). Returns ``[B, H, T_local, D]``. ``group`` None: one rank, no ring.
    """
    return _RingAttention.apply(q, k, v, masks, Ring(group), scale)
