"""All-gather attention: every context-parallel rank gathers all keys and values, then attends locally.

The simple alternative to the ring (Llama 3's choice for long-context training): one all-gather
of the stacked K/V per layer, whose autograd backward is a reduce-scatter that sums every rank's
dK/dV into the owner's shard. K and V travel as *one* tensor, because two autograd collectives in
one backward can run in different orders on different ranks and silently mix up gradients
(docs/platform.md#two-autograd-collectives-in-one-backward). The local attention is
``block_attention`` (the ring's kernels and block skipping, so ``zigzag`` balances the work as it
does for the ring). It keeps the whole sequence's K/V per layer for backward: more memory than the
ring, fewer and larger messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lit_ablate.models.attention.block_attention import block_attention
from lit_ablate.models.attention.block_kernels import SDPA, BlockKernel
from lit_ablate.models.attention.chunk_masks import ChunkMasks
from lit_ablate.torch_versions import all_gather_autograd


def allgather_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: ChunkMasks,
    group: ProcessGroup | None,
    scale: float | None = None,
    kernel: BlockKernel = SDPA,
) -> Tensor:
    """Causal attention of this rank's queries over the keys of every rank of ``group``.

    Same contract as ``ring_attention``: ``q`` ``[B, H, T_local, D]``, ``k``/``v``
    ``[B, H_kv, T_local, D]`` in ``masks.layout`` order; returns ``[B, H, T_local, D]``.
    """
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    kv = torch.stack([k, v])
    if size > 1:
        gathered = all_gather_autograd(kv, 0, group)
        kv = masks.layout.unshard(list(gathered.chunk(size, dim=0)), dim=-2)
    return block_attention(q, kv, masks, rank, scale, kernel)
