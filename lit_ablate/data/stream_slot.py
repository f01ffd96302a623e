"""One stream slot's items, resumable after any of them: rows -> examples -> shuffle buffer -> packed rows.

A slot (one DataLoader worker of one rank: ``streaming.py``) reads its parts of the source, tokenises
the rows into examples, may shuffle them through a buffer and may pack them into rows. After each
item it serves, ``SlotStream.state()`` says where it stands, and a ``SlotStream`` made with that state
serves exactly the items that followed, without reading again what came before:

- rows: which of the slot's parts is being read and that part's position after the last row read
  (``DataSource.stream_part``: a byte offset for JSONL and text files, a row group for Parquet,
  ``datasets``' state for a hub stream);
- examples: the position before the row whose examples are being served, the ``pretrain`` tokens
  carried into that row (at most ``seq_len``) and how many of its examples were served: a resume
  reads that one row again;
- shuffle buffer: the buffered examples themselves (three int32 tensors: 8 bytes per buffered token,
  with every batch and in the checkpoint) and the generator's state;
- packing: the state before the window being served and how many of its rows were served: a resume
  reads that one window again (``PackingCollator.window`` kept examples at most).

A state holds only lists, tuples, ints, strings and tensors: it crosses from a DataLoader worker with
each batch and is saved in checkpoints.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lit_ablate.data.formats import Example, Format, Overlong, document_ids, iter_examples
from lit_ablate.data.packing import StreamPacking
from lit_ablate.data.sources import DataSource, Row
from lit_ablate.data.tokenizers import Tokenizer
from lit_ablate.errors import ConfigError

log = logging.getLogger(__name__)

Item = Example | list[Example]
"""An example, or a packed row of examples."""
State = dict[str, Any]


@dataclass(frozen=True)
class StreamRecipe:
    """What every slot of a stream reads and makes of it.

    Args:
        source, tokenizer, format, seq_len, overlong: the rows and how they become examples (as in memory).
        shuffle_buffer: shuffle each slot's examples through a buffer of this many (0 or 1: source order),
            seeded by ``seed``, the epoch and the slot.
        packing: pack each slot's examples into rows (``PackingCollator.stream_packing``); None: one example
            per item.
        epochs: stop after epoch ``epochs - 1`` (None: never; tests read exactly one epoch).
    """

    source: DataSource
    tokenizer: Tokenizer
    format: Format
    seq_len: int
    overlong: Overlong
    shuffle_buffer: int = 0
    seed: int = 0
    packing: StreamPacking | None = None
    epochs: int | None = None


class SlotStream:
    """Slot ``slot`` of ``slots`` of the stream ``recipe``: its examples, or packed rows, epoch after epoch.

    Args:
        reads: the slot's ``(part, every, first)`` reads of the source (``streaming.slot_reads``).
        state: where a previous read of this slot stopped (``state()`` after the last item it
            served); None: the start of epoch 0.
    """

    def __init__(
        self, recipe: StreamRecipe, slot: int, slots: int, reads: list[tuple[int, int, int]], state: State | None = None
    ) -> None:
        self.recipe, self.slot, self.slots, self.reads = recipe, slot, slots, reads
        self._resume = state
        self._epoch = state["epoch"] if state else 0
        self._items: _Examples | _Buffered | _Packed | None = None

    def state(self) -> State:
        """Where the slot stands after the last item it served."""
        assert self._items is not None, "state() is known once iteration started"
        return {"epoch": self._epoch, "items": self._items.state()}

    def __iter__(self) -> Iterator[Item]:
        resume = self._resume["items"] if self._resume else None
        recipe = self.recipe
        while recipe.epochs is None or self._epoch < recipe.epochs:
            examples, self._items = self._pipeline(resume)
            made = 0
            for item in self._items:
                made += 1
                yield item
            if not made and resume is None:
                raise ConfigError(
                    "data.init_args.source",
                    type(recipe.source).__name__,
                    f"stream slot {self.slot} of {self.slots} got no example in epoch {self._epoch}: "
                    f"the source has too few rows for {self.slots} ranks x workers",
                )
            if examples.counts["overlong"]:
                log.warning(
                    "data stream (format=%s, slot %d of %d, epoch %d): %d of %d examples were longer than "
                    "seq_len=%d; overlong=%s (%d dropped)",
                    recipe.format,
                    self.slot,
                    self.slots,
                    self._epoch,
                    examples.counts["overlong"],
                    examples.counts["total"],
                    recipe.seq_len,
                    recipe.overlong,
                    examples.counts["dropped"],
                )
            self._epoch, resume = self._epoch + 1, None

    def _pipeline(self, state: State | None) -> tuple[_Examples, _Examples | _Buffered | _Packed]:
        """This epoch's stages, each resumed from its part of ``state``."""
        recipe = self.recipe
        upstream_state = state["window"] if state and recipe.packing else state
        examples = _Examples(self, upstream_state)
        items: _Examples | _Buffered | _Packed = examples
        if recipe.shuffle_buffer > 1:
            seed = f"{recipe.seed}/{self._epoch}/{self.slot}"  # a str seed is hashed the same in every process
            items = _Buffered(examples, recipe.shuffle_buffer, seed, upstream_state)
        if recipe.packing is not None:
            items = _Packed(items, recipe.packing, state)
        return examples, items


class _Examples:
    """The slot's rows, read from its own parts, tokenised into examples."""

    def __init__(self, slot: SlotStream, state: State | None) -> None:
        self.slot = slot
        (self.read, self.after, self.number), self.carry, self.served = (
            (tuple(state["rows"]), list(state["carry"]), state["served"]) if state else ((0, None, 0), [], 0)
        )
        self.counts: Counter[str] = Counter()
        self._mark = ((self.read, self.after, self.number), self.carry, self.served)

    def state(self) -> State:
        rows, carry, served = self._mark
        return {"rows": rows, "carry": carry, "served": served}

    def __iter__(self) -> Iterator[Example]:
        skip = self.served
        for before, number, row in self._rows():
            carry = self.carry
            examples, self.carry = self._tokenised(number, row, carry)
            for index in range(skip, len(examples)):
                last = index == len(examples) - 1
                self._mark = (
                    ((self.read, self.after, self.number), self.carry, 0) if last else (before, carry, index + 1)
                )
                yield examples[index]
            skip = 0

    def _rows(self) -> Iterator[tuple[tuple[int, Any, int], int, Row]]:
        """``(position before it, its number from 1 in its part, row)`` for each of the slot's rows."""
        while self.read < len(self.slot.reads):
            part, every, first = self.slot.reads[self.read]
            for row, after in self.slot.recipe.source.stream_part(part, self.after):
                before = (self.read, self.after, self.number)
                self.after, self.number = after, self.number + 1
                if (self.number - 1) % every == first:
                    yield before, self.number, row
            self.read, self.after, self.number = self.read + 1, None, 0

    def _tokenised(self, number: int, row: Row, carry: list[int]) -> tuple[list[Example], list[int]]:
        """The row's examples and the ``pretrain`` tokens carried past it: ``seq_len`` windows of the
        slot's token stream, labels the next token (as ``pretrain``), or one ``documents``/``sft`` example."""
        recipe = self.slot.recipe
        if recipe.format != "pretrain":
            examples = iter_examples(
                [row], recipe.tokenizer, recipe.format, recipe.seq_len, recipe.overlong, self.counts, number
            )
            return list(examples), []
        stream, seq_len, windows = carry + document_ids(row, recipe.tokenizer), recipe.seq_len, []
        start = 0
        while len(stream) - start >= seq_len + 1:
            window = torch.tensor(stream[start : start + seq_len + 1], dtype=torch.long)
            windows.append({"input_ids": window[:-1], "labels": window[1:]})
            start += seq_len
        return windows, stream[start:]


class _Buffered:
    """Examples in a random order that never holds more than ``size`` of them: each new one takes the
    place of a random buffered one, which is served; the rest are shuffled at the end."""

    def __init__(self, upstream: _Examples, size: int, seed: str, state: State | None) -> None:
        self.upstream, self.size = upstream, size
        self.rng = random.Random(seed)
        self.buffer: list[Example] = []
        self.draining = False
        if state:
            self.rng.setstate(_tuples(state["rng"]))
            self.buffer, self.draining = _unpacked(state["buffer"]), state["draining"]

    def state(self) -> State:
        return self.upstream.state() | {
            "buffer": _packed(self.buffer),
            "rng": self.rng.getstate(),
            "draining": self.draining,
        }

    def __iter__(self) -> Iterator[Example]:
        if not self.draining:
            for example in self.upstream:
                if len(self.buffer) < self.size:
                    self.buffer.append(example)
                    continue
                place = self.rng.randrange(self.size)
                served, self.buffer[place] = self.buffer[place], example
                yield served
            self.rng.shuffle(self.buffer)
            self.buffer.reverse()  # served from the end
            self.draining = True
        while self.buffer:
            yield self.buffer.pop()


class _Packed:
    """Rows packed from each ``window`` of kept examples, as ``PackedSampler`` packs a window."""

    def __init__(self, upstream: _Examples | _Buffered, packing: StreamPacking, state: State | None) -> None:
        self.upstream, self.packing = upstream, packing
        self.served = state["rows_served"] if state else 0
        self._mark = (upstream.state(), self.served)

    def state(self) -> State:
        window, served = self._mark
        return {"window": window, "rows_served": served}

    def __iter__(self) -> Iterator[list[Example]]:
        skip, examples = self.served, iter(self.upstream)
        while True:
            start = self.upstream.state()
            window = list(itertools.islice((e for e in examples if self.packing.keeps(e)), self.packing.window))
            if not window:
                return
            rows = self.packing.rows(window)
            for index in range(skip, len(rows)):
                last = index == len(rows) - 1
                self._mark = (self.upstream.state(), 0) if last else (start, index + 1)
                yield rows[index]
            skip = 0


def _packed(examples: list[Example]) -> dict[str, torch.Tensor]:
    """Examples as three int32 tensors (one each, not two per example, to cross processes cheaply:
    the buffer travels with every batch, 8 bytes per buffered token)."""
    lengths = torch.tensor([len(e["input_ids"]) for e in examples], dtype=torch.int32)
    if not examples:
        empty = torch.empty(0, dtype=torch.int32)
        return {"input_ids": empty, "labels": empty, "lengths": lengths}
    return {key: torch.cat([e[key] for e in examples]).to(torch.int32) for key in ("input_ids", "labels")} | {
        "lengths": lengths
    }


def _unpacked(packed: dict[str, torch.Tensor]) -> list[Example]:
    sizes = packed["lengths"].tolist()
    return [
        {"input_ids": ids.long(), "labels": labels.long()}
        for ids, labels in zip(packed["input_ids"].split(sizes), packed["labels"].split(sizes))
    ]


def _tuples(value: Any) -> Any:
    """``random.getstate()``'s nested tuples again (a checkpoint may hand them back as lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
