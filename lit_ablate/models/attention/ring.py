"""Ring attention: exact causal attention over a sequence split across context-parallel ranks.

Each rank keeps its queries and passes its keys and values around the ring of ranks (point to
point, one stacked K/V message per hop, the next hop in flight while the current blocks compute
with ``block_attention``'s kernels and log-sum-exp merge). The backward sends K/V around the ring
once more and each block's dK/dV along with it, summed by every rank it passes, one extra hop
bringing the sum home to the keys' owner. Only one block of K/V (and of dK/dV) is ever held
besides the one in flight, so memory per rank does not grow with the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lit_ablate.models.attention.block_attention import Pair, backward_blocks, forward_blocks
from lit_ablate.models.attention.block_kernels import SDPA, BlockKernel
from lit_ablate.models.attention.chunk_masks import ChunkMasks

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
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
                dist.P2POp(dist.irecv, received, self.previous, self.group, tag),
            ]
        )

        def wait() -> Tensor:
            for work in works:
                work.wait()
            return received

        return wait

    def pairs(self, masks: ChunkMasks, step: int) -> list[Pair]:
        """This rank's query chunks against the chunks of the K/V it holds at ``step``."""
        return [(q, k) for q in masks.slots(self.rank) for k in masks.slots(self.source(step))]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, masks: ChunkMasks, ring: Ring, scale: float | None, kernel: BlockKernel
    ) -> Tensor:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.size - 1 else None
            forward_blocks(kernel, q, kv, ring.pairs(masks, step), masks, out, lse, scale)
            if incoming is not None:
                kv = incoming()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.ring, ctx.scale, ctx.kernel = masks, ring, scale, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        masks, ring = ctx.masks, ctx.ring
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        partial: Callable[[], Tensor] | None = None  # dK/dV of this step's source, summed by the ranks before
        for step in range(ring.size):
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.size - 1 else None
            grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            backward_blocks(
                ctx.kernel, grad_out, q, kv, out, lse, ring.pairs(masks, step), masks, grad_q, grad_kv, ctx.scale
            )
            if partial is not None:
                grad_kv += partial()
            # On to the next rank; after the last step that is the keys' owner (the hop home).
            partial = ring.pass_on(grad_kv, GRAD_KV_TAG) if ring.size > 1 else (lambda g=grad_kv: g)
            if incoming is not None:
                kv = incoming()
        grad_kv = partial()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: ChunkMasks,
    group: ProcessGroup | None,
    scale: float | None = None,
    kernel: BlockKernel = SDPA,
) -> Tensor:
    """Causal attention of this rank's queries over the keys of every rank of ``group``.

    ``q``: ``[B, H, T_local, D]``; ``k``/``v``: ``[B, H_kv, T_local, D]`` (this rank's shard, in
    ``masks.layout`` order). Returns ``[B, H, T_local, D]``. ``group`` None: one rank, no ring.
    ``kernel`` computes each block (``block_kernels``).
    """
    return _RingAttention.apply(q, k, v, masks, Ring(group), scale, kernel)
