"""The sampler: which items each data-parallel rank reads, in which order, resumable mid-epoch.

It subclasses ``DistributedSampler`` because Lightning replaces any other sampler when it runs
distributed (and would then shard by *global* rank, which is wrong under tensor or expert
parallelism). With ``W`` replicas, rank ``r`` reads items ``r, r+W, r+2W, ...`` of the epoch's
order, so ``W`` ranks with micro-batch ``b`` see, step by step, the same items as one process with
batch ``W*b``: data-parallel runs are comparable to single-process ones.

An item is an example index, or a tuple of indices (a packed row: see ``packing.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler


@dataclass(frozen=True)
class Sharding:
    """What every sampler is built from: this rank's place among the data-parallel replicas, the
    epoch's order (shuffled by seed and epoch, or not), whether a last partial share is cut, and
    the items per rank per step (which packed samplers balance rows by)."""

    num_replicas: int = 1
    rank: int = 0
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    batch_size: int = 1


class ShardedSampler(DistributedSampler):
    """Shuffled (per seed and epoch) example order, sharded over data-parallel ranks.

    ``resume(epoch, items)`` makes the next iteration of that epoch skip its first ``items``
    items at the index level: nothing skipped is loaded or tokenised.
    """

    def __init__(self, dataset: Sized, sharding: Sharding = Sharding()) -> None:
        super().__init__(
            dataset,
            num_replicas=sharding.num_replicas,
            rank=sharding.rank,
            shuffle=sharding.shuffle,
            seed=sharding.seed,
            drop_last=sharding.drop_last,
        )
        self.batch_size = sharding.batch_size
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, items: int) -> None:
        """Skip the first ``items`` items of epoch ``epoch`` (once: the next epochs start at 0)."""
        self._resume = (epoch, items) if items > 0 else None

    def rank_items(self) -> Sequence[Any]:
        """This rank's items for the current epoch, in order, before any resume skip.

        ``DistributedSampler``'s order (the same permutation, padding and stride), as one int64
        array instead of Python lists: 8 bytes per example, for data sets of millions of them."""
        if self.shuffle:
            order = torch.randperm(
                len(self.dataset), generator=torch.Generator().manual_seed(self.seed + self.epoch)
            ).numpy()
        else:
            order = np.arange(len(self.dataset))
        order = np.resize(order, self.total_size)  # drop_last cuts, otherwise the order repeats to fill
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[Any]:
        items = self.rank_items()
        if self._resume is not None and self._resume[0] == self.epoch:
            items = items[self._resume[1] :]
        self._resume = None
        return (int(i) for i in items) if isinstance(items, np.ndarray) else iter(items)
