"""Collators for preference pairs: padded (TRL's layout), packed, and packed with a shared prompt.

Every preference batch follows the LM batch contract (``collate.py``: ``input_ids``, ``labels``,
``attention_mask`` or ``position_ids``/``cu_seqlens``/``max_seqlen``, host-side
``document_lengths``) plus:

- ``sequence_ids`` ``[B, T]``: the sequence each position belongs to. Pair ``p`` of the batch's
  ``P`` pairs has its chosen sequence at index ``p`` and its rejected one at ``P + p``; a
  position without a label may carry any index (it adds 0).
- ``num_pairs`` (host int) and ``pair_index`` ``[P]`` (each pair's index in the data set).
- prefix sharing only: ``branch_ids`` ``[B, T]``: 0 on a shared prompt, 1 on a chosen branch,
  2 on a rejected branch (the model builds its attention mask from them and ``position_ids``).

Both sequences of a pair always sit in the same micro-batch (a pair is one dataset item), and in
the same row when packed.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import Any

import torch
from torch import Tensor

from lit_ablate.data.collate import Collator, PaddingCollator
from lit_ablate.data.formats import Example
from lit_ablate.data.packing import PackedSampler, PackingCollator, PackingStrategy, pack_ffd
from lit_ablate.data.preference import shared_pair_tokens, shared_prefix_split, split_pair
from lit_ablate.data.sampler import ShardedSampler, Sharding
from lit_ablate.errors import ConfigError

_KEY = "data.init_args.collator.init_args"


class PreferenceCollator(Collator):
    """Marks collators whose items are preference pairs (``format: preference``)."""


def _pair_keys(pairs: Sequence[Example]) -> dict[str, Any]:
    return {"num_pairs": len(pairs), "pair_index": torch.stack([p["pair_index"] for p in pairs])}


class PreferencePaddingCollator(PaddingCollator, PreferenceCollator):
    """``batch_size`` pairs as ``2 x batch_size`` right-padded rows, all chosen sequences then all
    rejected ones: TRL's layout, the reference every other layout is compared to.

    Args:
        pad_to_multiple_of: round the padded length up to a multiple of this.
        static_length: pad every batch to ``seq_len``.
    """

    def __call__(self, items: list[Example]) -> dict[str, Any]:
        chosen, rejected = zip(*(split_pair(pair) for pair in items))
        batch = super().__call__([*chosen, *rejected])
        rows, width = batch["input_ids"].shape
        batch["sequence_ids"] = torch.arange(rows)[:, None].expand(rows, width).contiguous()
        return batch | _pair_keys(items)


class PreferencePackingCollator(PackingCollator, PreferenceCollator):
    """Pairs packed side by side in rows of at most ``max_tokens``; each sequence is its own
    document (``position_ids`` restart, no attention across documents, log-prob sums per document).

    Two ways to choose a micro-batch's pairs:

    - ``within_batch: false`` (multipacking): the packer fills rows by tokens across the data set
      (``PackedSampler``: ``ffd``/``greedy`` over ``window`` pairs, rows balanced over ranks), and
      ``batch_size`` counts rows. Fullest rows; a step holds a varying number of pairs.
    - ``within_batch: true``: the micro-batch holds ``batch_size`` pairs chosen exactly as
      ``PreferencePaddingCollator`` chooses them, laid out in as few rows as first-fit decreasing
      finds. The same pairs per step as padding, without its padding: losses must agree with it.

    ``prefix_sharing: true`` lays a pair out once as ``[prompt, chosen branch, rejected branch]``
    (each branch opens with the prompt's last token, which predicts its first response token):
    the prompt is computed once per pair. The model masks attention so that the rejected branch
    sees the prompt but not the chosen branch (it needs the ``sdpa`` or ``eager`` attention
    backend, which take that mask); losses and gradients equal the unshared layout's.

    Args:
        max_tokens: row capacity; default ``2 x seq_len`` (a pair of two ``seq_len`` sequences).
            It must be at least that, so that every pair fits a row whole.
        strategy: ``ffd`` or ``greedy`` (multipacking only).
        window: pairs packed together (multipacking only).
        static_shape: pad every row to exactly ``max_tokens``.
        within_batch: pack each padded-style micro-batch's pairs instead of packing across the data set.
        prefix_sharing: compute each pair's prompt once.
    """

    def __init__(
        self,
        max_tokens: int | None = None,
        strategy: PackingStrategy = "ffd",
        window: int = 1000,
        static_shape: bool = False,
        within_batch: bool = False,
        prefix_sharing: bool = False,
    ) -> None:
        super().__init__(max_tokens=max_tokens, strategy=strategy, window=window, static_shape=static_shape)
        self.within_batch, self.prefix_sharing = within_batch, prefix_sharing

    def bind(self, pad_id: int, seq_len: int) -> None:
        super().bind(pad_id, seq_len)
        if self.max_tokens is not None and self.max_tokens < 2 * seq_len:
            raise ConfigError(
                f"{_KEY}.max_tokens",
                self.max_tokens,
                f"a pair of two sequences of up to seq_len={seq_len} tokens must fit one row: use at least "
                f"{2 * seq_len}, or null",
            )

    @property
    def capacity(self) -> int:
        if self.max_tokens is None and self.seq_len is None:
            raise ValueError("PreferencePackingCollator needs max_tokens or bind(pad_id, seq_len) before use")
        return self.max_tokens or 2 * self.seq_len

    def pair_tokens(self, pair: Example) -> int:
        """Tokens the pair occupies in a row under this layout."""
        return shared_pair_tokens(pair) if self.prefix_sharing else len(pair["input_ids"])

    def sampler(self, dataset: Sized, lengths: Sequence[int], sharding: Sharding) -> ShardedSampler:
        if self.within_batch:
            return ShardedSampler(dataset, sharding)
        lengths = [self.pair_tokens(dataset[i]) for i in range(len(dataset))]
        return PackedSampler(dataset, lengths, self.capacity, self.strategy, self.window, "truncate", sharding)

    def __call__(self, items: list[Any]) -> dict[str, Any]:
        if self.within_batch:  # items are pairs: pack this micro-batch's pairs into rows
            rows = pack_ffd(range(len(items)), [self.pair_tokens(p) for p in items], self.capacity)
            items = [[items[i] for i in row] for row in rows]
        pairs = [pair for row in items for pair in row]
        layout = self._shared_rows if self.prefix_sharing else self._unshared_rows
        documents, sequence_ids, extra = layout(items, len(pairs))
        batch = super().__call__(documents)
        for key, rows in {"sequence_ids": sequence_ids, **extra}.items():
            # Each row's values, then the row's padding segment as the packer laid it out (its
            # positions count from 0: a document of its own; other keys are 0 there).
            values = batch[key].clone() if key in batch else torch.zeros_like(batch["input_ids"])
            for r, row in enumerate(rows):
                values[r, : len(row)] = row
            batch[key] = values
        return batch | _pair_keys(pairs)

    @staticmethod
    def _unshared_rows(rows: list[list[Example]], num_pairs: int) -> tuple[list, list[Tensor], dict]:
        """Each pair as two documents: chosen then rejected."""
        documents, sequence_ids, p = [], [], 0
        for row in rows:
            docs, ids = [], []
            for pair in row:
                chosen, rejected = split_pair(pair)
                docs += [chosen, rejected]
                ids += [
                    torch.full((len(chosen["input_ids"]),), p),
                    torch.full((len(rejected["input_ids"]),), num_pairs + p),
                ]
                p += 1
            documents.append(docs)
            sequence_ids.append(torch.cat(ids))
        return documents, sequence_ids, {}

    @staticmethod
    def _shared_rows(rows: list[list[Example]], num_pairs: int) -> tuple[list, list[Tensor], dict]:
        """Each pair as one document ``[prefix, chosen branch, rejected branch]``, with its positions
        (both branches continue from the prefix) and branch ids."""
        documents, sequence_ids, positions, branches, p = [], [], [], [], 0
        for row in rows:
            docs, ids, pos, branch = [], [], [], []
            for pair in row:
                split, (chosen, rejected) = shared_prefix_split(pair)
                n_c, n_r = len(chosen["input_ids"]), len(rejected["input_ids"])
                docs.append(
                    {
                        "input_ids": torch.cat([pair["input_ids"][:split], chosen["input_ids"], rejected["input_ids"]]),
                        "labels": torch.cat([torch.full((split,), -100), chosen["labels"], rejected["labels"]]),
                    }
                )
                ids.append(torch.cat([torch.full((split + n_c,), p), torch.full((n_r,), num_pairs + p)]))
                pos.append(
                    torch.cat([torch.arange(split), torch.arange(split, split + n_c), torch.arange(split, split + n_r)])
                )
                branch.append(
                    torch.cat(
                        [torch.zeros(split, dtype=torch.long), torch.ones(n_c, dtype=torch.long), torch.full((n_r,), 2)]
                    )
                )
                p += 1
            documents.append(docs)
            sequence_ids.append(torch.cat(ids))
            positions.append(torch.cat(pos))
            branches.append(torch.cat(branch))
        return documents, sequence_ids, {"position_ids": positions, "branch_ids": branches}
