"""Which keys each query may see when the sequence is split into chunks over context-parallel ranks.

A query sees a key when the key is not later, both lie in the same document and the key is not
padding; every query also sees itself, so no row of attention is empty (padding queries carry no
label, what they compute is never read). Documents and padding are told apart by one integer per
token, its *segment*: the index in the row where its document starts (``global index -
position id``: packed batches restart ``position_ids`` at 0 for each document), or -1 for padding.
It needs no cross-rank prefix sum, unlike counting document starts, so each rank computes its own
tokens' segments and the ranks exchange them once per attention call.

The masks are built per (query chunk, key chunk) pair, so that attention skips the pairs where no
query sees any key (a later chunk; another document), and runs unmasked (or plain causal on the
diagonal) where one document covers both chunks without padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lit_ablate.models.attention.sequence_layout import SequenceLayout

PADDING_SEGMENT = -1


def segment_ids(token_indices: Tensor, position_ids: Tensor, padding_mask: Tensor | None) -> Tensor:
    """``[B, T]`` segment of each token (see the module docstring) from its index in the whole row."""
    segments = token_indices - position_ids
    if padding_mask is not None:
        segments = segments.masked_fill(~padding_mask.bool(), PADDING_SEGMENT)
    return segments


@dataclass(frozen=True)
class BlockMask:
    """How one (query chunk, key chunk) pair is computed.

    ``causal``: the diagonal pair of one document (the kernel's own causal mask). ``mask``: a
    boolean ``[B, 1, Q, K]`` mask (documents, padding), or None for "every key". ``rows``: a
    ``[B, 1, Q]`` boolean, False for queries that see no key of this pair, or None when all do.
    """

    causal: bool = False
    mask: Tensor | None = None
    rows: Tensor | None = None

    def additive(self, dtype: torch.dtype) -> Tensor | None:
        """The mask as 0 / -inf in ``dtype`` (the CPU flash kernel takes masks of the query's dtype)."""
        if self.mask is None:
            return None
        return torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device).masked_fill_(
            ~self.mask, float("-inf")
        )


@dataclass(frozen=True)
class ChunkMasks:
    """The masks of one attention call, from every rank's segments (the same on every rank).

    Args:
        layout: how the sequence is split over the ranks.
        segments: ``[ranks, B, T_local]`` every rank's ``segment_ids``, in shard order.
    """

    layout: SequenceLayout
    segments: Tensor

    @property
    def chunk_len(self) -> int:
        return self.segments.shape[-1] // self.layout.chunks_per_rank

    def slots(self, rank: int) -> tuple[tuple[int, int], ...]:
        """``(slot in the rank's shard, global chunk index)`` for each chunk ``rank`` holds."""
        return tuple(enumerate(self.layout.chunks(rank)))

    def chunk_segments(self, chunk: int) -> Tensor:
        """``[B, chunk_len]`` segments of global chunk ``chunk``."""
        for rank in range(self.layout.size):
            for slot, held in self.slots(rank):
                if held == chunk:
                    return self.segments[rank, :, slot * self.chunk_len : (slot + 1) * self.chunk_len]
        raise IndexError(f"chunk {chunk} is not in a layout of {self.layout.num_chunks} chunks")

    def block(self, q_chunk: int, k_chunk: int) -> BlockMask | None:
        """How to compute queries of ``q_chunk`` against keys of ``k_chunk``; None: skip the pair."""
        if k_chunk > q_chunk:
            return None
        s_q, s_k = self.chunk_segments(q_chunk), self.chunk_segments(k_chunk)
        first = s_q[:, :1]
        if bool((s_q == first).all() & (s_k == first).all() & (first != PADDING_SEGMENT).all()):
            return BlockMask(causal=k_chunk == q_chunk)  # one document, no padding
        mask = (s_q[:, :, None] == s_k[:, None, :]) & (s_k[:, None, :] != PADDING_SEGMENT)
        if k_chunk == q_chunk:
            eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
            mask = (mask & eye.cumsum(0).bool()) | eye  # tril of the diagonal, and each query sees itself
        if not bool(mask.any()):
            return None
        rows = mask.any(-1)
        return BlockMask(mask=mask[:, None], rows=None if bool(rows.all()) else rows[:, None])
