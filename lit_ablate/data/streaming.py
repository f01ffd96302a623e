"""``storage: stream``: examples tokenised on the fly in DataLoader workers, never materialised.

Rows come from ``DataSource.stream_part`` (JSONL, text and Parquet files read from a byte offset or
a row group, hub datasets through ``datasets`` streaming: ``stream_parts.py``). With
``W`` data-parallel ranks and ``K`` workers per rank there are ``W*K`` slots, slot ``rank*K + worker``.
A source in several parts (``LocalFiles``' files, ``MDSShards``' shards, a hub dataset's shards:
``DataSource.stream_shards``) is split by part, so a slot reads only its own parts; parts that do not
divide the slots are shared by row (``slot_reads``). A source in one part is read by every slot,
each keeping the rows whose number is congruent to it modulo ``W*K``. Either way every row is
tokenised by exactly one worker of one rank per epoch: no duplicates, no gaps.

Each worker makes whole batches, and the DataLoader takes them from its workers in turn (worker 0,
1, ..., K-1, 0, ...). So after a rank has consumed ``b`` batches, worker ``k`` has made
``ceil((b - k) / K)`` of them, and worker ``b mod K`` makes the next. A resumed DataLoader starts
again at its worker 0, so its worker ``w`` takes the slot of worker ``(w + b) mod K``: the rank
continues with exactly the batch it would have had next.

Each batch carries, under ``STREAM_STATE``, its slot and the slot's state after it
(``stream_slot.py``); the data module keeps the latest per slot and a checkpoint saves them. A resumed
slot starts from its state: it opens its part at the saved position (a byte offset, a row group, a
``datasets`` state) and reads on, never again the rows its consumed batches came from.

The stream repeats epoch after epoch without end (the epoch is not known in advance, and ranks
must never disagree about where it ends), so a run says how long it trains with
``trainer.max_steps``. Examples come in source order within a slot unless a shuffle buffer is set.
In the ``pretrain`` format each slot concatenates its own documents and cuts its own ``seq_len``
windows; a slot's partial last window of an epoch is dropped. With ``PackingCollator`` each slot
packs its own examples, ``window`` at a time, as the in-memory packer packs a window.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from lit_ablate.data.collate import Collator
from lit_ablate.data.stream_slot import Item, SlotStream, State, StreamRecipe
from lit_ablate.errors import ConfigError

STREAM_STATE = "stream_state"
"""The batch key of ``(slot, its state after this batch)``: the data module takes it off every batch."""


def worker_batches_consumed(batches: int, worker: int, workers: int) -> int:
    """Of a rank's first ``batches`` batches, how many worker ``worker`` of ``workers`` made."""
    return max(0, -(-(batches - worker) // workers))


class StreamingExamples(IterableDataset):
    """This rank's examples (or packed rows) of the stream ``recipe``, slot by slot over the DataLoader's
    workers, epoch after epoch.

    Args:
        batch_size: the DataLoader's batch size (with ``skip_batches``, which worker's turn it is).
        skip_batches: batches this rank already consumed (resume): which worker's turn it is.
        positions: each slot's state after its last consumed batch (resume; ``STREAM_STATE``).
    """

    def __init__(
        self,
        recipe: StreamRecipe,
        batch_size: int,
        rank: int = 0,
        num_replicas: int = 1,
        skip_batches: int = 0,
        positions: dict[int, State] | None = None,
    ) -> None:
        self.recipe, self.batch_size, self.rank, self.num_replicas = recipe, batch_size, rank, num_replicas
        self.skip_batches, self.positions = skip_batches, positions or {}

    def __iter__(self) -> Iterator[Item]:
        return iter(self._slot_stream())

    def _slot_stream(self) -> SlotStream:
        """This worker's slot, from its saved position when resumed."""
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        worker = ((info.id if info is not None else 0) + self.skip_batches) % workers  # whose turn it is next
        slots, slot = self.num_replicas * workers, self.rank * workers + worker
        state = self.positions.get(slot)
        if state is None and worker_batches_consumed(self.skip_batches, worker, workers):
            raise ConfigError(
                "ckpt_path",
                f"slot {slot}",
                "the checkpoint has no position for a stream slot that "
                "consumed batches (saved by an older lit-ablate or with other ranks x workers): resume "
                "with the ranks and num_workers it was saved with, or start the run again",
            )
        return SlotStream(self.recipe, slot, slots, slot_reads(self.recipe.source.stream_shards(), slots, slot), state)


class StreamingBatches(StreamingExamples):
    """``StreamingExamples`` made into batches in the worker, each with where its slot stands after it:
    ``(items, (slot, state))``, ``batch_size`` items (a DataLoader with ``batch_size=None`` and
    ``StreamBatchCollate``). The data module reads streams this way, to checkpoint the positions."""

    def __iter__(self) -> Iterator[tuple[list[Item], tuple[int, State]]]:
        stream = self._slot_stream()
        batch: list[Item] = []
        for item in stream:
            batch.append(item)
            if len(batch) == self.batch_size:
                yield batch, (stream.slot, stream.state())
                batch = []
        if batch:
            yield batch, (stream.slot, stream.state())


class StreamBatchCollate:
    """The DataLoader's ``collate_fn`` for ``StreamingBatches``: the collator's batch of the items, plus
    ``STREAM_STATE``."""

    def __init__(self, collator: Collator) -> None:
        self.collator = collator

    def __call__(self, element: tuple[list[Item], tuple[int, State]]) -> dict[str, Any]:
        items, position = element
        return self.collator(items) | {STREAM_STATE: position}


def slot_reads(shards: int, slots: int, slot: int) -> list[tuple[int, int, int]]:
    """What slot ``slot`` of ``slots`` reads of a source in ``shards`` parts: ``(part, every, first)``,
    the rows ``first, first + every, ...`` (from 0) of each of its parts. Every row of every part goes
    to exactly one slot, whether or not the parts divide the slots:

    - ``shards >= slots``: part ``p`` is slot ``p mod slots``'s, read whole (slots may get one part
      more than others: unequal work, never a row twice);
    - ``shards < slots``: slot ``s`` reads part ``s mod shards`` alone, which the ``k`` slots
      ``p, p + shards, ...`` share by row: each keeps every ``k``-th row, from its place among them.
      One part (``shards == 1``) is the whole stream split by row number.
    """
    if shards >= slots:
        return [(part, 1, 0) for part in range(slot, shards, slots)]
    part = slot % shards
    return [(part, len(range(part, slots, shards)), slot // shards)]
