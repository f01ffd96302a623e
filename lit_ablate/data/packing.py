"""Multipacking: several examples side by side in one row, with attention kept inside each one.

A packed row is a list of examples whose lengths sum to at most ``max_tokens``. The row carries
``position_ids`` restarting at 0 at each example, and each example's last label is -100 (see
``formats.py``), so a packed batch trains exactly the model a padded batch trains, provided the
attention backend keeps documents apart (``lit_ablate.models.attention.backends``: ``sdpa_packed``,
``flex``, ``flash_varlen``, or transformers' ``sdpa`` without a KV cache).

Bin packing is by hand (no maintained library packs token rows for a sampler): first-fit
decreasing (``ffd``: fuller rows) or greedy next-fit in arrival order (``greedy``: the baseline),
each over a window of ``window`` examples so memory stays bounded and packing streams. The
order is a pure function of seed and epoch; every example is in exactly one row per epoch.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_ablate.data.collate import Collator
from lit_ablate.data.formats import OVERLONG_CHOICES, Example, Overlong, fit_length
from lit_ablate.data.sampler import ShardedSampler, Sharding
from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX

log = logging.getLogger(__name__)

PackingStrategy = Literal["ffd", "greedy"]
_KEY = "data.init_args.collator.init_args"


def pack_greedy(order: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Next-fit in arrival order: a new row starts whenever the next example does not fit."""
    rows: list[list[int]] = []
    free = 0
    for i in order:
        if not rows or lengths[i] > free:
            rows.append([])
            free = max_tokens
        rows[-1].append(i)
        free -= lengths[i]
    return rows


def pack_ffd(order: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: longest first, each into the earliest-opened row with room.

    The earliest row with room is found in a max-tree of the rows' free space: O(log window) per
    example, where a scan of the open rows grows with the window. The tree's leaves
    past the open rows are empty rows, so the leftmost leaf with room is the first open row that
    fits, or else the next new row."""
    items = sorted(order, key=lambda i: -lengths[i])  # stable: ties keep arrival order
    size = 1
    while size < len(items):
        size *= 2
    free = [max_tokens] * (2 * size)  # free[node]: the most room in any row under that node
    rows: list[list[int]] = []
    for i in items:
        need = lengths[i]
        node = 1
        if need > max_tokens:  # overlong: alone in a new row
            node = size + len(rows)
        while node < size:
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        if node - size == len(rows):
            rows.append([])
        rows[node - size].append(i)
        free[node] -= need
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return rows


PACKERS = {"ffd": pack_ffd, "greedy": pack_greedy}


def pack(
    order: Sequence[int], lengths: Sequence[int], max_tokens: int, strategy: PackingStrategy, window: int
) -> list[list[int]]:
    """Rows of example indices, packing each ``window`` consecutive examples of ``order`` on its own.

    ``order`` and ``lengths`` may be numpy arrays (a token cache's millions of examples): each window
    is packed over a Python list of its own lengths, so nothing per example is held beyond them."""
    packer = PACKERS[strategy]
    rows: list[list[int]] = []
    for start in range(0, len(order), window):
        indices = [int(i) for i in order[start : start + window]]
        local = [int(lengths[i]) for i in indices]
        rows += [[indices[j] for j in row] for row in packer(range(len(indices)), local, max_tokens)]
    return rows


@dataclass(frozen=True)
class StreamPacking:
    """How a stream packs (``PackingCollator``'s settings): each stream slot packs its own examples,
    ``window`` at a time (``stream_slot.py``)."""

    max_tokens: int
    strategy: PackingStrategy
    window: int
    overlong: Overlong

    def keeps(self, example: Example) -> bool:
        """Whether the example is packed at all: ``reject`` drops those longer than ``max_tokens``
        before windows are counted, as ``PackedSampler`` drops them from its order."""
        return self.overlong != "reject" or len(example["input_ids"]) <= self.max_tokens

    def rows(self, examples: Sequence[Example]) -> list[list[Example]]:
        """One window's packed rows: what ``PackedSampler`` makes of the same kept examples in this
        order (``truncate`` packs an overlong example capped, alone in its row)."""
        lengths = [min(len(e["input_ids"]), self.max_tokens) for e in examples]
        return [
            [examples[i] for i in row]
            for row in pack(range(len(examples)), lengths, self.max_tokens, self.strategy, max(1, len(examples)))
        ]


def balance_across_ranks(
    rows: list[list[int]], lengths: Sequence[int], num_replicas: int, rows_per_rank: int
) -> list[list[list[int]]]:
    """Per rank, its rows: each step's ``num_replicas * rows_per_rank`` rows are dealt largest
    first to the rank with the fewest tokens so far, so no rank waits on a fuller one."""
    per_rank: list[list[list[int]]] = [[] for _ in range(num_replicas)]
    step = num_replicas * rows_per_rank
    for start in range(0, len(rows), step):
        group = sorted(rows[start : start + step], key=lambda r: -sum(lengths[i] for i in r))
        capacity = len(group) // num_replicas
        load = [(0, rank) for rank in range(num_replicas)]  # (tokens, rank) of ranks with room
        taken = [0] * num_replicas
        for row in group:
            tokens, rank = heapq.heappop(load)
            per_rank[rank].append(row)
            taken[rank] += 1
            if taken[rank] < capacity:
                heapq.heappush(load, (tokens + sum(lengths[i] for i in row), rank))
    return per_rank


def _flatten(rows: list[list[int]]) -> np.ndarray:
    """The example indices of ``rows``, row after row."""
    return np.fromiter((i for row in rows for i in row), dtype=np.int64)


class PackedSampler(ShardedSampler):
    """Yields packed rows (tuples of example indices) for this data-parallel rank.

    Per epoch: the example order (shuffled by seed and epoch), packed window by window, the rows
    cut to a multiple of the replica count (``drop_last``, training) or padded with repeated rows
    (evaluation), then dealt to ranks balanced by tokens, step by step.
    """

    def __init__(
        self,
        dataset: Sized,
        lengths: Sequence[int],
        max_tokens: int,
        strategy: PackingStrategy,
        window: int,
        overlong: Overlong,
        sharding: Sharding,
    ) -> None:
        super().__init__(dataset, sharding)
        self.lengths, self.max_tokens, self.strategy, self.window = lengths, max_tokens, strategy, window
        self.overlong = overlong
        self._capped = np.minimum(np.asarray(lengths, dtype=np.int64), max_tokens)  # a truncated example's length
        self._rows_epoch: int | None = None
        self._rows: list[tuple[int, ...]] = []
        self.efficiency = 0.0
        too_long = int((np.asarray(lengths) > max_tokens).sum())
        if too_long and self.rank == 0:
            log.warning(
                "packing: %d of %d examples are longer than max_tokens=%d; overlong=%s %s them",
                too_long,
                len(lengths),
                max_tokens,
                overlong,
                "truncates" if overlong == "truncate" else "drops",
            )

    def epoch_rows(self) -> list[list[int]]:
        """All ranks' rows for the current epoch, before balancing: every kept example once."""
        if self.shuffle:
            order = torch.randperm(
                len(self.lengths), generator=torch.Generator().manual_seed(self.seed + self.epoch)
            ).numpy()
        else:
            order = np.arange(len(self.lengths))
        if self.overlong == "reject":
            order = order[np.asarray(self.lengths)[order] <= self.max_tokens]
        return pack(order, self._capped, self.max_tokens, self.strategy, self.window)

    def rank_items(self) -> list[tuple[int, ...]]:
        if self._rows_epoch != self.epoch:
            rows = self.epoch_rows()
            packed = int(self._capped[_flatten(rows)].sum()) if rows else 0
            self.efficiency = packed / max(1, len(rows) * self.max_tokens)
            if self.drop_last:
                rows = rows[: len(rows) - len(rows) % self.num_replicas]
            elif rows:
                rows = rows + rows[: -len(rows) % self.num_replicas]
            mine = balance_across_ranks(rows, self._capped, self.num_replicas, self.batch_size)[self.rank]
            self._rows_epoch, self._rows = self.epoch, [tuple(r) for r in mine]
            rank_zero_info(
                f"packing ({self.strategy}): epoch {self.epoch}, {len(rows)} rows of <= {self.max_tokens} tokens, "
                f"{100 * self.efficiency:.1f}% full"
            )
        return list(self._rows)

    def __len__(self) -> int:
        return len(self.rank_items())


class PackingCollator(Collator):
    """Packs examples into rows of at most ``max_tokens`` tokens: the batch has no padding
    inside rows, so nearly every processed token is a useful one.

    Choose it when example lengths vary (SFT, ``documents`` pretraining); pair it with an
    attention backend that keeps documents apart. ``batch_size`` then counts rows per rank.
    Batches carry ``position_ids`` (restarting at each example), ``cu_seqlens`` (int32, over the
    flattened batch) and ``max_seqlen``; rows shorter than the longest (or than ``max_tokens``
    with ``static_shape``) end in one padding segment that is its own document with no labels.

    Args:
        max_tokens: the row capacity; default the data module's ``seq_len``.
        strategy: ``ffd`` (first-fit decreasing, fuller rows) or ``greedy`` (next-fit in order).
        window: how many examples are packed together (bounded memory; larger packs fuller).
        static_shape: pad every row to exactly ``max_tokens`` (fixed shapes for ``torch.compile``).
        overlong: an example longer than ``max_tokens``: ``truncate`` (alone in its row) or ``reject``.
    """

    def __init__(
        self,
        max_tokens: int | None = None,
        strategy: PackingStrategy = "ffd",
        window: int = 1000,
        static_shape: bool = False,
        overlong: Overlong = "truncate",
    ) -> None:
        if max_tokens is not None and max_tokens <= 0:
            raise ConfigError(f"{_KEY}.max_tokens", max_tokens, "use a positive row capacity (or null for seq_len)")
        if strategy not in PACKERS:
            raise ConfigError(f"{_KEY}.strategy", strategy, f"choose one of {sorted(PACKERS)}")
        if window <= 0:
            raise ConfigError(f"{_KEY}.window", window, "use a positive number of examples")
        if overlong not in OVERLONG_CHOICES:
            raise ConfigError(f"{_KEY}.overlong", overlong, f"choose one of {OVERLONG_CHOICES}")
        self.max_tokens, self.strategy, self.window = max_tokens, strategy, window
        self.static_shape, self.overlong = static_shape, overlong

    @property
    def capacity(self) -> int:
        capacity = self.max_tokens or self.seq_len
        if capacity is None:
            raise ValueError("PackingCollator needs max_tokens or bind(pad_id, seq_len) before use")
        return capacity

    def sampler(self, dataset: Sized, lengths: Sequence[int], sharding: Sharding) -> PackedSampler:
        return PackedSampler(dataset, lengths, self.capacity, self.strategy, self.window, self.overlong, sharding)

    def stream_packing(self) -> StreamPacking:
        """These settings for ``storage: stream``, where each slot packs its own examples."""
        return StreamPacking(self.capacity, self.strategy, self.window, self.overlong)

    def __call__(self, rows: list[list[Example]]) -> dict[str, Any]:
        rows = [[e for e in (fit_length(e, self.capacity, "truncate") for e in row) if e is not None] for row in rows]
        used = [sum(len(e["input_ids"]) for e in row) for row in rows]
        width = self.capacity if self.static_shape else max(used)
        input_ids, labels, position_ids, doc_lengths = [], [], [], []
        for row, n in zip(rows, used):
            segments = [len(e["input_ids"]) for e in row] + ([width - n] if width > n else [])
            input_ids.append(torch.cat([e["input_ids"] for e in row] + [torch.full((width - n,), self.pad_id)]))
            labels.append(torch.cat([e["labels"] for e in row] + [torch.full((width - n,), IGNORE_INDEX)]))
            position_ids.append(torch.cat([torch.arange(s) for s in segments]))
            doc_lengths += segments
        cu_seqlens = torch.zeros(len(doc_lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(doc_lengths).cumsum(0)
        return {
            "input_ids": torch.stack(input_ids).long(),
            "labels": torch.stack(labels).long(),
            "position_ids": torch.stack(position_ids),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": max(doc_lengths),
            "document_lengths": [len(e["input_ids"]) for row in rows for e in row],
        }
