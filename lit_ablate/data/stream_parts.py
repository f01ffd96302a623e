"""Reading one part of a stream from a saved position, so a resumed stream never reads again what it consumed.

Each reader yields ``(row, position)``: the row and where the part continues after it. Reading the
part again from that position (``DataSource.stream_part(index, position)``) gives exactly the rows
that followed. Positions are tuples of ints (and, for ``datasets`` streams, ``datasets``' own state
dict): they travel from DataLoader workers with each batch and are saved in checkpoints.

- JSONL and text files: the byte offset of the next line, reached with one ``seek``. Read here
  line by line rather than through ``datasets``, whose JSON and text readers can only skip rows by
  reading them again (``datasets`` 5.2's ``ArrowExamplesIterable`` re-parses a shard up to its
  saved ``shard_example_idx``). Text lines split as ``datasets``' text builder splits them (universal
  newlines: ``\\n``, ``\\r\\n`` and a lone ``\\r``).
- Parquet files: the row group and the rows of it already read: a resume reads that row group again
  (the unit Parquet can seek to), none before it.
- ``datasets`` streams (``HubDataset``): ``IterableDataset.state_dict()`` after each batch of
  ``batch`` rows, and the rows of the next batch already read: a resume loads the state (earlier
  shards are not opened) and skips those rows of one batch.
- Anything else (``counted_rows``): the number of rows read; a resume reads the part's rows before it
  again, without tokenising them.

``max_rows`` counts rows over the whole part; the count rides in the position.
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

Row = dict[str, Any]
Position = Any


class UnreadableRow(ValueError):
    """A line that is not a row (bad JSON, not an object, not UTF-8): the source names its config key."""


def counted_rows(rows: Iterable[Row], after: int | None) -> Iterator[tuple[Row, int]]:
    """Rows numbered from 1; resuming after row ``after`` reads (and drops) the rows up to it."""
    for number, row in itertools.islice(enumerate(rows, start=1), after or 0, None):
        yield row, number


def line_rows(
    files: list[str], jsonl: bool, after: tuple[int, int, int, int, int] | None, max_rows: int | None
) -> Iterator[tuple[Row, tuple[int, int, int, int, int]]]:
    """JSONL objects or text lines (``{"text": line}``) of ``files`` in order. A position is
    ``(file, byte offset of a line, its line number, rows of that line already read, rows read)``:
    a text line holding lone ``\\r`` breaks is several rows."""
    first, offset, line_number, done, count = after or (0, 0, 1, 0, 0)
    for index in range(first, len(files)):
        if index != first:
            offset, line_number, done = 0, 1, 0
        with open(files[index], "rb") as f:
            f.seek(offset)
            for line in f:
                end = offset + len(line)
                if offset == 0 and line.startswith(codecs.BOM_UTF8):
                    line = line[len(codecs.BOM_UTF8) :]
                rows = (
                    _json_row(line, files[index], line_number) if jsonl else _text_rows(line, files[index], line_number)
                )
                for piece in range(done, len(rows)):
                    if max_rows is not None and count >= max_rows:
                        return
                    count += 1
                    last = piece == len(rows) - 1
                    yield (
                        rows[piece],
                        (index, end, line_number + 1, 0, count)
                        if last
                        else (index, offset, line_number, piece + 1, count),
                    )
                offset, line_number, done = end, line_number + 1, 0


def _json_row(line: bytes, file: str, number: int) -> list[Row]:
    if not line.strip():
        return []
    try:
        row = json.loads(line)
    except ValueError as bad:  # json.JSONDecodeError, UnicodeDecodeError
        raise UnreadableRow(
            f"line {number} of {file} is not valid JSON ({getattr(bad, 'msg', bad)}); fix or remove that line"
        ) from None
    if not isinstance(row, dict):
        raise UnreadableRow(f"line {number} of {file} is a JSON {type(row).__name__}, not an object; fix or remove it")
    return [row]


def _text_rows(line: bytes, file: str, number: int) -> list[Row]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise UnreadableRow(f"line {number} of {file} is not UTF-8 ({bad.reason}); re-encode the file") from None
    pieces = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if pieces[-1] == "":  # the line's own break
        pieces.pop()
    return [{"text": piece} for piece in pieces]


def parquet_rows(
    files: list[str], after: tuple[int, int, int, int] | None, max_rows: int | None
) -> Iterator[tuple[Row, tuple[int, int, int, int]]]:
    """Rows of Parquet ``files``; a position is ``(file, row group, its rows read, rows read)``."""
    import pyarrow.parquet

    first, first_group, done, count = after or (0, 0, 0, 0)
    for index in range(first, len(files)):
        parquet = pyarrow.parquet.ParquetFile(files[index])
        for group in range(first_group if index == first else 0, parquet.num_row_groups):
            rows = parquet.read_row_group(group).to_pylist()
            for row_index in range(done, len(rows)):
                if max_rows is not None and count >= max_rows:
                    return
                count += 1
                last = row_index == len(rows) - 1
                yield rows[row_index], (index, group + 1, 0, count) if last else (index, group, row_index + 1, count)
            done = 0


def datasets_rows(
    dataset: Any, after: tuple[dict | None, int, int] | None, batch: int, max_rows: int | None
) -> Iterator[tuple[Row, tuple[dict | None, int, int]]]:
    """Rows of a streamed ``datasets.IterableDataset``, read ``batch`` at a time through ``iter``
    (iterating the dataset itself inside a DataLoader worker would shard it over the workers); a
    position is ``(state_dict() before a batch, its rows read, rows read)``."""
    state, done, count = after or (None, 0, 0)
    if state is not None:
        dataset.load_state_dict(state)
    for columns in dataset.iter(batch_size=batch):
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        after_batch = dataset.state_dict()
        for row_index in range(done, len(rows)):
            if max_rows is not None and count >= max_rows:
                return
            count += 1
            last = row_index == len(rows) - 1
            yield rows[row_index], (after_batch, 0, count) if last else (state, row_index + 1, count)
        state, done = after_batch, 0
