"""Collators: how examples become a batch, chosen by ``class_path`` under ``data.init_args.collator``.

A collator owns both halves of batching: which items go together (its ``sampler``: one example
per item for padding, one packed row of examples per item for packing) and how an item list is
laid out as tensors (``__call__``). The data module never asks which collator it has.

Every batch follows the batch contract: ``input_ids`` and ``labels`` (already shifted, -100 = no
loss) of shape ``[B, T]``, plus ``attention_mask`` for padded batches, or ``position_ids``,
``cu_seqlens`` and ``max_seqlen`` for packed ones, and ``document_lengths``: a host-side list of
the real (non-padding) length of every example in the batch, which the FLOPs count reads
without touching a device tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence, Sized
from typing import Any

import torch
from torch import Tensor

from lit_ablate.data.formats import Example
from lit_ablate.data.sampler import ShardedSampler, Sharding
from lit_ablate.errors import ConfigError
from lit_ablate.models.losses.cross_entropy import IGNORE_INDEX


class Collator(ABC):
    """Turns the items a sampler yields into a batch dict.

    ``bind`` is called once by the data module with the tokenizer's pad id and ``seq_len`` before
    any batch is made.
    """

    pad_id: int = 0
    seq_len: int | None = None

    def bind(self, pad_id: int, seq_len: int) -> None:
        self.pad_id, self.seq_len = pad_id, seq_len

    def sampler(self, dataset: Sized, lengths: Sequence[int], sharding: Sharding) -> ShardedSampler:
        """The sampler whose items ``__call__`` receives; by default one example index per item."""
        return ShardedSampler(dataset, sharding)

    @abstractmethod
    def __call__(self, items: list[Any]) -> dict[str, Any]: ...


class PaddingCollator(Collator):
    """One example per row, right-padded: the simple baseline every other layout is compared to.

    Pads to the longest example in the batch (rounded up to ``pad_to_multiple_of``), or always to
    ``seq_len`` with ``static_length`` (fixed shapes, e.g. for ``torch.compile`` without
    recompiles). Padding positions have ``attention_mask`` 0 and label -100.

    Args:
        pad_to_multiple_of: round the padded length up to a multiple of this (8 or 64 suit GPU kernels).
        static_length: pad every batch to ``seq_len``.
    """

    def __init__(self, pad_to_multiple_of: int = 1, static_length: bool = False) -> None:
        if pad_to_multiple_of <= 0:
            raise ConfigError(
                "data.init_args.collator.init_args.pad_to_multiple_of", pad_to_multiple_of, "use a positive integer"
            )
        self.pad_to_multiple_of, self.static_length = pad_to_multiple_of, static_length

    def __call__(self, items: list[Example]) -> dict[str, Tensor]:
        longest = max(len(e["input_ids"]) for e in items)
        if self.static_length:
            if self.seq_len is None or longest > self.seq_len:
                raise ValueError(f"static_length pads to seq_len={self.seq_len}, but an example has {longest} tokens")
            longest = self.seq_len
        length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(items), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(items), length), dtype=torch.long)
        for row, example in enumerate(items):
            n = len(example["input_ids"])
            input_ids[row, :n], labels[row, :n], attention_mask[row, :n] = example["input_ids"], example["labels"], 1
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "document_lengths": [len(e["input_ids"]) for e in items],
        }
