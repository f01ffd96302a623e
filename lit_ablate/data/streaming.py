"""``storage: stream``: examples tokenised on the fly in DataLoader workers, never materialised.

Rows come from ``DataSource.stream_rows`` (``datasets`` streaming for files and the hub). With
``W`` data-parallel ranks and ``K`` workers per rank there are ``W*K`` slots, slot ``rank*K + worker``.
A source in several parts (``LocalFiles``' files, ``MDSShards``' shards, a hub dataset's shards:
``DataSource.stream_shards``) is split by part, so a slot reads only its own parts; parts that do not
divide the slots are shared by row (``slot_reads``). A source in one part is read by every slot,
each keeping the rows whose number is congruent to it modulo ``W*K``. Either way every row is
tokenised by exactly one worker of one rank per epoch: no duplicates, no gaps.

Each worker makes whole batches, and the DataLoader takes them from its workers in turn (worker 0,
1, ..., K-1, 0, ...). So after a rank has consumed ``b`` batches, worker ``k`` has made
``ceil((b - k) / K)`` of them, and worker ``b mod K`` makes the next. A resumed DataLoader starts
again at its worker 0, so its worker ``w`` takes the part (rows and skip) of worker
``(w + b) mod K``: the rank continues with exactly the batch it would have had next. Skipped examples are still read and
tokenised (the count of examples per row is known only then), but never collated or trained on.

The stream repeats epoch after epoch without end (the epoch is not known in advance, and ranks
must never disagree about where it ends), so a run says how long it trains with
``trainer.max_steps``. Examples come in source order within a slot (no shuffle). In the
``pretrain`` format each slot concatenates its own documents and cuts its own ``seq_len``
windows; a slot's partial last window of an epoch is dropped.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from lit_ablate.data.formats import Example, Format, Overlong, document_ids, iter_examples
from lit_ablate.data.sources import DataSource, Row
from lit_ablate.data.tokenizers import Tokenizer
from lit_ablate.errors import ConfigError

log = logging.getLogger(__name__)


def worker_batches_consumed(batches: int, worker: int, workers: int) -> int:
    """Of a rank's first ``batches`` batches, how many worker ``worker`` of ``workers`` made."""
    return max(0, -(-(batches - worker) // workers))


class StreamingExamples(IterableDataset):
    """This rank's examples, slot by slot over the DataLoader's workers, epoch after epoch.

    Args:
        skip_batches: batches this rank already consumed (resume); each worker skips its share.
        epochs: stop after this many epochs (None: never; tests read exactly one epoch).
        shuffle_buffer: shuffle each slot's examples through a buffer of this many (0 or 1: source order).
        seed: the shuffle's seed; with the epoch and the slot it seeds each slot's shuffle of each epoch.
    """

    def __init__(
        self, source: DataSource, tokenizer: Tokenizer, fmt: Format, seq_len: int, overlong: Overlong,
        batch_size: int, rank: int = 0, num_replicas: int = 1, skip_batches: int = 0, epochs: int | None = None,
        shuffle_buffer: int = 0, seed: int = 0,
    ) -> None:
        self.source, self.tokenizer, self.format, self.seq_len, self.overlong = source, tokenizer, fmt, seq_len, overlong
        self.batch_size, self.rank, self.num_replicas = batch_size, rank, num_replicas
        self.skip_batches, self.epochs = skip_batches, epochs
        self.shuffle_buffer, self.seed = shuffle_buffer, seed

    def __iter__(self) -> Iterator[Example]:
        info = get_worker_info()
        workers = info.num_workers if info is not None else 1
        worker = ((info.id if info is not None else 0) + self.skip_batches) % workers  # whose turn it is next
        slots, slot = self.num_replicas * workers, self.rank * workers + worker
        skip = worker_batches_consumed(self.skip_batches, worker, workers) * self.batch_size
        for epoch in itertools.count() if self.epochs is None else range(self.epochs):
            made = 0
            examples = self._epoch(slot, slots, epoch)
            if self.shuffle_buffer > 1:
                rng = random.Random(f"{self.seed}/{epoch}/{slot}")  # a str seed is hashed the same in every process
                examples = shuffled_through_buffer(examples, self.shuffle_buffer, rng)
            for example in examples:
                made += 1
                if skip:
                    skip -= 1
                    continue
                yield example
            if not made:
                raise ConfigError("data.init_args.source", type(self.source).__name__,
                                  f"stream slot {slot} of {slots} (rank {self.rank}, worker {worker}) got no example in "
                                  f"epoch {epoch}: the source has too few rows for {slots} ranks x workers")

    def _rows(self, slot: int, slots: int) -> Iterator[tuple[int, Row]]:
        """``(row number from 1 within its part, row)`` of this slot's rows, read from its own parts only."""
        for shard, every, first in slot_reads(self.source.stream_shards(), slots, slot):
            for number, row in enumerate(self.source.stream_shard(shard), start=1):
                if (number - 1) % every == first:
                    yield number, row


    def _epoch(self, slot: int, slots: int, epoch: int) -> Iterator[Example]:
        if self.format == "pretrain":
            yield from self._windows(slot, slots)
            return
        counts: Counter[str] = Counter()
        for number, row in self._rows(slot, slots):
            yield from iter_examples([row], self.tokenizer, self.format, self.seq_len, self.overlong, counts, number)
        if counts["overlong"]:
            log.warning("data stream (format=%s, slot %d of %d, epoch %d): %d of %d examples were longer than "
                        "seq_len=%d; overlong=%s (%d dropped)", self.format, slot, slots, epoch, counts["overlong"],
                        counts["total"], self.seq_len, self.overlong, counts["dropped"])

    def _windows(self, slot: int, slots: int) -> Iterator[Example]:
        """``seq_len`` windows of this slot's own token stream, labels the next token (as ``pretrain``)."""
        stream: list[int] = []
        for _, row in self._rows(slot, slots):
            stream += document_ids(row, self.tokenizer)
            while len(stream) >= self.seq_len + 1:
                window = torch.tensor(stream[: self.seq_len + 1], dtype=torch.long)
                yield {"input_ids": window[:-1], "labels": window[1:]}
                del stream[: self.seq_len]


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


def shuffled_through_buffer(examples: Iterator[Example], size: int, rng: random.Random) -> Iterator[Example]:
    """The examples in a random order that never holds more than ``size`` of them: each new one takes
    the place of a random buffered one, which is yielded; the rest are shuffled at the end. A pure
    function of the input order and ``rng``, so a resumed slot that skips what it had yielded
    continues with exactly the next example."""
    buffer: list[Example] = []
    for example in examples:
        if len(buffer) < size:
            buffer.append(example)
            continue
        place = rng.randrange(size)
        yield buffer[place]
        buffer[place] = example
    rng.shuffle(buffer)
    yield from buffer
