"""How one sequence is split over the context-parallel ranks: ``contiguous`` or ``zigzag`` chunks.

Under causal attention a token attends to every earlier token, so the chunk at the end of a
sequence costs more than the chunk at its start. ``contiguous`` gives rank ``r`` chunk ``r`` of
``cp`` equal chunks: rank ``r`` attends to ``r + 1`` chunks of keys, the last rank ``cp`` times as
many as the first. ``zigzag`` (head-tail) cuts the sequence into ``2 * cp`` chunks and gives rank
``r`` chunks ``r`` and ``2 * cp - 1 - r``, one cheap and one expensive: every rank attends to the
same number of (query, key) chunk pairs. Attention and batch sharding both read this one map.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LayoutName = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True)
class SequenceLayout:
    """Which chunks of a sequence each of ``size`` ranks holds (see the module docstring).

    Args:
        kind: ``contiguous`` or ``zigzag``.
        size: the number of context-parallel ranks.
    """

    kind: LayoutName = "contiguous"
    size: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown sequence layout {self.kind!r}; choose one of {LAYOUTS}")
        if self.size < 1:
            raise ValueError(f"a layout needs at least one rank, got {self.size}")

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.kind == "zigzag" else 1

    @property
    def num_chunks(self) -> int:
        """Chunks the whole sequence is cut into: its length must be a multiple of this."""
        return self.size * self.chunks_per_rank

    def chunks(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices ``rank`` holds, in the order its shard stores them."""
        if self.kind == "zigzag":
            return (rank, self.num_chunks - 1 - rank)
        return (rank,)

    def shard(self, tensor: Tensor, rank: int, dim: int = 1) -> Tensor:
        """``rank``'s part of ``tensor`` along ``dim`` (the sequence): its chunks, concatenated."""
        pieces = tensor.chunk(self.num_chunks, dim=dim)
        return torch.cat([pieces[c] for c in self.chunks(rank)], dim=dim)

    def unshard(self, shards: list[Tensor], dim: int = 1) -> Tensor:
        """The whole sequence from every rank's shard (in rank order): the inverse of ``shard``."""
        pieces: list[Tensor | None] = [None] * self.num_chunks
        for rank, part in enumerate(shards):
            for chunk, piece in zip(self.chunks(rank), part.chunk(self.chunks_per_rank, dim=dim)):
                pieces[chunk] = piece
        return torch.cat(pieces, dim=dim)

    def token_indices(self, rank: int, length: int, device: torch.device | str | None = None) -> Tensor:
        """The positions in the whole sequence (of ``length`` tokens) of ``rank``'s tokens, in shard order."""
        return self.shard(torch.arange(length, device=device), rank, dim=0)
